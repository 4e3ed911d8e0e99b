"""GPU correctness and timings of the Triton kernels against torch SDPA, as a share of the memory bandwidth.

Run on a machine with a CUDA GPU (not in CI):  python -m tools gpu --out benchmarks/gpu_attention.md

First every kernel is checked against its float64 reference (ops/): fresh random inputs per check, float32,
float16 and bfloat16, ragged lengths (each sequence hidden for its own number of leading positions), GQA groups
of 4 and 8, d = 64 and 128, and the caching allocator poisoned with NaN before each run (an unwritten output or
split shows as NaN). Then, with --tune, the fused kernel's launch (warps, pipeline stages, programs wanted) is
swept at T = 32k, batch 8. Then the rows, Llama-3.1-8B's attention at decode (Hkv 8, g 4, d 128, one query
token), bfloat16, per T and batch:

  dense SDPA      torch's scaled_dot_product_attention over K and V [B, Hkv, T, d] (GQA, flash-decoding)
  fused dense     the AquaAttention kernel at k = d without P (the same kernel reading all of K and V)
  fused k         AquaAttention, group rule, P given: reads k of the d rows of K^, and V
  fused k pooled  the same with the heads sharing the layer's k per token at unequal prices (--k-alloc): the same
                  rows of K^ in all, a KV head reading anywhere from 0 to d of them
  tokens k, 1/8   AquaAttention with token selection (a setting benchmarks/quality.md validates: group rule,
                  k = 32 of 128, token ratio 1/8, sink 16, window 64): the k rows of K^ score every page, a
                  kernel chooses the pages (ops.rules), the chosen pages are read whole
  tokens k, 512   the same with a budget of 512 tokens (the setting the token-selection issue was resolved at)
  h2o 0.5 k       the H2OAttention kernel at h2o 0.5: T/2 + 1 slots, the most recent T/2 tokens live

Bytes are the fewest each variant must move (every input read once); bandwidth is bytes / median time of
triton.testing.do_bench_cudagraph (a step replayed from a captured CUDA graph, as a served decode step is;
the eager do_bench time beside it, Python's launch costs included); the ceiling is a measured device-to-device
copy (read + write).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from tools.harness import table


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # relative error, per dtype
TOKENS = dict(token_ratio=0.125, token_sink=16, token_window=64)  # quality.md's validated token settings:
BUDGET = dict(token_budget=512, token_sink=16, token_window=64)  # 1/8 of the tokens, or 512 (the issue's)
HKV, G, D = 8, 4, 128  # Llama-3.1-8B


def token_setting(attrs: dict = TOKENS):
    """Node attributes (TOKENS, BUDGET) as the Triton host's Tokens (its fields are the names without the prefix)."""
    from aqua_export.kernels.triton.tokens import Tokens

    return Tokens(**{name.removeprefix("token_"): value for name, value in attrs.items()})


def copy_bandwidth() -> float:
    import triton.testing as tt

    x = torch.randn(1 << 28, device="cuda", dtype=torch.float16)  # 512 MiB
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def poison() -> None:
    """Fill the caching allocator's free memory with NaN: the next torch.empty of the kernels reuses it."""
    x = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB
    del x


def ragged_mask(b: int, total: int, gen) -> torch.Tensor:
    """attention_mask [B, L] int64 (the node's): sequence i > 0 pads its first pads[i] slots (left padding), pads
    random."""
    mask = torch.ones(b, total, dtype=torch.int64)
    for i in range(1, b):
        mask[i, :int(torch.randint(1, max(2, total // 3), (1,), generator=gen))] = 0
    return mask


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float("nan") if not torch.isfinite(got).all() else ((got.double() - ref).norm() / ref.norm()).item()


def verdict(line: str, rel: float, dt) -> str:
    ok = rel == rel and rel < TOLERANCE[dt]
    line = f"{line}: relative error {rel:.1e} (bound {TOLERANCE[dt]:.1e}) {'ok' if ok else 'FAIL'}"
    if not ok:
        raise SystemExit(line)
    return line


ATTENTION_CASES = [  # (b, hkv, g, t, d, L), k, dtype, projected, tokens, pooled (the heads share k at PRICES)
    ((2, 8, 4, 1, 128, 5003), 64, torch.float32, True, False, False),
    ((3, 8, 4, 1, 128, 70001), 64, torch.bfloat16, True, False, False),
    ((1, 8, 4, 3, 128, 9001), 96, torch.float16, True, False, False),
    ((3, 2, 8, 1, 64, 1000), 32, torch.bfloat16, False, False, False),
    ((2, 4, 8, 1, 64, 4099), 16, torch.float32, True, False, False),
    ((3, 8, 4, 1, 128, 20000), 32, torch.float32, True, True, False),
    ((2, 4, 8, 1, 64, 7777), 16, torch.float32, False, True, False),
    ((2, 8, 4, 1, 128, 5003), 64, torch.float32, True, False, True),
    ((1, 8, 4, 3, 128, 9001), 32, torch.float32, True, True, True),
]
PRICES = (0.5, 2.0, 1.0, 1.5, 0.75, 1.25, 3.0, 1.0)  # per KV head: a pooled node's head_prices


# the checks' tiny cases: tests/test_gpu_tools.py runs them in Triton's interpreter, so an API change of the
# kernels breaks CI, not the next GPU run
TINY_ATTENTION = [((2, 2, 4, 1, 32, 70), 16, torch.float32, True, False, False),
                  ((2, 2, 4, 1, 32, 90), 8, torch.float32, False, True, False),
                  ((1, 2, 4, 3, 32, 50), 8, torch.float32, True, False, True)]
TINY_SCORES = [((2, 2, 4, 1, 32, 70), 8, 1, torch.float32), ((1, 2, 4, 2, 16, 40), 1, 0, torch.float32)]
TINY_H2O = [(2, 2, 4, 24, 16)]


def _on(device: str, *xs):
    """The tensors on ``device`` (the allocator poisoned first on a GPU: a kernel that skips a store shows NaN)."""
    if device == "cuda":
        poison()
    return [None if x is None else x.to(device) for x in xs]


def check_attention(cases=ATTENTION_CASES, device: str = "cuda") -> list[str]:
    """The fused kernel (and its token selection and pooled selection) against the float64 reference. Token and
    pooled selection are checked in float32: in 16-bit a near tie between two pages' (or priced coordinates')
    scores may choose the other one, a legitimate difference the parity gates account for and a norm bound
    cannot."""
    from aqua_export.kernels.triton.aqua_attention import aqua_attention
    from aqua_export.ops.aqua_attention import reference

    lines, gen = [], torch.Generator().manual_seed(5)
    for (b, hkv, g, t, d, total), k, dt, projected, tokens, pooled in cases:
        q = torch.randn(b, hkv, g, t, d, generator=gen).to(dt)
        kc = torch.randn(b, hkv, d, total, generator=gen).to(dt)
        vc = torch.randn(b, hkv, total, d, generator=gen).to(dt)
        mask = ragged_mask(b, total, gen)
        P = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0].to(dt) if projected else None
        attrs = TOKENS if tokens else {}
        prices = list(PRICES[:hkv]) if pooled else None
        qd, kd, vd, md, pd = _on(device, q, kc, vc, mask, P)
        got = aqua_attention(qd, kd, vd, total, md, k, 1, projection=pd, tokens=token_setting() if tokens else None,
                             prices=prices).cpu()
        ref = reference(q.double(), kc.double(), vc.double(), total, mask, None if P is None else P.double(), k=k,
                        rule=1, head_prices=prices, **attrs)
        lines.append(verdict(f"AquaAttention {str(dt)[6:]} {(b, hkv, g, t, d, total)} k {k} P {projected} tokens "
                             f"{tokens} pooled {pooled}", rel_error(got, ref), dt))
    return lines


SCORE_CASES = [((2, 8, 4, 1, 128, 4099), 64, 1, torch.float32), ((1, 8, 4, 3, 128, 70001), 96, 0, torch.float16),
               ((3, 2, 8, 1, 64, 1000), 1, 0, torch.bfloat16)]


def check_scores(cases=SCORE_CASES, device: str = "cuda") -> list[str]:
    from aqua_export.kernels.triton.topk_gather_dot import topk_gather_dot
    from aqua_export.ops.topk_gather_dot import reference

    lines, gen = [], torch.Generator().manual_seed(1)
    for (b, hkv, g, t, r, s), k, rule, dt in cases:
        q, kc = torch.randn(b, hkv, g, t, r, generator=gen).to(dt), torch.randn(b, hkv, r, s, generator=gen).to(dt)
        got = topk_gather_dot(*_on(device, q, kc), k, rule=rule).cpu()
        lines.append(verdict(f"TopKGatherDot {str(dt)[6:]} {(b, hkv, g, t, r, s)} k {k} rule {rule}",
                             rel_error(got, reference(q.double(), kc.double(), k=k, rule=rule)), dt))
    return lines


def check_h2o(cases=((2, 2, 4, 300, 128), (3, 2, 8, 200, 64)), device: str = "cuda") -> list[str]:
    """The H2O kernel against the float64 slot-level reference (a ragged prompt, then a decode step)."""
    from aqua_export.kernels.triton.h2o_attention import h2o_attention
    from aqua_export.ops import h2o_attention as h2o

    lines, gen = [], torch.Generator().manual_seed(4)
    for b, hkv, g, t, r in cases:
        mask = torch.ones(b, t, dtype=torch.int64)
        mask[1, :min(37, t // 3)] = 0
        ins = [torch.randn(b, hkv, g, t, r, generator=gen), torch.randn(b, hkv, t, r, generator=gen),
               torch.randn(b, hkv, t, r, generator=gen), torch.zeros(b, hkv, 0, r), torch.zeros(b, hkv, 0, r),
               torch.zeros(b, hkv, 0), torch.zeros(b, hkv, 0, dtype=torch.int64), mask]
        got = [x.cpu() for x in h2o_attention(*_on(device, *ins), k=r // 2, rule=1, ratio=0.5)]
        want = h2o.reference(*ins, k=r // 2, rule=1, ratio=0.5)
        if not torch.equal(got[4], want[4]):
            raise SystemExit(f"H2OAttention {(b, hkv, g, t, r)}: the evictions differ from the reference FAIL")
        lines.append(verdict(f"H2OAttention float32 {(b, hkv, g, t, r)} k {r // 2} h2o 0.5, same evictions",
                             rel_error(got[0], want[0].double()), torch.float32))
    return lines


def median_s(fn, graph: bool = False) -> float | None:
    """Median seconds of fn: eagerly (triton.testing.do_bench: Python's launch costs count where the GPU waits on
    them), or as replays of a captured CUDA graph (the GPU's own time, as a served step replays it); None when fn
    cannot be captured (a device sync inside)."""
    import triton.testing as tt

    if not graph:
        return tt.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
    try:
        return tt.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e-3
    except RuntimeError:
        torch.cuda.synchronize()
        return None


def tune(bw: float) -> tuple[list[str], dict]:
    """The fused kernel's launch swept at T = 32k, batch 8, k 64: -> (table lines, the fastest launch)."""
    from aqua_export.kernels.triton.aqua_attention import aqua_attention, split_count

    T, B = 32768, 8
    q, kdm, v, mask, P = inputs(T, B)
    nbytes = B * HKV * T * D * 2 * 1.5
    cells, best = [], None
    for block, warps, stages, wanted in itertools.product((64, 128, 256), (4, 8), (2, 3), (1056, 2112)):
        n = split_count(B * HKV, T, block, wanted)
        s = median_s(lambda: aqua_attention(q, kdm, v, T, mask, 64, 1, projection=P, splits=n, warps=warps,
                                            stages=stages, block=block), graph=True)
        cells.append([block, warps, stages, wanted, n, f"{s * 1e6:.1f}", f"{nbytes / s / bw:.2f}"])
        if best is None or s < best[0]:
            best = (s, dict(block=block, warps=warps, stages=stages, wanted=wanted))
    return table(["block", "warps", "stages", "programs wanted", "splits", "time (us)", "of copy bandwidth"],
                 cells), best[1]


def inputs(T: int, B: int, device: str = "cuda"):
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter: float32
    q = torch.randn(B, HKV, G, 1, D, device=device, dtype=dt)
    kdm = torch.randn(B, HKV, D, T, device=device, dtype=dt)  # dim-major K^
    v = torch.randn(B, HKV, T, D, device=device, dtype=dt)
    mask = torch.ones(1, T, dtype=torch.int32, device=device)  # attention_mask [1, L]: every position visible
    P = torch.linalg.qr(torch.randn(HKV, D, D, device=device))[0].to(dt)
    return q, kdm, v, mask, P


def bench(T: int, B: int, launch: dict) -> list[dict]:
    """One decode step of each variant at T cached tokens, batch B (bf16)."""
    q = torch.randn(B, HKV, G, 1, D, device="cuda", dtype=torch.bfloat16)
    out = [{"T": T, "B": B, "variant": name, "bytes": nbytes, "s": median_s(fn, graph=True), "eager": median_s(fn)}
           for name, nbytes, fn in steps(T, B, launch)]
    return out + bench_h2o(T, B, q)


def steps(T: int, B: int, launch: dict, device: str = "cuda") -> list[tuple]:
    """The timed variants at T cached tokens, batch B: (name, the fewest bytes it moves, one step)."""
    from aqua_export.kernels.triton.aqua_attention import PROGRAMS_WANTED, aqua_attention, block_s, split_count
    from aqua_export.ops.rules import attended_share

    q, kdm, v, mask, P = inputs(T, B, device)
    krm = kdm.transpose(2, 3).contiguous()  # row-major K for SDPA
    kv = B * HKV * T * D * 2  # K (or V) bytes
    block = launch.get("block", block_s(D))
    n = split_count(B * HKV, T, block, launch.get("wanted", PROGRAMS_WANTED))
    run = dict(splits=n, warps=launch.get("warps", 4), stages=launch.get("stages", 2), block=block)
    tokens, budget = token_setting(), token_setting(BUDGET)
    prices = torch.tensor(PRICES, dtype=torch.float32, device=device)  # on the device: the step stays capturable
    return [("dense SDPA", 2 * kv, lambda: torch.nn.functional.scaled_dot_product_attention(
                 q.reshape(B, HKV * G, 1, D), krm, v, enable_gqa=True)),
            ("fused dense", 2 * kv + 4 * T, lambda: aqua_attention(q, kdm, v, T, mask, D, 1, **run)),
            ("fused k=64", kv // 2 + kv + 4 * T,
             lambda: aqua_attention(q, kdm, v, T, mask, 64, 1, projection=P, **run)),
            # the heads share the layer's k per token: the same rows of K^ in all (group rule), spread unevenly
            ("fused k=64 pooled", kv // 2 + kv + 4 * T,
             lambda: aqua_attention(q, kdm, v, T, mask, 64, 1, projection=P, prices=prices, **run)),
            ("tokens k=32, 1/8", kv // 4 + 2 * kv // 8 + 4 * T,  # its splits: split_count over the chosen pages
             lambda: aqua_attention(q, kdm, v, T, mask, 32, 1, projection=P, tokens=tokens, **{**run, "splits": None})),
            ("tokens k=32, 512", kv // 4 + 2 * kv * min(1.0, attended_share(T, 1.0, 512, 16, 64)) + 4 * T,
             lambda: aqua_attention(q, kdm, v, T, mask, 32, 1, projection=P, tokens=budget, **{**run, "splits": None}))]


def bench_h2o(T: int, B: int, q) -> list[dict]:
    """One decode step of the H2O kernel at ratio 0.5, k 64 (the token buffer restored before each call; it is
    1/64 of the K^ + V bytes)."""
    from aqua_export.kernels.triton.h2o_attention import h2o_attention

    from aqua_export.ops import rules

    dt, live = q.dtype, T // 2
    cap = rules.slots_needed(0.5, [T + 1])  # what the node needs after T + 1 tokens: it never widens here
    key, value = (torch.randn(B, HKV, cap, D, device="cuda", dtype=dt) for _ in range(2))
    heavy = torch.rand(B, HKV, cap, device="cuda")
    token = torch.full((B, HKV, cap), -1, dtype=torch.int64, device="cuda")
    token[..., :live] = torch.arange(T - live, T, device="cuda")  # the most recent half is live
    saved = token.clone()
    mask = torch.ones(B, T + 1, dtype=torch.int64, device="cuda")
    kn, vn = (torch.randn(B, HKV, 1, D, device="cuda", dtype=dt) for _ in range(2))

    def step():
        token.copy_(saved)
        # the state was checked when built (check_state: a device sync, which a captured step cannot hold)
        h2o_attention(q, kn, vn, key, value, heavy, token, mask, k=64, rule=1, ratio=0.5, check=False)
    # the selected rows of K^ and V, heavy read and written, token read
    nbytes = B * HKV * cap * (64 * 2 + D * 2 + 2 * 4 + 8)
    return [{"T": T, "B": B, "variant": "h2o 0.5 k=64", "bytes": nbytes, "s": median_s(step, graph=True),
             "eager": median_s(step)}]


def parts(T: int = 32768, B: int = 8) -> list[str]:
    """Where a step's time goes (graph replays of each launch group alone), at T, batch B."""
    return table([f"part (T {T}, batch {B})", "time (us)"], [[name, f"{median_s(fn, graph=True) * 1e6:.1f}"]
                                                             for name, fn in part_steps(T, B)])


def part_steps(T: int, B: int, device: str = "cuda") -> list[tuple]:
    """The launch groups of a step alone, (name, one call): the fused kernel's selection, and token selection's
    four stages."""
    from aqua_export.kernels.triton.aqua_attention import aqua_attention
    from aqua_export.kernels.triton.select import select
    from aqua_export.kernels.triton.tokens import choose, page_scores

    q, kdm, v, mask, P = inputs(T, B, device)
    tokens, cpu = token_setting(), device != "cuda"
    qs, idx = select(q, P, D, 32, 1, True, cpu)
    best, count = page_scores(qs, idx, G, kdm, mask, T, 0.0, cpu)
    return [("select k=64 (fused)", lambda: select(q, P, D, 64, 1, True, cpu)),
            ("select k=32 (tokens)", lambda: select(q, P, D, 32, 1, True, cpu)),
            ("page scores k=32", lambda: page_scores(qs, idx, G, kdm, mask, T, 0.0, cpu)),
            ("choose pages", lambda: choose(best, count, tokens, T, cpu)),
            ("whole token step, 1/8", lambda: aqua_attention(q, kdm, v, T, mask, 32, 1, projection=P, tokens=tokens)),
            ("whole token step, 512", lambda: aqua_attention(q, kdm, v, T, mask, 32, 1, projection=P,
                                                             tokens=token_setting(BUDGET))),
            ("whole fused k=64 step", lambda: aqua_attention(q, kdm, v, T, mask, 64, 1, projection=P))]


def rows_table(rows: list[dict], bw: float) -> list[str]:
    cells = []
    for r in rows:
        sdpa = next(x for x in rows if (x["T"], x["B"], x["variant"]) == (r["T"], r["B"], "dense SDPA"))
        s = r["s"] if r["s"] is not None else r["eager"]  # not capturable: its eager time, against SDPA's graph
        r["GB/s"], r["of copy bandwidth"] = r["bytes"] / s / 1e9, r["bytes"] / s / bw
        eager = ["-"] if r["eager"] is None else [f"{r['eager'] * 1e6:.1f}", f"{sdpa['eager'] / r['eager']:.2f}x"]
        cells.append([r["T"], r["B"], f"{r['variant']}{'' if r['s'] is not None else ' (eager)'}", f"{s * 1e6:.1f}",
                      f"{r['bytes'] / 1e6:.1f}", f"{r['GB/s']:.0f}", f"{r['of copy bandwidth']:.2f}",
                      f"{sdpa['s'] / s:.2f}x", *eager])
    return table(["T", "batch", "variant", "time (us)", "bytes (MB)", "GB/s", "of copy bandwidth", "vs dense SDPA",
                  "eager (us)", "eager vs SDPA"], cells)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/gpu_attention.md")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="16384,32768,65536,131072")
    ap.add_argument("--tune", action="store_true", help="sweep the fused kernel's launch first and use the fastest")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA GPU here (run it on a GPU machine)")
    name = torch.cuda.get_device_name()
    checks = check_scores() + check_attention() + check_h2o()
    print("\n".join(checks), flush=True)
    bw = copy_bandwidth()
    tuned, launch = tune(bw) if a.tune else ([], {})
    print("\n".join(tuned), flush=True)
    split = parts()
    print("\n".join(split), flush=True)
    rows = []
    for T in map(int, a.contexts.split(",")):
        for B in map(int, a.batches.split(",")):
            rows += bench(T, B, launch)
            torch.cuda.empty_cache()
    md = [f"# GPU attention step: the Triton kernels vs torch SDPA ({name})", "",
          f"Written by `python -m tools gpu{' --tune' if a.tune else ''}` on {name}; torch {torch.__version__}. "
          f"Llama-3.1-8B attention shapes at decode (Hkv {HKV}, g {G}, d {D}, one query token), bfloat16. Median "
          "of graph replays (triton.testing.do_bench_cudagraph), the eager do_bench beside it. Bytes = the fewest "
          f"each variant must move; the ceiling is a measured device-to-device copy: {bw / 1e9:.0f} GB/s (read + "
          "write).", "", "## Checks against float64", "",
          *[f"- {x}" for x in checks], ""]
    if tuned:
        md += ["## The fused kernel's launch (T 32768, batch 8, k 64)", "", *tuned, "",
               f"Rows below use block {launch['block']}, warps {launch['warps']}, stages {launch['stages']}, "
               f"programs wanted {launch['wanted']}.", ""]
    md += ["## Where the time goes", "", *split, "", "## Decode step", "", *rows_table(rows, bw)]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(md) + "\n")
    Path(a.out).with_suffix(".json").write_text(json.dumps({"device": name, "copy_bandwidth": bw, "launch": launch,
                                                            "rows": rows}, indent=1))
    print("\n".join(md[-len(rows) - 2:]))


if __name__ == "__main__":
    main()
