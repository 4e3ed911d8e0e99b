"""The prompt's products in ONNX Runtime on every instruction-set variant of the native kernels this CPU runs (x86-64-v2
SSE4.2, v3 AVX2, v4 AVX-512; AQUA_ORT_ISA forces each), against the width's own multiply-add peak, in one interleaved
run: AquaAttention's blocked prompt kernel (plugins/ort/aqua_prompt.cc, what every folder runs for a prompt) in float32
and with prompt_bf16, MatMulQ4A8 (an int4 folder's weight products), ONNX Runtime's GroupQueryAttention (genai's
builder) and MatMul (MLAS: its own kernels, whatever the variant) for scale.

    -> benchmarks/prompt_attention.json and benchmarks/prompt_attention.md

Geometry: the embedded model's (9 query heads, 3 KV heads, d = 64), batch 1, a causal prompt of T tokens, one layer.

    AquaAttention  q^ [1, 3, 3, T, 64], K^ [1, 3, 64, T] (dim-major), V [1, 3, T, 64] --> out   (k = d: every column)
                   float32, and prompt_bf16 (`--prompt-precision bfloat16`: bfloat16 products where the variant and
                   CPU have them, AVX512_BF16; float32 elsewhere, so not timed twice)
    MatMulQ4A8     [T, 576] x int4 [576, 3072], blocks of 32 (the gated MLP's stacked product)
    GQA            q [1, T, 576], k, v [1, T, 192], empty past --> out                        (com.microsoft)
    MatMul         [T, 576] x [576, 1536]: ORT's own SGEMM (MLAS), the rate a matrix product reaches on this CPU

GFLOP/s of attention count the causal products only: 2 x 2 x (T^2 / 2) x 64 per query head; the peak: the variant's
one-thread multiply-add rate (plugins/ort/simd/simd.h peak_gflops) times the threads.

Rerun: `.venv/bin/python -m tools prompt` (a few minutes on 2 cores; --variants to choose).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tools.bench_attention import HKV, HQ, D, gqa_model
from tools.harness import command, interleaved_medians, table, written_by

ROOT = Path(__file__).resolve().parents[1]
Q4_K, Q4_N, Q4_BLOCK = 576, 3072, 32


def _matmul():
    from onnx import TensorProto
    from onnx import helper as H
    from onnx import numpy_helper

    f = TensorProto.FLOAT
    w = np.random.default_rng(1).standard_normal((576, 1536), dtype=np.float32)  # an initializer, as in a folder
    g = H.make_graph([H.make_node("MatMul", ["a", "b"], ["c"])], "mm", [H.make_tensor_value_info("a", f, ["T", 576])],
                     [H.make_tensor_value_info("c", f, None)], initializer=[numpy_helper.from_array(w, "b")])
    return H.make_model(g, opset_imports=[H.make_opsetid("", 20)], ir_version=10)


def attention_feed(session, t: int, seed: int = 0) -> dict:
    """AquaAttention's inputs for a causal prompt of t tokens from an empty cache (random q^, K^, V)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, HKV, HQ // HKV, t, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, D, t), dtype=np.float32)
    v = rng.standard_normal((1, HKV, t, D), dtype=np.float32)
    return dict(zip([i.name for i in session.get_inputs()],
                    [q, k, v, np.array([t], np.int64), np.ones((1, t), np.int64)]))


def prompt_session(variant: str | None, threads: int, bf16: bool = False):
    """AquaAttention's prompt node on the native kernels of `variant` (None: the loader's choice)."""
    from aqua_export.ops import aqua_attention
    from aqua_export.runtime.session import forced_variant, make_session

    model = aqua_attention.OP.model(k=D, **({"prompt_bf16": 1} if bf16 else {}))
    with forced_variant(variant):
        return make_session(model.SerializeToString(), threads, "native", spin=False)


def _q4_session(variant: str, threads: int):
    from aqua_export.ops import matmul_q4a8
    from aqua_export.runtime.session import forced_variant, make_session

    with forced_variant(variant):
        return make_session(matmul_q4a8.GATED.model(K=Q4_K, N=Q4_N, block_size=Q4_BLOCK).SerializeToString(), threads,
                            "native", spin=False)


def measure(t: int, threads: int, reps: int, variants: list[str]) -> dict:
    """Median seconds of each kernel (every variant's, interleaved) at a prompt of t tokens, and their rates."""
    from aqua_export.runtime.session import forced_variant, prompt_bf16_runs

    rng = np.random.default_rng(0)
    fns, out = {}, {"tokens": t, "variants": {}}
    a = rng.standard_normal((1, t, Q4_K), dtype=np.float32)
    q4_in = [a, rng.integers(0, 256, (Q4_N, Q4_K // Q4_BLOCK, Q4_BLOCK // 2), dtype=np.uint8),
             rng.standard_normal((Q4_N, Q4_K // Q4_BLOCK), dtype=np.float32) * 0.01]
    reference = first = None
    for v in variants:
        ours = prompt_session(v, threads)
        feed = attention_feed(ours, t)
        got = ours.run(None, feed)[0]
        reference, first = (got, feed) if reference is None else (reference, first)
        # every variant gives the same attention (a benchmark of wrong answers measures nothing)
        err = float(np.abs(got - reference).max())
        assert err < 1e-4, f"{v}'s AquaAttention differs from {variants[0]}'s by {err:.2e} at T {t}"
        fns[f"{v} AquaAttention"] = (lambda s, f: lambda: s.run(None, f))(ours, feed)
        with forced_variant(v):
            bf16 = prompt_bf16_runs()
        if bf16:
            b = prompt_session(v, threads, bf16=True)
            fns[f"{v} AquaAttention bfloat16"] = (lambda s, f: lambda: s.run(None, f))(b, feed)
        q4 = _q4_session(v, threads)
        q4_feed = dict(zip([i.name for i in q4.get_inputs()], q4_in))
        fns[f"{v} MatMulQ4A8"] = (lambda s, f: lambda: s.run(None, f))(q4, q4_feed)
        out["variants"][v] = {"bf16": bf16}
    from aqua_export.runtime.session import make_session

    gqa = make_session(gqa_model(scale=1.0).SerializeToString(), threads, "function", spin=False)
    q, k, v_, *_ = first.values()
    empty = np.zeros((1, HKV, 0, D), np.float32)
    gqa_feed = {"q": np.ascontiguousarray(q.transpose(0, 3, 1, 2, 4).reshape(1, t, HQ * D)),
                "k": np.ascontiguousarray(k.transpose(0, 3, 1, 2).reshape(1, t, HKV * D)),
                "v": np.ascontiguousarray(v_.transpose(0, 2, 1, 3).reshape(1, t, HKV * D)), "past_k": empty,
                "past_v": empty, "seqlens_k": np.array([t - 1], np.int32), "total": np.array([t], np.int32)}
    err = float(np.abs(gqa.run(None, gqa_feed)[0] - reference.transpose(0, 3, 1, 2, 4).reshape(1, t, HQ * D)).max())
    assert err < 1e-3, f"AquaAttention and GroupQueryAttention differ by {err:.2e} at T {t}"
    mm = make_session(_matmul().SerializeToString(), threads, "function", spin=False)
    fns["GroupQueryAttention"] = lambda: gqa.run(None, gqa_feed)
    fns["MatMul"] = lambda: mm.run(None, {"a": a[0]})
    sec = interleaved_medians(fns, reps)
    attn = 2 * 2 * (t * t / 2) * D * HQ
    for v, row in out["variants"].items():
        row["seconds"] = sec[f"{v} AquaAttention"]
        row["gflops"] = attn / row["seconds"] / 1e9
        row["bf16_seconds"] = sec.get(f"{v} AquaAttention bfloat16")
        row["bf16_gflops"] = attn / row["bf16_seconds"] / 1e9 if row["bf16_seconds"] else None
        row["q4_seconds"] = sec[f"{v} MatMulQ4A8"]
        row["q4_gops"] = 2 * t * Q4_K * Q4_N / row["q4_seconds"] / 1e9
    out["gqa_seconds"], out["gqa_gflops"] = sec["GroupQueryAttention"], attn / sec["GroupQueryAttention"] / 1e9
    out["matmul_gflops"] = 2 * t * 576 * 1536 / sec["MatMul"] / 1e9
    return out


def peaks(variants: list[str], threads: int) -> dict:
    """Each variant's multiply-add peak on `threads` threads: one thread's measured rate times the threads."""
    from aqua_export.runtime.session import forced_variant, peak_gflops

    out = {}
    for v in variants:
        with forced_variant(v):
            out[v] = peak_gflops() * threads
    return out


def render(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        below = None
        for v, x in r["variants"].items():
            pk = res["peaks"][v]
            rows.append([r["tokens"], v, f"{x['seconds'] * 1e3:.1f}", f"{x['gflops']:.1f}",
                         f"{100 * x['gflops'] / pk:.0f}%" if pk else "-",
                         f"{below / x['seconds']:.2f}x" if below else "-",
                         f"{x['bf16_seconds'] * 1e3:.1f} ({x['bf16_gflops']:.0f} GFLOP/s)" if x["bf16_seconds"] else
                         "float32 here", f"{x['q4_seconds'] * 1e3:.1f}", f"{x['q4_gops']:.0f}",
                         f"{r['gqa_seconds'] * 1e3:.1f} ({r['gqa_gflops']:.0f})", f"{r['matmul_gflops']:.0f}"])
            below = x["seconds"]
    peak_line = ", ".join(f"{v} {p:.0f}" for v, p in res["peaks"].items())
    return "\n".join([
        "# The prompt's products on every kernel variant", "", written_by("prompt"), "",
        f"`{res['command']}` on {res['cpu']}, {res['threads']} threads, medians of interleaved rounds (every variant in "
        "the same rounds), one layer of the embedded model (9 query heads, 3 KV heads, d 64), batch 1. Variants: the "
        "native kernels' instruction-set builds this CPU runs (AQUA_ORT_ISA forces each); a variant this CPU lacks is "
        "not in the table. Peak: the variant's multiply-add rate on these threads, measured here (plugins/ort/simd/"
        f"simd.h peak_gflops: {peak_line} GFLOP/s). GFLOP/s: the causal products; vs below: the variant below's "
        "AquaAttention time over this one's. bfloat16: the same node with `prompt_bf16`, timed where the variant and "
        f"CPU have AVX512_BF16. MatMulQ4A8: [T, 576] x int4 [576, 3072] (GOPS). GQA: ONNX Runtime's "
        "GroupQueryAttention (genai's builder), and MatMul: ORT's SGEMM on [T, 576] x [576, 1536], MLAS's own kernels "
        "whatever the variant.", "",
        *table(["prompt", "variant", "AquaAttention (ms)", "GFLOP/s", "of peak", "vs below", "bfloat16 (ms)",
                "MatMulQ4A8 (ms)", "GOPS", "GQA (ms, GFLOP/s)", "MatMul GFLOP/s"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    from aqua_export.meter import cpu_name
    from aqua_export.runtime.session import native_library, variants_here

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2000, 4096, 8000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--variants", nargs="+", help="the kernel variants to run (default: every one this CPU runs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    a = ap.parse_args(argv)
    if native_library() is None:
        print("the native kernels are not built: run `make plugin`", file=sys.stderr)
        return 2
    here = variants_here()
    variants = a.variants or here
    missing = [v for v in variants if v not in here]
    if missing or not variants:
        print(f"--variants {' '.join(missing)}: this CPU runs {', '.join(here) or 'none'}", file=sys.stderr)
        return 2
    res = {"command": command("prompt") + (" " + " ".join(argv) if argv else ""), "cpu": cpu_name(),
           "threads": a.threads, "peaks": peaks(variants, a.threads),
           "rows": [measure(t, a.threads, a.reps, variants) for t in a.tokens]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_attention.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "prompt_attention.md").write_text(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
