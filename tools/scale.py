"""How a build's cost grows with model size: random-weight checkpoints of real shapes (bfloat16 on disk),
built into float16 folders, peak RSS and time per stage and the folder's size. Writes benchmarks/scale.md.

    python -m tools scale [--sizes 135M,0.5B,1.1B] [--work DIR]      (not run in CI: minutes to an hour)

Checkpoints: tools/checkpoints.py (random weights of real shapes, made in code; nothing comes from a hub).
Each build runs in its own process; aqua_config.json's "resources" hold each stage's time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from tools.checkpoints import write_checkpoint
from tools.scale_report import DEFAULT_ARGS, write_report


def build(ckpt: Path, out: Path, args: list[str]) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "aqua_export", "--model", str(ckpt), "--out", str(out), *args]
    log = out.parent / (out.name + ".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    res = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}
    if rc == 0:
        cfg = json.loads((out / "aqua_config.json").read_text())
        par = json.loads((out / "parity.json").read_text())
        res.update(resources=cfg["info"]["resources"], weights=cfg["info"]["weights"], parity_pass=par["pass"],
                   parity=par["ort_vs_reference"], top1_unforced=par["ort_vs_reference_unforced"]["top1_agreement"],
                   folder_bytes=sum(p.stat().st_size for p in out.iterdir() if p.is_file()))
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="135M,0.5B,1.1B")
    ap.add_argument("--work", default=str(ROOT / "build" / "scale"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "scale.json"))
    ap.add_argument("--build-args", default=DEFAULT_ARGS)
    ap.add_argument("--report-only", action="store_true", help="rewrite benchmarks/scale.md from the JSON")
    a = ap.parse_args(argv)
    if a.report_only:
        write_report(Path(a.json))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else {}
    for name in a.sizes.split(","):
        ckpt = work / f"llama-{name}"
        t0 = time.perf_counter()
        params = write_checkpoint(ckpt, name)
        disk = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        print(f"{name}: {params / 1e9:.2f}B parameters, {disk / 2**30:.2f} GiB on disk "
              f"({time.perf_counter() - t0:.0f} s to write)", flush=True)
        res = build(ckpt, work / f"engine-{name}", a.build_args.split())
        res.update(params=params, disk_bytes=disk, build_args=a.build_args)
        results[name if a.build_args == DEFAULT_ARGS else f"{name}, {a.build_args}"] = res
        print(json.dumps(res, indent=1), flush=True)
        shutil.rmtree(work / f"engine-{name}", ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        Path(a.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    write_report(Path(a.json))


if __name__ == "__main__":
    main()
