"""The comparisons parity makes and their bounds: logits of two runs on the same tokens, top-1 agreement with
argmax near-ties, and the bound max(floor, NOISE_FACTOR x the float32 reference's own error) against its float64
run (harness.py says why each bound is what it is)."""

from __future__ import annotations

import numpy as np

from .. import settings
from ..ops.spec import CACHES
from .probe import NOISE_FACTOR

# Floors of the bounds (each bound is max(floor, NOISE_FACTOR x the measured float32 error)):
#   aqua: logits of the export vs the reference under one selection; dense_vs_hf: a dense build vs HF;
#   near_tie: relative gap of a selection or eviction that two implementations may decide differently.
# float16 (no float64 run: float16's rounding dwarfs float32's): fixed allowances. Its q^ carries float16 rounding
# compounded over the layers, so a share of rows ranks coordinates differently from the float32 reference (8.6%
# at k 0.75 on the embedded model): reported, and gated on top-1 agreement (top1) with each side selecting on its
# own, counting a forward whose argmax differs by at most logit_tie as a float16 near-tie.
# own_top1: the native kernel against the function body, each selecting on its own: a near-tie row selected
# differently moves every logit after it by a whole q_i k_i term, so one differing forward passes whatever the
# count (exactness of each kernel is gated by the values above and op by op in the tests).
TOLERANCE = {"float32": {"aqua": 1e-3, "dense_vs_hf": 1e-4, "near_tie": 1e-4, "top1": 1.0, "own_top1": 0.95},
             "float16": {"aqua": 0.5, "dense_vs_hf": 0.5, "near_tie": None, "top1": 0.95, "logit_tie": 0.5,
                         "own_top1": 0.95}}
# every gate parity may report, in the order its lines read; the mechanisms that choose at run time add theirs
GATES = {"ort_vs_reference": "values under ORT's selection", "selection": "selection near-ties",
         **{m.probe.gate: m.probe.says for m in settings.MECHANISMS if m.probe},
         "native_vs_function_body": "native kernel vs function body", "ort_k1_vs_hf": "ORT at k = r vs HF",
         "cache_rounding": "narrow cache vs float32 cache"}
# The folder's narrow cache against the same graph caching float32, on the same tokens: top-1 at least its
# CacheType's parity_top1 (beyond logit ties), or one forward differing: float16 0.95, int8 0.9 (a mechanism whose
# choices move with the rounding sets its own bar: settings/tokens.py). An int8 row rounds to
# 2^-7 of its largest value where float16 rounds to 2^-11 of each value, so near-ties flip more often; what it costs is
# measured where it matters (perplexity, pass keys: benchmarks/quality.md), and a cache that moved more than one
# forward in ten fails here.


def top1_gate(trace, other, tol: dict) -> dict:
    """Two ONNX Runtime traces on the same tokens, each choosing on its own: gated on top-1 agreement (>= own_top1,
    or at most one forward differing: a near-tie may flip), the logit differences reported."""
    c = compare(trace, other, tol["aqua"], tol.get("logit_tie"))
    c["pass"] = c["top1_agreement_beyond_ties"] >= tol["own_top1"] or c["top1_differing"] <= 1
    c["gate"] = (f"top-1 agreement >= {tol['own_top1']} or at most one forward differing, on the same tokens "
                 "(logit differences reported)")
    return c


def cache_gate(trace, float32_cache, tol: dict, cache_dtype: str, moved: tuple[float, float] | None = None) -> dict:
    """The folder's graph (its cache_dtype cache) against the same graph caching float32, on the same tokens: top-1
    gated as the native kernel's is (a near-tie may flip under the cache's rounding), at the cache type's own bar
    (ops.spec.CACHES' parity_top1), or at ``moved`` = (bar, logit tie) where a mechanism's choices move with the
    rounding (settings.base.Probe.cache_top1), the logit differences reported (what the narrower cache costs)."""
    bar = moved[0] if moved else CACHES[cache_dtype].parity_top1
    tie = {"logit_tie": moved[1]} if moved else {}
    return {**top1_gate(trace, float32_cache, {**tol, **tie, "own_top1": bar}), "cache_dtype": cache_dtype,
            "top1_bar": bar}


def diffs(a, b) -> tuple[float, float]:
    """(prefill, decode): the largest |logit difference| of two traces on the same tokens."""
    prefill = float(np.abs(a[0] - b[0]).max())
    return prefill, max((float(np.abs(x[-1] - y[-1]).max()) for x, y in zip(a[1:], b[1:])), default=0.0)


def compare(trace, ref, bound: float, tie: float | None) -> dict:
    """Logit differences at prefill and each step, and top-1 agreement per forward. A forward whose argmax differs
    counts as a near-tie, not a failure, when the reference's top-1 beats the other side's choice by at most
    ``tie`` (two logits that close may swap under the rounding the bound allows)."""
    prefill, decode = diffs(trace, ref)
    agree, margins = [], []
    for a, b in zip(trace, ref):
        top_a, top_b = int(a[-1].argmax()), int(b[-1].argmax())
        agree.append(int(top_a == top_b))
        if top_a != top_b:
            margins.append(float(b[-1][top_b] - b[-1][top_a]))
    ties = [m for m in margins if tie is not None and m <= tie]
    return {"max_abs_logit_diff_prefill": prefill, "max_abs_logit_diff_decode": decode,
            "top1_agreement": sum(agree) / len(agree), "top1_differing": len(agree) - sum(agree),
            "greedy_identical": all(agree), "tolerance": bound, "top1_differing_near_ties": len(ties),
            "top1_margins_of_differing": margins, "logit_tie": tie,
            "top1_agreement_beyond_ties": (sum(agree) + len(ties)) / len(agree),
            "pass": max(prefill, decode) <= bound and len(ties) == len(margins)}


def gate(trace, ref32, ref64, floor: float, tol: dict) -> dict:
    """trace against the exact answer ref64 within max(floor, NOISE_FACTOR x |ref32 - ref64|), near-ties of the
    argmax within that bound allowed; without ref64 (float16) against ref32 within the floor."""
    if ref64 is None:
        return {**compare(trace, ref32, floor, tol.get("logit_tie")), "reference": "float32"}
    noise = diffs(ref32, ref64)
    bound = max(floor, NOISE_FACTOR * max(noise))
    vs32 = diffs(trace, ref32)
    return {**compare(trace, ref64, bound, bound), "reference": "float64", "floor": floor,
            "float32_error_prefill": noise[0], "float32_error_decode": noise[1],
            "vs_float32_prefill": vs32[0], "vs_float32_decode": vs32[1]}


def eviction_agreement(a: list, b: list) -> dict:
    """Two runs' eviction logs (per token, per layer live tokens [B, Hkv, seen]) on the same tokens: how many
    (token, layer, batch, head) decisions left different live sets."""
    differ = total = 0
    for ea, eb in zip(a, b):
        for la, lb in zip(ea, eb):
            total += la.shape[0] * la.shape[1]
            differ += int((la != lb).any(-1).sum())
    return {"decisions": total, "differing": differ}
