"""python -m tools [NAME [ARGS]]: the benchmark registry (tools/harness.py), or one benchmark run."""

from __future__ import annotations

import importlib
import sys

from aqua_export.outputs import atomic_write_bytes

from .harness import BENCHMARKS, REGISTRY, index


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        for name, b in REGISTRY.items():
            print(f"{name:14} {b.measures}\n{'':14} -> {', '.join(b.writes)}" + (f"  [needs {b.needs}]" if b.needs
                                                                                     else ""))
        atomic_write_bytes(BENCHMARKS / "README.md", index().encode())
        return 0
    if argv[0] not in REGISTRY:
        print(f"tools: unknown benchmark {argv[0]!r}: use one of {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"tools.{REGISTRY[argv[0]].module}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
