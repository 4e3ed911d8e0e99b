"""End-to-end decode of built folders of the embedded model: tokens/s and decode memory, through
`aqua-export bench` (aqua_export/bench.py: fresh process per measurement, rounds interleaved).

    -> benchmarks/decode.json (this project's runtime, every variant), benchmarks/genai.json
       (onnxruntime-genai against its own model builder's export of the same checkpoint) and
       benchmarks/h2o.json (AQUA-H2O against dense: decode at 4k / 8k, batch 1 / 8, and a 1,024-token prefill)
       and benchmarks/tokens.json (token selection against dense and against genai's builder: TOKEN_RUNS)
    -> the "Decode" sections of benchmarks/performance.md (tools/perf_report.py)

Variants (all built from the same SmolLM2-135M checkpoint and projection by the build's export stage, float32):
    dense                 k_ratio 1 (identity P, AquaAttention at k = d)
    aqua-k0.75 / -k0.5    standalone AQUA
    memory-s0.25-k0.75    AQUA-Memory: K and V cached 48 wide instead of 64
    h2o-0.5-k0.75         AQUA-H2O keeping half the tokens (runtime aqua only)
    gw-k0.625             group-weighted selection at k 0.625 (one set of 40 K^ rows per KV group and step)
    h2o-0.75-gw-k0.75     AQUA-H2O keeping 3/4 of the tokens, group-weighted selection at k 0.75
    tokens-0.125-gw-k0.25 token selection: pages of 1/8 of the tokens (plus sink 16, window 64) chosen on 16 K^ rows
                          (group-weighted, k 0.25), attended with all 64; tokens-0.0625-gw-k0.25 the same with 1/16,
                          tokens-b512-gw-k0.25 with a fixed 512 tokens (--token-budget 512)
    ort-genai             onnxruntime-genai's model builder export (-p fp32 -e cpu: GroupQueryAttention)

Rerun: `make bench` (or `.venv/bin/python -m tools decode`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from aqua_export.outputs import atomic_write_bytes

from aqua_export.bench import bench

WORK = ROOT / "build" / "bench"
VARIANTS = {"dense": dict(k_ratio=1.0), "aqua-k0.75": dict(k_ratio=0.75), "aqua-k0.5": dict(k_ratio=0.5),
            "memory-s0.25-k0.75": dict(k_ratio=0.75, slice_ratio=0.25), "h2o-0.5-k0.75": dict(k_ratio=0.75, h2o_ratio=0.5),
            "gw-k0.625": dict(k_ratio=0.625, selection="group-weighted"),
            "h2o-0.75-gw-k0.75": dict(k_ratio=0.75, h2o_ratio=0.75, selection="group-weighted"),
            "tokens-0.125-gw-k0.25": dict(k_ratio=0.25, selection="group-weighted", token_ratio=0.125),
            "tokens-0.0625-gw-k0.25": dict(k_ratio=0.25, selection="group-weighted", token_ratio=0.0625),
            "tokens-b512-gw-k0.25": dict(k_ratio=0.25, selection="group-weighted", token_budget=512)}
# the claims, each measured in one run: (context, batch, genai runtime, folders)
GENAI_RUNS = [(1024, 1, "genai", ["ort-genai", "dense"]),
              (8160, 8, "genai-io", ["ort-genai", "dense", "memory-s0.25-k0.75"])]
H2O_RUNS = [(ctx, b) for ctx in (4096, 8160) for b in (1, 8)]  # decode; plus one prefill of H2O_PROMPT tokens
H2O_PROMPT = 1024
DECODE_VARIANTS = ("dense", "aqua-k0.75", "aqua-k0.5", "memory-s0.25-k0.75", "h2o-0.5-k0.75",
                   "tokens-0.125-gw-k0.25", "tokens-0.0625-gw-k0.25")  # decode.json's
# issue 12's end-to-end claim: 8k context, batch 8, the settings whose perplexity is no worse than per-head
# magnitude at k 0.5 (benchmarks/quality.md) against dense, in one interleaved run
TARGET = (8160, 8, ["dense", "gw-k0.625", "h2o-0.75-gw-k0.75"])
# token selection's claims (benchmarks/tokens.json), each one interleaved run: this project's runtime at 8k, batch 8
# and 1, against dense; onnxruntime-genai with a real prefill of an 8k prompt, batch 1, against genai's own builder
TOKENS = ["tokens-0.125-gw-k0.25", "tokens-0.0625-gw-k0.25", "tokens-b512-gw-k0.25"]
TOKEN_RUNS = [(8160, 8, "aqua", ["dense", *TOKENS]), (8160, 1, "aqua", ["dense", *TOKENS]),
              (8000, 1, "genai", ["ort-genai", "dense", *TOKENS])]


def _projection():
    from aqua_export import calibrate, models
    from aqua_export.projection import load_projection
    from aqua_export.projection import write as write_projection

    path = ROOT / "benchmarks" / "llama-projection.safetensors"
    if not path.is_file():  # written by tools/quality.py; a smaller calibration is enough for timing
        model, tok = models.load("llama")
        tensors, meta = calibrate.calibrate(model, tok, texts=["builtin:python-reference"], tokens=4096)
        write_projection(path, tensors, meta)
    return load_projection(path)


def export_all(names) -> None:
    """Each variant's folder, written by the build's own export stage (genai files included)."""
    import shutil

    import torch

    from aqua_export import models
    from aqua_export.build import export_folder
    from aqua_export.options import BuildOptions
    from aqua_export.config import AquaConfig

    model = tok = proj = None
    for name in names:
        if name == "ort-genai":
            _export_genai()
            continue
        out = WORK / name
        if (out / "aqua_config.json").is_file():
            continue
        if model is None:
            torch.set_num_threads(2)
            model, tok = models.load("llama")
            proj = _projection()
        tmp = WORK / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        export_folder(model, tok, proj, AquaConfig(**VARIANTS[name]), BuildOptions(), tmp, "llama").seal(tmp)
        tmp.replace(out)


def _export_genai() -> None:
    out = WORK / "ort-genai"
    if (out / "model.onnx").is_file():
        return
    from aqua_export import models

    src, _ = models.resolve("llama")  # the dequantised float32 HF folder of the embedded checkpoint
    tmp = WORK / "ort-genai.tmp"
    with open(WORK / "ort-genai-builder.log", "w") as log:
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(tmp),
                        "-p", "fp32", "-e", "cpu", "-c", str(WORK / "genai-cache")], check=True, stdout=log, stderr=log)
    tmp.replace(out)


def _rows(names, ctx, batch, runtime, a, capacity=0) -> list[dict]:
    res = bench([str(WORK / n) for n in names], context=ctx, batch=batch, runtime=runtime, steps=a.steps,
                rounds=a.rounds, threads=a.threads, capacity=capacity)
    rows = []
    for n in names:
        r = res["folders"][str(WORK / n)]
        rows.append({"variant": n, "context": ctx, "batch": batch, "runtime": runtime, "capacity": capacity, **r})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _h2o_rows(a) -> list[dict]:
    """AQUA-H2O (h2o 0.5, k 0.75) against the dense folder, each measurement one interleaved run of the two."""
    names = ["dense", "h2o-0.5-k0.75"]
    rows = []
    for ctx, batch in H2O_RUNS:
        rows += [dict(r, mode="decode") for r in _rows(names, ctx, batch, "aqua", a)]
    res = bench([str(WORK / n) for n in names], context=1, batch=1, steps=2, rounds=a.rounds, threads=a.threads,
                prefill=H2O_PROMPT)
    for n in names:
        rows.append({"variant": n, "mode": "prefill", "prompt": H2O_PROMPT, "batch": 1, **res["folders"][str(WORK / n)]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _capacity_rows(a) -> list[dict]:
    """A step reads the filled slots only: the same 1k context in a buffer of just enough slots and in one of
    genai's max_length (8,192), rounds interleaved between the two sizes."""
    import statistics

    folders = [str(WORK / n) for n in ("dense", "aqua-k0.75")]
    steps = {(f, cap): [] for f in folders for cap in (0, 8192)}
    for _ in range(a.rounds):
        for cap in (0, 8192):
            res = bench(folders, context=1024, batch=1, runtime="genai-io", steps=a.steps, rounds=1,
                        threads=a.threads, capacity=cap)
            for f in folders:
                steps[f, cap].append(res["folders"][f]["step_s_median"])
    rows = [{"variant": Path(f).name, "capacity": cap, "context": 1024, "batch": 1, "runtime": "genai-io",
             "step_s_median": statistics.median(v), "tokens_per_s": 1 / statistics.median(v)}
            for (f, cap), v in steps.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(DECODE_VARIANTS))
    # 8k is 8160: the model has 8192 positions and the decode steps must stay inside them
    ap.add_argument("--contexts", default="1024,4096,8160")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (fresh process each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["aqua", "genai", "capacity", "h2o", "target", "tokens"],
                    help="run one of the tables")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    if a.only == "target":
        names = TARGET[2]
    if a.only == "tokens":
        names = ["dense", *TOKENS]
    export_all(names + (["ort-genai"] if a.only in (None, "genai", "tokens") else []))
    meta = {"threads": a.threads, "steps": a.steps, "rounds": a.rounds, "model": "SmolLM2-135M-Instruct (embedded), float32",
            "attention": "AquaAttention", "h2o": "H2OAttention"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "aqua"):
        rows = []
        for ctx in [int(x) for x in a.contexts.split(",")]:
            for batch in [int(x) for x in a.batches.split(",")]:
                rows += _rows(names, ctx, batch, "aqua", a)
        atomic_write_bytes(out / "decode.json", json.dumps({"meta": meta, "rows": rows}, indent=1).encode())
    if a.only in (None, "genai"):
        rows = []
        for ctx, batch, runtime, folders in GENAI_RUNS:
            rows += _rows(folders, ctx, batch, runtime, a)
        atomic_write_bytes(out / "genai.json", json.dumps({"meta": meta, "rows": rows}, indent=1).encode())
    if a.only in (None, "h2o"):
        atomic_write_bytes(out / "h2o.json", json.dumps({"meta": meta, "rows": _h2o_rows(a)}, indent=1).encode())
    if a.only in (None, "target"):
        ctx, batch, folders = TARGET
        atomic_write_bytes(out / "target.json", json.dumps({"meta": meta, "rows": _rows(folders, ctx, batch, "aqua", a)},
                                                           indent=1).encode())
    if a.only in (None, "tokens"):
        rows = []
        for ctx, batch, runtime, folders in TOKEN_RUNS:
            rows += _rows(folders, ctx, batch, runtime, a)
        atomic_write_bytes(out / "tokens.json", json.dumps({"meta": meta, "rows": rows}, indent=1).encode())
    if a.only in (None, "capacity"):
        atomic_write_bytes(out / "capacity.json", json.dumps({"meta": meta, "rows": _capacity_rows(a)},
                                                             indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
