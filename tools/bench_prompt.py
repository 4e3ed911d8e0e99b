"""Attention over a whole prompt in ONNX Runtime: AquaAttention's blocked prompt kernel (plugins/ort/aqua_prompt.cc,
what every folder of this project runs for a prompt) against ONNX Runtime's GroupQueryAttention (what genai's model
builder's folders run), and the machine's matrix-product rate for scale.

    -> benchmarks/prompt_attention.json and benchmarks/prompt_attention.md

Geometry: the embedded model's (9 query heads, 3 KV heads, d = 64), batch 1, a causal prompt of T tokens, one layer.
Each graph is one session with the same thread count; times are medians of interleaved rounds.

    AquaAttention  q^ [1, 3, 3, T, 64], K^ [1, 3, 64, T] (dim-major), V [1, 3, T, 64] --> out   (k = d: every column)
                   in float32, and with prompt_bf16 (`--prompt-precision bfloat16`: bfloat16 products on AVX512_BF16)
    GQA            q [1, T, 576], k, v [1, T, 192], empty past --> out                        (com.microsoft)
    MatMul         [T, 576] x [576, 1536]: ORT's own SGEMM (MLAS), the MLP's shape, as the rate a matrix product
                   reaches on this CPU; whole, and PREFILL_CHUNK rows at a time (OrtLM.prefill's forwards)

GFLOP/s of attention count the causal products only: 2 x 2 x (T^2 / 2) x 64 per query head.

Rerun: `.venv/bin/python -m tools prompt` (a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from aqua_export.runtime.session import PREFILL_CHUNK
from tools.bench_attention import HKV, HQ, D, gqa_model
from tools.harness import command, interleaved_medians, table, written_by

ROOT = Path(__file__).resolve().parents[1]


def _matmul():
    from onnx import TensorProto
    from onnx import helper as H
    from onnx import numpy_helper

    f = TensorProto.FLOAT
    w = np.random.default_rng(1).standard_normal((576, 1536), dtype=np.float32)  # an initializer, as in a folder
    g = H.make_graph([H.make_node("MatMul", ["a", "b"], ["c"])], "mm", [H.make_tensor_value_info("a", f, ["T", 576])],
                     [H.make_tensor_value_info("c", f, None)], initializer=[numpy_helper.from_array(w, "b")])
    return H.make_model(g, opset_imports=[H.make_opsetid("", 20)], ir_version=10)


def measure(t: int, threads: int, reps: int) -> dict:
    """Median seconds of each kernel at a prompt of t tokens, and GFLOP/s."""
    from aqua_export.ops import aqua_attention
    from aqua_export.runtime.session import make_session

    def sess(model, kernel="function"):
        return make_session(model.SerializeToString(), threads, kernel, spin=False)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, HKV, HQ // HKV, t, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, t, D), dtype=np.float32)
    v = rng.standard_normal((1, HKV, t, D), dtype=np.float32)
    ours = sess(aqua_attention.OP.model(k=D), "native")
    bf16 = sess(aqua_attention.OP.model(k=D, prompt_bf16=1), "native")  # --prompt-precision bfloat16
    ours_feed = dict(zip([i.name for i in ours.get_inputs()],
                         [q, np.ascontiguousarray(k.transpose(0, 1, 3, 2)), v, np.array([t], np.int64),
                          np.ones((1, t), np.int64)]))
    gqa = sess(gqa_model(scale=1.0))  # AquaAttention's scores are unscaled (a folder folds 1/sqrt(d) into P)
    empty = np.zeros((1, HKV, 0, D), np.float32)
    gqa_feed = {"q": np.ascontiguousarray(q.transpose(0, 3, 1, 2, 4).reshape(1, t, HQ * D)),
                "k": np.ascontiguousarray(k.transpose(0, 2, 1, 3).reshape(1, t, HKV * D)),
                "v": np.ascontiguousarray(v.transpose(0, 2, 1, 3).reshape(1, t, HKV * D)), "past_k": empty,
                "past_v": empty, "seqlens_k": np.array([t - 1], np.int32), "total": np.array([t], np.int32)}
    mm = sess(_matmul())
    a = rng.standard_normal((t, 576), dtype=np.float32)
    mm_feed = {"a": a}

    def mm_chunks():  # the same rows, PREFILL_CHUNK at a time (how `aqua-export run` prefills a long prompt)
        for s in range(0, t, PREFILL_CHUNK):
            mm.run(None, {"a": a[s:s + PREFILL_CHUNK]})
    # the two attentions agree (the same exact attention): a benchmark of wrong answers measures nothing
    ours_out = ours.run(None, ours_feed)[0].transpose(0, 3, 1, 2, 4).reshape(1, t, HQ * D)
    err = float(np.abs(ours_out - gqa.run(None, gqa_feed)[0]).max())
    assert err < 1e-3, f"AquaAttention and GroupQueryAttention differ by {err:.2e} at T {t}"
    # bfloat16 operands: these unscaled random scores (std 8) are peakier than a model's, so the bound is loose
    err_bf16 = float(np.abs(bf16.run(None, ours_feed)[0] - ours.run(None, ours_feed)[0]).max())
    assert err_bf16 < 0.25, f"AquaAttention's bfloat16 prompt differs from its float32 one by {err_bf16:.2e}"
    sec = interleaved_medians({"AquaAttention": lambda: ours.run(None, ours_feed),
                               "AquaAttention bfloat16": lambda: bf16.run(None, ours_feed),
                               "GroupQueryAttention": lambda: gqa.run(None, gqa_feed),
                               "MatMul": lambda: mm.run(None, mm_feed), "MatMul chunked": mm_chunks}, reps)
    attn_flops = 2 * 2 * (t * t / 2) * D * HQ
    return {"tokens": t, "seconds": sec, "max_abs_difference": err, "bfloat16_difference": err_bf16,
            "gflops": {"AquaAttention": attn_flops / sec["AquaAttention"] / 1e9,
                       "AquaAttention bfloat16": attn_flops / sec["AquaAttention bfloat16"] / 1e9,
                       "GroupQueryAttention": attn_flops / sec["GroupQueryAttention"] / 1e9,
                       "MatMul": 2 * t * 576 * 1536 / sec["MatMul"] / 1e9,
                       "MatMul chunked": 2 * t * 576 * 1536 / sec["MatMul chunked"] / 1e9}}


def render(res: dict) -> str:
    rows = [[r["tokens"], f"{r['seconds']['AquaAttention'] * 1e3:.1f}", f"{r['gflops']['AquaAttention']:.0f}",
             f"{r['seconds']['AquaAttention bfloat16'] * 1e3:.1f}", f"{r['gflops']['AquaAttention bfloat16']:.0f}",
             f"{r['seconds']['GroupQueryAttention'] * 1e3:.1f}", f"{r['gflops']['GroupQueryAttention']:.0f}",
             f"{r['seconds']['GroupQueryAttention'] / r['seconds']['AquaAttention']:.2f}x",
             f"{r['gflops']['MatMul']:.0f}", f"{r['gflops']['MatMul chunked']:.0f}"] for r in res["rows"]]
    return "\n".join([
        "# Attention over a prompt: AquaAttention against GroupQueryAttention", "", written_by("prompt"), "",
        f"`{res['command']}` on {res['cpu']}, {res['threads']} threads, medians of interleaved rounds, one layer of the "
        "embedded model (9 query heads, 3 KV heads, d 64), batch 1. GFLOP/s: the causal products; MatMul: ORT's "
        f"SGEMM on [T, 576] x [576, 1536] (a weight initializer, as in a folder), the rate a matrix product reaches "
        f"here: all T rows in one product, and {PREFILL_CHUNK} rows at a time (`aqua-export run`'s prefill chunk, "
        "aqua_export.runtime.session.PREFILL_CHUNK). bfloat16: the same node with `prompt_bf16` (`--prompt-precision "
        f"bfloat16`), {'on AVX512_BF16' if res.get('bf16') else 'float32 here: this CPU or variant has no AVX512_BF16'}"
        "; speed-up: GroupQueryAttention's time over AquaAttention's float32 one.", "",
        *table(["prompt", "AquaAttention (ms)", "GFLOP/s", "bfloat16 (ms)", "GFLOP/s", "GroupQueryAttention (ms)",
                "GFLOP/s", "speed-up",
                "MatMul GFLOP/s", f"MatMul, {PREFILL_CHUNK} rows at a time"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    a = ap.parse_args(argv)
    from aqua_export.meter import cpu_name
    from aqua_export.runtime.session import native_library, prompt_bf16_runs

    if native_library() is None:
        print("the native kernels are not built: run `make plugin`", file=sys.stderr)
        return 2
    res = {"command": command("prompt") + (" " + " ".join(argv) if argv else ""), "cpu": cpu_name(),
           "threads": a.threads, "bf16": prompt_bf16_runs(), "rows": [measure(t, a.threads, a.reps) for t in a.tokens]}
    out = Path(a.out)
    (out / "prompt_attention.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "prompt_attention.md").write_text(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
