"""optimum's ORTModelForCausalLM on this project's folders, in an environment of its own: optimum-onnx pins
transformers < 4.58 and this project needs >= 5, so the two cannot share one. Builds the embedded model's dense,
AQUA (k 0.75) and AQUA-Memory (slice 0.25) folders here (one calibration shared), generates greedily in optimum's
environment and with `aqua-export run --kernel function` (optimum registers no kernel library, so both run the
function bodies), and writes whether the tokens agree to benchmarks/optimum.md.

    python -m tools.studies.optimum_check [--work build/optimum] [--tokens 32]

The environment (build/venvs/optimum: torch 2.13.0, optimum-onnx[onnxruntime] 0.1.0) is made on first use (PyPI).
Not CI: minutes of installs and three builds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "build" / "venvs" / "optimum"
PACKAGES = ["torch==2.13.0", "optimum-onnx[onnxruntime]==0.1.0"]
FOLDERS = {"dense": ["--k-ratio", "1"], "AQUA k 0.75": ["--k-ratio", "0.75"],
           "AQUA-Memory s 0.25": ["--k-ratio", "0.75", "--slice-ratio", "0.25"]}
PROMPTS = ["The GNU General Public License is", "def fibonacci(n):"]
GENERATE = """
import json, sys
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import AutoTokenizer
folder, n, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(folder)
model = ORTModelForCausalLM.from_pretrained(folder, file_name="model.onnx", use_cache=True, use_io_binding=False)
out = []
for p in prompts:
    ids = tok(p, return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=n, do_sample=False)
    out.append(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
print(json.dumps(out))
"""


def environment() -> Path:
    python = VENV / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", *PACKAGES], check=True)
    return python


def ours(folder: Path, n: int) -> list[str]:
    out = []
    for p in PROMPTS:
        res = subprocess.run([sys.executable, "-m", "aqua_export", "run", str(folder), "--prompt", p, "--max-new-tokens",
                              str(n), "--kernel", "function"], capture_output=True, text=True, check=True)
        out.append(res.stdout.rstrip("\n"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "build" / "optimum"))
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    python = environment()
    versions = subprocess.run([str(python), "-c", "import optimum.onnxruntime, transformers, onnxruntime; "
                               "from importlib.metadata import version as v; print(v('optimum-onnx'), "
                               "transformers.__version__, onnxruntime.__version__)"],
                              capture_output=True, text=True, check=True).stdout.split()
    proj = work / "projection.safetensors"
    if not proj.is_file():
        subprocess.run([sys.executable, "-m", "aqua_export", "calibrate", "--model", "llama", "--out", str(proj),
                        "--text", "builtin:python-reference", "--quiet"], check=True)
    rows = []
    for name, args in FOLDERS.items():
        folder = work / name.split()[0].lower().replace("-", "_")
        subprocess.run([sys.executable, "-m", "aqua_export", "--model", "llama", "--projection", str(proj), *args,
                        "--out", str(folder), "--force"], check=True, capture_output=True)
        res = subprocess.run([str(python), "-c", GENERATE, str(folder), str(a.tokens), json.dumps(PROMPTS)],
                             capture_output=True, text=True)
        theirs = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
        mine = ours(folder, a.tokens)
        theirs = theirs and [t.rstrip("\n") for t in theirs]  # `run` ends its text with a newline of its own
        rows.append({"folder": name, "same": theirs == mine, "optimum": theirs or res.stderr.strip()[-300:],
                     "aqua-export run": mine})
        print(f"{name}: {'same tokens' if theirs == mine else 'DIFFERENT'}", flush=True)
    lines = ["# optimum's ORTModelForCausalLM on this project's folders", "",
             f"Written by `python -m tools.studies.optimum_check` (optimum-onnx {versions[0]}, transformers {versions[1]}, "
             f"onnxruntime {versions[2]} in build/venvs/optimum): the embedded model, greedy, {a.tokens} new tokens, "
             "against `aqua-export run --kernel function` (optimum registers no kernel library).", "",
             "| folder | prompt | same text | optimum |", "|---|---|---|---|"]
    for r in rows:
        for i, p in enumerate(PROMPTS):
            theirs = r["optimum"][i] if isinstance(r["optimum"], list) else r["optimum"]
            lines.append(f"| {r['folder']} | {p!r} | {'yes' if r['same'] else 'no'} | {json.dumps(theirs)[:120]} |")
    (ROOT / "benchmarks" / "optimum.md").write_text("\n".join(lines) + "\n")
    sys.exit(0 if all(r["same"] for r in rows) else 1)


if __name__ == "__main__":
    main()
