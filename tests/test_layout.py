"""The repository's structure, as rules a change cannot break unnoticed: the package's imports form no circle, no
file edits sys.path, nothing imports another package's private names, and every file under benchmarks/ names the
command that writes it (tools/harness.py's registry)."""

import ast
import importlib
import subprocess
from pathlib import Path

from tools import harness

ROOT = Path(__file__).resolve().parents[1]


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split()]


def _imports(path: Path, top_only: bool = False):
    """(module named, names imported) of every from-import in path (top_only: the module-level ones), the module
    resolved from a relative import."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in (tree.body if top_only else ast.walk(tree)):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            yield mod, [a.name for a in node.names]


def test_no_file_edits_sys_path():
    hits = [str(p.relative_to(ROOT)) for p in _tracked("*.py") if "sys.path.insert" in p.read_text()
            and p.name != "test_layout.py"]
    assert not hits, f"import through packages (python -m tools NAME, pytest's pythonpath) instead: {hits}"


def test_no_private_name_is_imported_across_packages():
    bad = []
    for p in _tracked("*.py"):
        here = ".".join(p.relative_to(ROOT).with_suffix("").parts[:-1])
        for mod, names in _imports(p):
            there = mod.rsplit(".", 1)[0] if mod.count(".") else mod
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and mod.startswith(("aqua_export", "tools")) and there != here:
                bad.append(f"{p.relative_to(ROOT)}: {mod} {private}")
    assert not bad, bad


def test_the_package_has_no_import_circle():
    """Module-level imports inside aqua_export (lazy imports inside functions are the stage boundaries, not edges)."""
    graph: dict[str, set[str]] = {}
    for p in (ROOT / "aqua_export").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(p.read_text())
        pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
                deps |= {mod} | {f"{mod}.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aqua_export"):
                deps.add(node.module)
        graph[name] = deps
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    # a package's __init__ may gather its own modules: an edge into a package from inside it is not a circle
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    _assert_no_circle(graph)


def _assert_no_circle(graph: dict[str, set[str]]) -> None:
    """A depth-first walk of module -> the modules it imports; a circle fails, named module by module."""
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError(" -> ".join(path[path.index(d):] + [d]) if d in path else f"{m} -> {d}")
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_tools_import_no_tool_in_a_circle():
    """tools/: every import of one tool by another, lazy ones included (a tool's helpers a second tool needs live in
    a module both import, tools/folders.py or harness.py, instead of one tool importing the other back)."""
    graph = {p.stem: set() for p in (ROOT / "tools").glob("*.py")}
    for p in (ROOT / "tools").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools."):
                graph[p.stem].add(node.module.split(".")[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "tools":
                graph[p.stem] |= {a.name for a in node.names}
    _assert_no_circle({m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()})

# the lower floors and what of the package each may import (anywhere in the file, lazy imports included): nothing
# above it. settings/ reads ops.spec's names. Above them, what runtime/ and serving/ may not import at module level
# (a lazy import is a stage boundary: evaluation's all-logits graph rewrite): the export stage (torch) and above
FLOORS = {"aqua_export.ops": ("aqua_export.ops",),
          # ops.rules (torch) only inside a function: token selection's parity probe counts the pages a prompt leaves
          # out by the rule itself; serving a folder imports settings and no torch (test_reliability, test_serving)
          "aqua_export.settings": ("aqua_export.settings", "aqua_export.errors", "aqua_export.ops.spec",
                                   "aqua_export.ops.rules"),
          "aqua_export.contract": ("aqua_export.capabilities", "aqua_export.config", "aqua_export.errors",
                                   "aqua_export.ops.spec", "aqua_export.settings")}
NOT_ABOVE = {"aqua_export.runtime": ("aqua_export.export", "aqua_export.build", "aqua_export.parity",
                                     "aqua_export.reference", "aqua_export.serving"),
             "aqua_export.serving": ("aqua_export.export", "aqua_export.build", "aqua_export.parity",
                                     "aqua_export.reference")}


def test_no_arrow_points_up_a_floor():
    bad = []
    for p in _tracked("aqua_export/*.py"):
        here = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for top_only in (False, True):
            for mod, names in _imports(p, top_only):
                # `from . import capabilities`: the module imported is the name, when mod is a package
                named = [f"{mod}.{n}" for n in names] if (ROOT / mod.replace(".", "/")).is_dir() else [mod]
                for m in (m for m in named if m.startswith("aqua_export")):
                    inside = (lambda f: here == f or here.startswith(f + "."))
                    bad += [f"{here} imports {m}" for f, allowed in FLOORS.items()
                            if not top_only and inside(f) and not m.startswith(allowed)]
                    bad += [f"{here} imports {m}" for f, above in NOT_ABOVE.items()
                            if top_only and inside(f) and m.startswith(above)]
    assert not bad, bad


def test_no_setting_or_build_option_is_spelled_outside_its_owner():
    """A setting's flag belongs to settings/ and a build option's to options.py: the CLI, lm-eval's arguments and the
    docs derive from them, so the package never spells one as a whole string of its own (an add_argument, a list of
    flags; messages naming a flag inside their text are fine). `--runtime` also names what drives a folder on `run`
    and `bench` (capabilities.RUNTIMES' vocabulary), so it is not the build's alone."""
    from aqua_export import options, settings

    flags = {s.flag for s in settings.SETTINGS.values()} | {o.flag for o in options.OPTIONS} - {"--runtime"}
    owners = {ROOT / "aqua_export" / "options.py", *(ROOT / "aqua_export" / "settings").glob("*.py")}
    bad = [f"{p.relative_to(ROOT)}:{n.lineno} {n.value}" for p in _tracked("aqua_export/*.py") if p not in owners
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value in flags]
    assert not bad, bad


def test_every_benchmark_file_names_its_command():
    tracked = {p.name for p in _tracked("benchmarks/*")} - {"README.md"}
    named = {f for b in harness.REGISTRY.values() for f in b.writes} | set(harness.STUDIES)
    assert tracked <= named, f"written by no registered command: {sorted(tracked - named)}"
    assert (ROOT / "benchmarks" / "README.md").read_text() == harness.index(), "rerun: python -m tools"
    for b in harness.REGISTRY.values():  # each entry runs as python -m tools NAME
        assert callable(importlib.import_module(f"tools.{b.module}").main)
