"""docs/cli.md: every command's `--help`, written from the parsers themselves (aqua_export/cli.py), so the reference
cannot drift from the code (tests/test_reliability.py compares the file with what this writes).

Rerun: `.venv/bin/python -m tools cli-reference` after changing an option.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"


def reference() -> str:
    from aqua_export import capabilities, settings
    from aqua_export.cli import build_arg_parser, build_parser

    os.environ["COLUMNS"] = "120"  # argparse wraps to the terminal: the file must not depend on it
    main = build_parser()
    sub = next(a for a in main._actions if a.__class__.__name__ == "_SubParsersAction")
    parts = ["# Command-line reference", "",
             "Written by `python -m tools cli-reference` from the parsers in `aqua_export/cli.py`, the settings in "
             "`aqua_export/settings/` and the table in `aqua_export/capabilities.py`; do not edit by hand.", "",
             "## AQUA's settings", "", "Each mechanism is one module of `aqua_export/settings/`; the same names are "
             "the build's flags, lm-eval's `model_args` and `aqua_config.json`'s fields.", "", settings.table(), "",
             "## Where a folder runs", "", "`--runtime` (aqua, genai, tensorrt) drives a folder, `--kernel` (native, "
             "function) runs its custom nodes under ONNX Runtime; `aqua` takes whichever kernel runs. A refused pair "
             "ends in one line:", "", capabilities.table(), "",
             *[f"- {f} on {b}: {line}" for (f, b), line in capabilities.REFUSALS.items()], "",
             "## aqua-export (build a folder)", "", "```", build_arg_parser().format_help().rstrip(), "```", "",
             "## aqua-export --help (the commands)", "", "```", main.format_help().rstrip(), "```", ""]
    for name, parser in sub.choices.items():
        parts += [f"## aqua-export {name}", "", "```", parser.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    OUT.write_text(reference())
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    main()
