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
