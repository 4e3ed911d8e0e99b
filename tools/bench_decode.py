"""End-to-end decode of the exported embedded model in ONNX Runtime: tokens/s and peak memory.

    -> benchmarks/decode.json and the "Decode" section of benchmarks/performance.md

Variants (all exported from the same SmolLM2-135M checkpoint and projection, float32, CPU):
    dense                 this project's export at k_ratio 1 (identity P, TopKGatherDot at k = d)
    *-shared              the same with --kv-cache shared: past and present one buffer, updated in place
    aqua-k0.75 / -k0.5    standalone AQUA
    memory-s0.25-k0.75    AQUA-Memory: K and V cached 48 wide instead of 64
    h2o-0.5-k0.75         AQUA-H2O keeping half the tokens (the cache holds ceil(0.5 n) slots)
    ort-genai             the same checkpoint exported by onnxruntime-genai's model builder
                          (-p fp32 -e cpu: GroupQueryAttention, past and present sharing one buffer)

Protocol: a context of C tokens is put in the cache directly (random values of the cache's shape:
decode cost depends on shapes, not values, and this skips a C x batch prefill that would take
minutes on 2 cores), then decode steps are timed one by one; tokens/s = batch / median step time.
Each (variant, context, batch) runs in a fresh process: "decode memory" is the largest resident
set seen right after a decode step (weights, cache, ORT's buffers), "peak" the process's high-water
mark (ru_maxrss, which also counts session creation). Every figure in the tables is a ratio to the dense
export measured in the same run.

Rerun: `make bench` (or `.venv/bin/python tools/bench_decode.py`); needs `pip install -e .[bench]`
for the onnxruntime-genai column.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aqua_export.safetensors_io import atomic_write_bytes  # noqa: E402

WORK = ROOT / "build" / "bench"
# name -> (AquaConfig fields, kv_cache mode of the export)
VARIANTS = {
    "dense": (dict(k_ratio=1.0), "concat"),
    "aqua-k0.75": (dict(k_ratio=0.75), "concat"),
    "aqua-k0.5": (dict(k_ratio=0.5), "concat"),
    "memory-s0.25-k0.75": (dict(k_ratio=0.75, slice_ratio=0.25), "concat"),
    "h2o-0.5-k0.75": (dict(k_ratio=0.75, h2o_ratio=0.5), "concat"),
    "dense-shared": (dict(k_ratio=1.0), "shared"),
    "aqua-k0.75-shared": (dict(k_ratio=0.75), "shared"),
    "aqua-k0.5-shared": (dict(k_ratio=0.5), "shared"),
    "memory-s0.25-k0.75-shared": (dict(k_ratio=0.75, slice_ratio=0.25), "shared"),
}


def _projection():
    from aqua_export import calibrate, models

    path = ROOT / "benchmarks" / "llama-projection.safetensors"
    if not path.is_file():  # written by tools/quality.py; a smaller calibration is enough for timing
        model, tok = models.load("llama")
        tensors, meta = calibrate.calibrate(model, tok, texts=["builtin:python-reference"], tokens=4096)
        calibrate.write(path, tensors, meta)
    return calibrate.load_projection(path)


def export_all(names) -> None:
    import torch

    from aqua_export import models
    from aqua_export.config import AquaConfig
    from aqua_export.export import export_onnx

    model = None
    for name in names:
        if name == "ort-genai":
            _export_genai()
            continue
        out = WORK / name / "model.onnx"
        if out.is_file():
            continue
        if model is None:
            torch.set_num_threads(2)
            model, _ = models.load("llama")
            proj = _projection()
        out.parent.mkdir(parents=True, exist_ok=True)
        fields, kv_cache = VARIANTS[name]
        cfg = AquaConfig(**fields)
        t0 = time.perf_counter()
        export_onnx(model, proj, cfg, out.with_suffix(".tmp.onnx"), kv_cache=kv_cache)
        out.with_suffix(".tmp.onnx").replace(out)
        geo = models.attention_geometry(model)
        d = geo["head_dim"]
        (out.parent / "aqua_config.json").write_text(json.dumps({
            "geometry": geo, "dtype": "float32", "aqua": cfg.to_dict(),
            "cache": {"width": cfg.retained_width(d), "selected": cfg.selected_width(d)}}))
        print(f"exported {name} in {time.perf_counter() - t0:.0f} s", flush=True)


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


# --------------------------------------------------------------------------------------------
# one measurement (runs in its own process)
# --------------------------------------------------------------------------------------------

def measure_one(name: str, ctx: int, batch: int, steps: int, threads: int) -> dict:
    rng = np.random.default_rng(0)
    if name == "ort-genai":
        step = _genai_stepper(ctx, batch, steps, threads, rng)
    else:
        step = _aqua_stepper(name, ctx, batch, threads, rng)
    step()  # warm-up: allocations, thread pool
    times, rss = [], []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        rss.append(_rss_mb())
    med = statistics.median(times)
    return {"variant": name, "context": ctx, "batch": batch, "step_s_median": med, "tokens_per_s": batch / med,
            "decode_rss_mb": max(rss), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "steps": steps}


def _rss_mb() -> float:
    """Resident memory now (weights, cache, runtime buffers), from /proc/self/statm."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _aqua_stepper(name, ctx, batch, threads, rng):
    from aqua_export.runtime import H2OCache, OrtLM, make_session

    folder = WORK / name
    cfg = json.loads((folder / "aqua_config.json").read_text())
    lm = OrtLM(make_session(folder / "model.onnx", threads, "auto"), cfg)
    hkv, r, layers = lm.kv_heads, lm.r, lm.layers
    h2o = lm.h2o
    n = math.ceil(lm.h2o_ratio * ctx) if h2o else ctx  # H2O: the cache already evicted down to its budget
    if lm.shared:  # fill the shared buffers in place (no second copy of the cache in this process)
        past = lm.empty_past(batch)
        past.reserve(ctx + 1)
        for i in range(layers):
            past.key_arrays[i][..., :ctx] = rng.standard_normal((batch, hkv, r, ctx), dtype=np.float32)
            past.value_arrays[i][:, :, :ctx] = rng.standard_normal((batch, hkv, ctx, r), dtype=np.float32)
        past.length = ctx
        state = {"past": past, "pos": ctx}
        return _stepper(lm, state, batch, rng)
    kv = []
    for _ in range(layers):
        kv += [rng.standard_normal((batch, hkv, r, n), dtype=np.float32),
               rng.standard_normal((batch, hkv, n, r), dtype=np.float32)]
    if h2o:
        past = H2OCache(kv, hkv, lm.h2o_ratio)
        past.valid = [np.ones((batch, hkv, n), bool) for _ in range(layers)]
        past.acc = [rng.random((batch, hkv, n), dtype=np.float32) for _ in range(layers)]
        past.pos = [np.broadcast_to(np.arange(n), (batch, hkv, n)).copy() for _ in range(layers)]
        past.n_real = np.full(batch, ctx, np.int64)
        past.seen = ctx
    else:
        past = kv
    return _stepper(lm, {"past": past, "pos": ctx}, batch, rng)


def _stepper(lm, state, batch, rng):
    def step():
        p = state["pos"]
        ids = rng.integers(3, 1000, (batch, 1))
        mask = np.ones((batch, p + 1), np.int64)
        _, state["past"] = lm.step(ids, mask, np.full((batch, 1), p), state["past"])
        state["pos"] = p + 1

    return step


def _genai_stepper(ctx, batch, steps, threads, rng):
    """The builder's model in ORT with the decode I/O onnxruntime-genai uses on CPU: past and present
    bound to one buffer of the maximum length, attention_mask as long as the sequence so far."""
    import onnxruntime as ort

    folder = WORK / "ort-genai"
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in sess.get_inputs()}
    dec = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    layers, hkv, d = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
    max_len = ctx + steps + 2
    bufs = []
    for i in range(layers):
        for kind in ("key", "value"):
            bufs.append((f"past_key_values.{i}.{kind}", f"present.{i}.{kind}",
                         ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, hkv, max_len, d), dtype=np.float32))))
    state = {"pos": ctx}

    def step():
        p = state["pos"]
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", rng.integers(3, 1000, (batch, 1)).astype(np.int64))
        io.bind_cpu_input("attention_mask", np.ones((batch, p + 1), np.int64))
        if "position_ids" in ins:
            io.bind_cpu_input("position_ids", np.full((batch, 1), p, np.int64))
        for past_name, present_name, buf in bufs:
            io.bind_ortvalue_input(past_name, buf)
            io.bind_ortvalue_output(present_name, buf)
        io.bind_output("logits")
        sess.run_with_iobinding(io)
        state["pos"] = p + 1

    return step


# --------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(list(VARIANTS) + ["ort-genai"]))
    # 8k is 8160: the model has 8192 positions and the decode steps must stay inside them
    ap.add_argument("--contexts", default="1024,4096,8160")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per measurement (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "CONTEXT", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    ap.add_argument("--out-name", default="decode.json")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure_one(a.one[0], int(a.one[1]), int(a.one[2]), a.steps, a.threads)))
        return 0
    names = a.variants.split(",")
    if "ort-genai" in names:
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError:
            print("onnxruntime-genai is not installed (pip install -e .[bench]): its column is left out", file=sys.stderr)
            names.remove("ort-genai")
    export_all(names)
    rows = []
    for ctx in [int(x) for x in a.contexts.split(",")]:
        for batch in [int(x) for x in a.batches.split(",")]:
            runs = {name: [] for name in names}
            for _ in range(a.repeats):  # round robin: drift hits every variant alike
                for name in names:
                    cmd = [sys.executable, __file__, "--one", name, str(ctx), str(batch), "--steps", str(a.steps),
                           "--threads", str(a.threads)]
                    res = subprocess.run(cmd, capture_output=True, text=True)
                    if res.returncode != 0:
                        print(res.stderr[-2000:], file=sys.stderr)
                        raise SystemExit(f"{name} at context {ctx}, batch {batch} failed")
                    runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            for name, rs in runs.items():
                tps = sorted(r["tokens_per_s"] for r in rs)
                row = dict(rs[0])
                row.update(tokens_per_s=statistics.median(tps), tokens_per_s_runs=tps, repeats=len(rs),
                           decode_rss_mb=statistics.median(r["decode_rss_mb"] for r in rs),
                           peak_rss_mb=statistics.median(r["peak_rss_mb"] for r in rs))
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": a.threads, "steps": a.steps, "repeats": a.repeats,
            "model": "SmolLM2-135M-Instruct (embedded), float32"}
    atomic_write_bytes(out / a.out_name, json.dumps({"meta": meta, "rows": rows}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
