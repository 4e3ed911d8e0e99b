"""GPU timings of the Triton TopKGatherDot kernel against dense baselines, as a fraction of memory bandwidth.

Run on a machine with a CUDA GPU (not in CI):  python tools/bench_gpu.py --out benchmarks/gpu_attention.md

Shapes are Llama-3.1-8B's attention at decode (Hkv 8, g 4, d 128, one query token), batch 8, float16,
T = 16k .. 128k cached tokens. For each T:

  dense QK       torch.matmul of q [B,Hkv,g,1,d] with the dim-major K [B,Hkv,d,T]: reads all of K
  aqua QK (k)    the Triton kernel: reads k of r rows of K^ per query row (+ q, + the scores it writes)
  dense SDPA     torch's scaled_dot_product_attention over K and V [B,Hkv,T,d] (GQA): the whole step
  aqua step (k)  Triton scores + softmax + probs @ V (unfused: the scores go through memory)
  fused (k)      the Triton AquaAttention kernel (kernels/triton/aqua_attention.py): q^ = qP, group-shared selection, online
                 softmax and the value product in one pass over K^'s selected rows and V; "fused dense" is the
                 same kernel at k = d without P (the same-kernel baseline)
  h2o step (k)   the Triton H2OAttention kernel (kernels/triton/h2o_attention.py) at h2o 0.5: T/2 + 1 slots, the most recent
                 T/2 tokens live, one token in, against dense SDPA over all T (the token buffer is restored
                 before each call; it is 1/64 of the K^ + V bytes)

Bytes counted are the fewest each variant must move (every input read once, every output written once);
bandwidth is bytes / median time; the ceiling is a measured device-to-device copy (read + write).
Correctness is checked first against a float64 reference on fresh random inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def copy_bandwidth() -> float:
    import triton.testing as tt

    x = torch.randn(1 << 28, device="cuda", dtype=torch.float16)  # 512 MiB
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def check(topk_gather_dot, reference) -> list[str]:
    """Fresh random inputs at odd sizes, float32 and float16, against a float64 reference."""
    lines = []
    for seed, (b, hkv, g, t, r, s), k, dt in [(1, (2, 8, 4, 1, 128, 4099), 64, torch.float32),
                                              (2, (1, 8, 4, 3, 128, 70001), 96, torch.float16),
                                              (3, (3, 2, 3, 1, 64, 1000), 1, torch.float32)]:
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(b, hkv, g, t, r, generator=gen).to(dt)
        kc = torch.randn(b, hkv, r, s, generator=gen).to(dt)
        got = topk_gather_dot(q.cuda(), kc.cuda(), k).double().cpu()
        ref = reference(q.double(), kc.double(), k)
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = torch.isfinite(got).all().item() and rel < (1e-5 if dt == torch.float32 else 2e-3)
        lines.append(f"check {dt} shape {(b, hkv, g, t, r, s)} k {k}: relative error {rel:.1e} {'ok' if ok else 'FAIL'}")
        if not ok:
            raise SystemExit("\n".join(lines))
    return lines


def bench(T: int, B: int, hkv: int, g: int, d: int, ks: list[int], bw: float) -> list[dict]:
    import triton.testing as tt

    from aqua_export.kernels.triton.topk_gather_dot import topk_gather_dot

    dt, es = torch.float16, 2
    q = torch.randn(B, hkv, g, 1, d, device="cuda", dtype=dt)
    kdm = torch.randn(B, hkv, d, T, device="cuda", dtype=dt)  # dim-major K^
    krm = torch.randn(B, hkv, T, d, device="cuda", dtype=dt)  # row-major K for SDPA
    v = torch.randn(B, hkv, T, d, device="cuda", dtype=dt)
    qs = q.reshape(B, hkv * g, 1, d)
    rows = B * hkv * g

    def med(fn):
        return tt.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3

    out = []
    kv_bytes = B * hkv * T * d * es
    scores_bytes = rows * T * es
    t = med(lambda: torch.matmul(q, kdm[:, :, None]))
    out.append({"T": T, "variant": "dense QK", "bytes": kv_bytes + scores_bytes, "s": t})
    t = med(lambda: torch.nn.functional.scaled_dot_product_attention(qs, krm, v, enable_gqa=True))
    out.append({"T": T, "variant": "dense SDPA (K+V)", "bytes": 2 * kv_bytes, "s": t})
    for k in ks:
        # union of the group's selections bounds the K^ rows read per KV head: g * k of d at most
        t = med(lambda: topk_gather_dot(q, kdm, k))
        out.append({"T": T, "variant": f"aqua QK k={k}", "bytes": kv_bytes * k // d + scores_bytes, "s": t})

        def step():
            s = topk_gather_dot(q, kdm, k).float().softmax(-1).to(dt)
            return torch.matmul(s, v[:, :, None])
        t = med(step)
        out.append({"T": T, "variant": f"aqua step k={k} (unfused)", "bytes": kv_bytes * k // d + kv_bytes, "s": t})
    out += bench_fused(T, q, kdm, v, ks, med)
    for o in out:
        o["GB/s"] = o["bytes"] / o["s"] / 1e9
        o["of copy bandwidth"] = o["bytes"] / o["s"] / bw
    return out


def bench_fused(T: int, q, kdm, v, ks: list[int], med) -> list[dict]:
    """The fused Triton AquaAttention step: dense (k = d, no P) and AQUA (P given, group rule) at each k."""
    from aqua_export.kernels.triton.aqua_attention import aqua_attention

    B, hkv, g, _, d = q.shape
    es = q.element_size()
    mask = torch.zeros(1, 1, 1, 1, T, device="cuda")
    P = torch.linalg.qr(torch.randn(hkv, d, d, device="cuda"))[0].to(q.dtype)
    kv_bytes = B * hkv * T * d * es
    out = [{"T": T, "variant": "fused dense", "bytes": 2 * kv_bytes + 4 * T,
            "s": med(lambda: aqua_attention(q, kdm, v, T, mask, d, 1))}]
    for k in ks:
        out.append({"T": T, "variant": f"fused k={k}", "bytes": kv_bytes * k // d + kv_bytes + 4 * T + P.numel() * es,
                    "s": med(lambda: aqua_attention(q, kdm, v, T, mask, k, 1, projection=P))})
    return out


def check_fused() -> list[str]:
    """The fused kernel on the GPU against the float64 reference, with and without P, float32 and float16."""
    from aqua_export.kernels.triton.aqua_attention import aqua_attention
    from aqua_export.ops.aqua_attention import reference as attention_reference

    lines = []
    gen = torch.Generator().manual_seed(5)
    for (b, hkv, g, t, d, L), k, dt, proj in [((2, 8, 4, 1, 128, 5003), 64, torch.float32, True),
                                               ((1, 8, 4, 3, 128, 70001), 96, torch.float16, True),
                                               ((3, 2, 3, 1, 64, 1000), 64, torch.float32, False)]:
        q = torch.randn(b, hkv, g, t, d, generator=gen).to(dt)
        kc = torch.randn(b, hkv, d, L, generator=gen).to(dt)
        vc = torch.randn(b, hkv, L, d, generator=gen).to(dt)
        mask = torch.zeros(1, 1, 1, t, L)
        P = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0].to(dt) if proj else None
        got = aqua_attention(q.cuda(), kc.cuda(), vc.cuda(), L, mask.cuda(), k, 1,
                             projection=None if P is None else P.cuda()).double().cpu()
        ref = attention_reference(q.double(), kc.double(), vc.double(), L, mask,
                                  None if P is None else P.double(), k=k, rule=1)
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = torch.isfinite(got).all().item() and rel < (1e-5 if dt == torch.float32 else 2e-3)
        lines.append(f"check fused AquaAttention {dt} {(b, hkv, g, t, d, L)} k {k} P {proj}: relative error "
                     f"{rel:.1e} {'ok' if ok else 'FAIL'}")
        if not ok:
            raise SystemExit("\n".join(lines))
    return lines


def check_h2o() -> list[str]:
    """The H2O kernel on the GPU against the float64 slot-level reference (a prompt, then a decode step)."""
    from aqua_export.kernels.triton.h2o_attention import h2o_attention
    from aqua_export.ops import h2o_attention as h2o

    gen = torch.Generator().manual_seed(4)
    b, hkv, g, t, r = 2, 2, 4, 300, 128
    mask = torch.ones(b, t, dtype=torch.int64)
    mask[1, :37] = 0
    ins = [torch.randn(b, hkv, g, t, r, generator=gen), torch.randn(b, hkv, t, r, generator=gen),
           torch.randn(b, hkv, t, r, generator=gen), torch.zeros(b, hkv, 0, r), torch.zeros(b, hkv, 0, r),
           torch.zeros(b, hkv, 0), torch.zeros(b, hkv, 0, dtype=torch.int64), mask]
    got = [x.cpu() for x in h2o_attention(*[x.cuda() for x in ins], k=64, rule=1, ratio=0.5)]
    want = h2o.reference(*ins, k=64, rule=1, ratio=0.5)
    err = (got[0].double() - want[0].double()).abs().max().item()
    same = torch.equal(got[4], want[4])
    line = f"check H2OAttention float32 (2, 2, 4, 300, 128) k 64 h2o 0.5: max error {err:.1e}, same evictions {same}"
    if err > 1e-4 or not same:
        raise SystemExit(line + " FAIL")
    return [line]


def bench_h2o(T: int, B: int, hkv: int, g: int, d: int, ks: list[int], bw: float) -> list[dict]:
    """One decode step of the H2O kernel at ratio 0.5 (compared with bench()'s dense SDPA over T tokens)."""
    import triton.testing as tt

    from aqua_export.kernels.triton.h2o_attention import h2o_attention

    dt, es = torch.float16, 2
    live = T // 2
    cap = live + 1
    key = torch.randn(B, hkv, cap, d, device="cuda", dtype=dt)
    value = torch.randn(B, hkv, cap, d, device="cuda", dtype=dt)
    heavy = torch.rand(B, hkv, cap, device="cuda")
    token = torch.full((B, hkv, cap), -1, dtype=torch.int64, device="cuda")
    token[..., :live] = torch.arange(T - live, T, device="cuda")  # the most recent half is live
    saved = token.clone()
    mask = torch.ones(B, T + 1, dtype=torch.int64, device="cuda")
    q = torch.randn(B, hkv, g, 1, d, device="cuda", dtype=dt)
    kn, vn = (torch.randn(B, hkv, 1, d, device="cuda", dtype=dt) for _ in range(2))

    def med(fn):
        return tt.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e-3

    out = []
    for k in ks:
        def step():
            token.copy_(saved)
            h2o_attention(q, kn, vn, key, value, heavy, token, mask, k=k, rule=1, ratio=0.5)
        # the fewest: the selected rows of K^ and V once, heavy read and written, token read
        nbytes = B * hkv * cap * (k * es + d * es + 2 * 4 + 8)
        out.append({"T": T, "variant": f"h2o 0.5 step k={k}", "bytes": nbytes, "s": med(step)})
    for o in out:
        o["GB/s"] = o["bytes"] / o["s"] / 1e9
        o["of copy bandwidth"] = o["bytes"] / o["s"] / bw
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/gpu_attention.md")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="16384,32768,65536,131072")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA GPU here (run it on a GPU machine)")
    from aqua_export.kernels.triton.topk_gather_dot import topk_gather_dot
    from aqua_export.ops.topk_gather_dot import reference

    def topk_gather_dot_reference(q, kc, k):
        return reference(q, kc, k=k)

    name = torch.cuda.get_device_name()
    lines = check(topk_gather_dot, topk_gather_dot_reference) + check_fused() + check_h2o()
    bw = copy_bandwidth()
    rows = []
    for T in map(int, a.contexts.split(",")):
        rows += bench(T, a.batch, 8, 4, 128, [64, 96], bw)
        rows += bench_h2o(T, a.batch, 8, 4, 128, [64, 96], bw)
        torch.cuda.empty_cache()
    md = [f"# GPU attention step: the Triton kernels vs dense ({name})", "",
          f"Written by `python tools/bench_gpu.py` on {name}; torch {torch.__version__}. Llama-3.1-8B attention "
          f"shapes at decode (Hkv 8, g 4, d 128, one query token), batch {a.batch}, float16. Median of "
          "triton.testing.do_bench. Bytes = the fewest each variant must move; the ceiling is a measured "
          f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write).", "", *[f"- {x}" for x in lines], "",
          "| T | variant | time (us) | bytes (MB) | GB/s | of copy bandwidth | vs dense QK (fused: vs fused dense; h2o: vs dense SDPA) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x for x in rows if x["T"] == r["T"] and x["variant"] == "dense QK")["s"]
        if r["variant"].startswith("fused k"):  # the same kernel's dense run
            base = next(x for x in rows if x["T"] == r["T"] and x["variant"] == "fused dense")["s"]
        if r["variant"].startswith("h2o"):
            base = next(x for x in rows if x["T"] == r["T"] and x["variant"].startswith("dense SDPA"))["s"]
        md.append(f"| {r['T']} | {r['variant']} | {r['s'] * 1e6:.1f} | {r['bytes'] / 1e6:.1f} | {r['GB/s']:.0f} | "
                  f"{r['of copy bandwidth']:.2f} | {base / r['s']:.2f}x |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(md) + "\n")
    Path(a.out).with_suffix(".json").write_text(json.dumps({"device": name, "copy_bandwidth": bw, "rows": rows}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
