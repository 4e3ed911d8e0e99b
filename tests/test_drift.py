"""Lists in the docs that restate the code are held to it: every file a doc or a kernel's comment names exists (a
comment named plugins/ort/fetch_headers.sh, which never did), and every list of the mechanisms names settings.MECHANISMS,
in their order (docs/design.md named 5 of 7)."""

import re
import subprocess
from pathlib import Path

from aqua_export import settings

ROOT = Path(__file__).resolve().parents[1]
# where files are named: the docs, the front page, the kernels' sources and build files
NAMING = ["README.md", "plugins/README.md", "plugins/ort/CMakeLists.txt", "Makefile", "docs/*.md", "docs/**/*.md",
          "plugins/ort/*.cc", "plugins/ort/*.h", "plugins/ort/simd/*.h", "plugins/ort/*.sh", "plugins/*.sh"]
PATH = re.compile(r"(?<![\w/.-])((?:plugins|tools|aqua_export|tests|docs|benchmarks|\.ci)/[\w./-]*\w\.(?:py|sh|cc|h|md|"
                  r"json|cfg|txt|map|toml|jinja|png))")
BARE = re.compile(r"(?<![\w/.-])([\w-]+\.(?:sh|cc|py))\b")  # a source named without its folder


def _files() -> list[Path]:
    return sorted({f for pattern in NAMING for f in ROOT.glob(pattern) if f.is_file()})


def test_every_file_a_doc_or_kernel_comment_names_exists():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    names = {Path(t).name for t in tracked}
    missing = []
    for f in _files():
        text = f.read_text()
        missing += [f"{f.relative_to(ROOT)}: {p}" for p in PATH.findall(text) if not (ROOT / p).exists()]
        missing += [f"{f.relative_to(ROOT)}: {n}" for n in BARE.findall(text) if n not in names]
    assert not missing, missing


def test_every_list_of_the_mechanisms_is_settings_mechanisms():
    want = ", ".join(m.name for m in settings.MECHANISMS)
    lists = []
    for f in [*_files(), ROOT / "aqua_export" / "settings" / "__init__.py"]:
        lists += [(f.name, m) for m in re.findall(r"one module per mechanism \(([\w, ]+)\)", f.read_text())]
    assert len(lists) >= 2 and all(m == want for _, m in lists), (want, lists)


def test_the_restart_figures_in_the_docs_are_the_measured_ones():
    """docs/reference.md said a restarted replica "answers /health within a second"; a newcomer measured 9.1 s. The
    figures it gives now are benchmarks/replicas.json's (python -m tools replicas), and no such promise is left."""
    import json

    doc = (ROOT / "docs" / "reference.md").read_text()
    r = json.loads((ROOT / "benchmarks" / "replicas.json").read_text())
    idle = r["idle_start_s"]
    assert "within a second" not in doc
    assert f"{min(idle):.2f}-{max(idle):.2f} s on an idle machine" in doc
    assert f"{r['fault']['restart_ready_s']:.2f} s while the other replica" in doc


def test_the_front_page_defines_its_folders_names_each_rows_cpu_and_no_commit():
    """README's Results spoke of "the int4 token folder" without its build command, of "this 2-core machine" without
    its CPU, and of commit hashes: each row now names its CPU, the folder's command and the recommended settings are
    given, and no commit hash is left on the front page."""
    readme = (ROOT / "README.md").read_text()
    results = readme[readme.index("## Results"):readme.index("## Documentation")]
    assert "**The int4 token folder**" in results
    command = re.search(r"```bash\n(aqua-export [^\n]+)\n```", results).group(1)
    assert all(flag in command for flag in ("--weights int4", "--token-budget", "--cache-dtype float16"))
    assert "**For speed**" in results and "**for quality**" in results
    rows = [ln for ln in results.splitlines() if ln.startswith("| ") and not ln.startswith(("| what", "|---"))]
    assert rows and all(any(cpu in ln.split("|")[2] for cpu in ("EPYC", "H100", "any")) for ln in rows), rows
    assert not re.search(r"\b(of|at|on) [0-9a-f]{7,40}\b", readme), "a commit hash on the front page"
