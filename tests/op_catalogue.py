"""The op test catalogue: per custom op, its cases (inputs, attributes, dtype), the tolerances per dtype, and the
golden tables every implementation must reproduce. test_ops.py runs each case against the op's float64 reference
(ops/<op>.py) on every implementation (implementations.py). Adding an op is one ops/ module plus one CATALOGUE line;
adding a selection rule is one ops.spec entry (and its score in ops.rules): the rule grids below read the codes.

Tolerances (float32 against the float64 reference): scores 1e-5 relative to max(1, |s|) (float32 sums of r terms),
attention outputs 2e-5 (float32 accumulation over L terms), H2O outputs 1e-5 and heavy sums 1e-5 relative to
max(1, |heavy|) (sums over the tokens seen); float16: 2e-3 relative
(float32 accumulation, one float16 rounding of a score), 4e-3 attention and 2e-2 H2O outputs (float16's rounding of
q^, K^, V). Integer outputs (H2O's token buffers: the eviction decisions) must be identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from helpers import H2O_MASKS, attention_inputs, h2o_inputs, random_projection

from aqua_export.ops import (aqua_attention, cache_update, h2o_attention, logit_rows, matmul_q4a8, quantize_rows, rules,
                             topk_gather_dot, value_product)
from aqua_export.ops.spec import GROUP, MAGNITUDE, RULE_NAMES, STATIC, int8_scales
from aqua_export.runtime.session import prompt_bf16_runs
from aqua_export.settings import prefill as prefill_settings

RULES = sorted(RULE_NAMES)  # every selection rule's code


@dataclass(frozen=True)
class Case:
    """inputs(): the op's inputs in port order (+ P when projected), torch tensors. large: beyond what Triton's CPU
    interpreter runs in CI time (run there only on a GPU). only: the implementations it applies to (default all).
    unlike(inputs): another answer output 0 must differ from by > 1e-2 (the case can fail). check(outputs, inputs):
    a further assertion; versus_reference False: only that (behaviour the reference does not define). error: a bad
    input the validating implementations refuse with this message. cache_dtype: the "C" ports' type (the caches: a
    float16 cache under a float32 query), default dtype."""

    id: str
    inputs: Callable[[], list]
    attrs: dict
    dtype: str = "float32"
    projected: bool = False
    large: bool = False
    only: tuple = ()
    unlike: Callable | None = None
    check: Callable | None = None
    versus_reference: bool = True
    error: str | None = None
    cache_dtype: str | None = None


@dataclass(frozen=True)
class OpCases:
    op: object  # ops.table.OpDef
    cases: list
    tolerance: dict  # dtype -> {output: (tolerance, relative to max(1, |reference|))}
    int_outputs: tuple = field(default=())


def _k(r: int, which) -> int:
    return {1: 1, "half": r // 2, "r": r}[which]


def _length(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# TopKGatherDot
# --------------------------------------------------------------------------------------------

def _score_inputs(shape, dtype=torch.float32, seed=0, length=None):
    b, hkv, g, t, r, s = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, t, r, generator=gen)
    q[0, 0, 0, 0, : min(4, r)] = 1.5  # a tie: the lower index must win, as everywhere
    q[-1, -1, -1, -1, :] = 0.25       # all coordinates tied
    kc = torch.randn(b, hkv, r, s, generator=gen)
    return [q.to(dtype), kc.to(dtype), _length(s if length is None else length)]


def _identity_inputs():
    q = _score_inputs((3, 2, 2, 5, 8, 1))[0]
    return [q, torch.eye(8).expand(3, 2, 8, 8).contiguous(), _length(8)]


def _kept_exactly(k):
    def check(outs, ins):  # identity key cache: score[c] = q[c] where c is kept, else 0
        assert ((outs[0] != 0).sum(-1) == k).all()
    return check


# (B, Hkv, g, T, r, S): GQA groups, odd T and S, decode (T = 1); large: S crossing the native kernel's 1024 block
SCORE_SHAPES = [((1, 1, 1, 1, 16, 5), False), ((2, 3, 3, 1, 64, 131), False), ((3, 2, 2, 5, 8, 7), False),
                ((1, 2, 4, 3, 48, 300), False), ((2, 3, 3, 1, 64, 1031), True), ((1, 2, 4, 3, 64, 2500), True)]
SCORES = [
    *[Case(f"{'x'.join(map(str, s))}-k{which}-rule{rule}", lambda s=s: _score_inputs(s),
           {"k": _k(s[4], which), "rule": rule}, large=large)
      for s, large in SCORE_SHAPES for which in (1, "half", "r") for rule in RULES],
    # 11 slots of which the first 7 are filled, a four-way tie
    *[Case(f"filled-7-of-11-k{k}-rule{rule}", lambda: _score_inputs((3, 2, 2, 5, 8, 11), seed=3, length=7),
           {"k": k, "rule": rule}) for k, rule in ((1, MAGNITUDE), (3, MAGNITUDE), (8, MAGNITUDE), (3, GROUP), (3, STATIC))],
    # a shared buffer of C = 1500 slots with L filled: scores [.., L]
    *[Case(f"filled-{n}-of-1500", lambda n=n: _score_inputs((2, 3, 3, 1, 64, 1500), seed=2, length=n), {"k": 48},
           large=True) for n in (0, 1, 1100)],
    *[Case(f"identity-keys-k{k}", _identity_inputs, {"k": k}, check=_kept_exactly(k)) for k in (1, 3, 8)],
    Case("float16", lambda: _score_inputs((2, 3, 3, 2, 64, 70), torch.float16), {"k": 32}, dtype="float16"),
    Case("past-the-buffer", lambda: _score_inputs((2, 3, 3, 1, 64, 1500), length=1501), {"k": 48},
         only=("native",), error="total_length must be in"),
    Case("keys-narrower-than-queries", lambda: [torch.zeros(1, 2, 1, 1, 8), torch.zeros(1, 2, 6, 3), _length(3)],
         {"k": 4}, only=("native", "triton"), error="disagree"),
    Case("k-past-r", lambda: [torch.zeros(1, 2, 1, 1, 8), torch.zeros(1, 2, 8, 3), _length(3)], {"k": 9},
         only=("native", "triton"), error=r"k must be in \[1, r"),
]


# --------------------------------------------------------------------------------------------
# AquaAttention
# --------------------------------------------------------------------------------------------

def _attention_inputs(shape, dtype=torch.float32, rv=None, scale=1.0, d=None, hidden_row=False, cache=None):
    q, kc, vc, length, mask = attention_inputs(shape, dtype, rv=rv)
    if cache is torch.int8:  # int8 rows with their exponents (contract cache_dtype int8; rules.int8_rows)
        kc, vc = rules.int8_rows(kc.transpose(-1, -2)).transpose(-1, -2).contiguous(), rules.int8_rows(vc)
    elif cache is not None:  # the caches of another float type (contract cache_dtype)
        kc, vc = kc.to(cache), vc.to(cache)
    if hidden_row:
        mask[1] = 0  # a sequence of padding only: its query rows see no key
    ins = [q * scale, kc, vc, _length(length), mask]
    if d is not None:  # the node projects: q [B,Hkv,g,T,d] and P [Hkv, d, r]
        b, hkv, g, t, r = shape[:5]
        ins[0] = torch.randn(b, hkv, g, t, d, generator=torch.Generator().manual_seed(2)).to(dtype)
        ins.append(random_projection(hkv, d, r).to(dtype))
    return ins


def _unprojected(ins):
    r = ins[1].shape[2]
    return [ins[0][..., :r].double()] + [x.double() if x.is_floating_point() else x for x in ins[1:5]]


def _zero_hidden_row(outs, ins):
    assert torch.isfinite(outs[0]).all() and (outs[0][1] == 0).all() and (outs[0][0] != 0).any()


# (B, Hkv, g, T, r, L, C): decode at batch 1 with a long L (positions split over threads or programs), batched
# decode with a buffer larger than L and left padding, prefill (T > 1, causal), one query head per group, g = 4,
# Llama-3's head_dim 128 (the native float32 value product runs in passes of 64 columns)
ATTENTION_SHAPES = [((1, 2, 3, 1, 64, 700, 700), False), ((3, 2, 3, 1, 32, 90, 130), False),
                    ((2, 2, 3, 5, 16, 40, 40), False), ((2, 1, 1, 3, 8, 9, 12), False), ((1, 1, 4, 1, 128, 100, 128), False),
                    ((1, 2, 3, 1, 64, 3000, 3000), True), ((3, 3, 3, 1, 32, 300, 517), True), ((2, 2, 3, 7, 16, 40, 40), False),
                    ((2, 1, 1, 5, 8, 9, 12), False), ((1, 2, 4, 3, 64, 600, 700), True), ((2, 2, 4, 1, 128, 700, 800), True)]
def _tokens(ratio=1.0, budget=0, sink=4, window=8) -> dict:
    return {"token_ratio": ratio, "token_budget": budget, "token_sink": sink, "token_window": window}


def _prices(hkv: int) -> list:
    """Unequal head prices (a case of shared k): the cheap head gives coordinates to the dear ones."""
    return [0.5, 2.0, 1.0, 1.5][:hkv]


def _key_weights(hkv: int, r: int) -> list:
    """Uneven positive weights per kv head and coordinate (key_weights: a weighted rule's calibrated key RMS, by which
    the node divides K^'s rows)."""
    return (0.25 + 2.75 * torch.rand(hkv * r, generator=torch.Generator().manual_seed(5))).tolist()


def _dense(r):
    """The answer without token selection, every token exact (a token case must differ from it)."""
    return lambda ins: aqua_attention.reference(*[x.double() if x.is_floating_point() else x for x in ins], k=r)


# (shape, token settings, large, unlike dense): decode at batch 1 (pages split over threads or programs), batched
# decode with left padding, g = 6 (two tiles of the group's rows), a fixed budget, a window covering every token,
# a prompt (T > 1: exact, every token)
TOKEN_SHAPES = [((1, 2, 3, 1, 64, 700, 700), {"ratio": 0.25}, False, True),
                ((3, 2, 3, 1, 32, 90, 130), {"ratio": 0.3, "sink": 2, "window": 5}, False, True),
                ((1, 2, 6, 1, 32, 300, 300), {"ratio": 0.2}, False, True),
                ((2, 2, 3, 1, 16, 200, 210), {"budget": 40}, False, True),
                ((2, 1, 3, 1, 16, 40, 48), {"ratio": 0.1, "window": 64}, False, False),
                ((2, 2, 3, 5, 16, 40, 40), {"ratio": 0.25}, False, False),
                ((1, 2, 3, 1, 64, 3000, 3000), {"ratio": 0.125, "sink": 16, "window": 64}, True, True),
                ((2, 2, 4, 1, 128, 1500, 1600), {"budget": 256, "sink": 16, "window": 64}, True, True)]
def _prefill(threshold=0.9, stride=prefill_settings.STRIDE.default, k_ratio=prefill_settings.K_RATIO.default) -> dict:
    """Sparse prefill's attributes, its settings' defaults unless given (k_ratio below 1: each estimating row on its
    top coordinates only)."""
    return {"prefill_threshold": threshold, "prefill_stride": stride, "prefill_k_ratio": k_ratio}


def _prefill_inputs(shape, **kw):
    """Attention inputs whose every third key block (from slot 64) holds keys 4x as large: their scores spread wider,
    so a few blocks hold most of a row's mass and sparse prefill has blocks to leave out (random keys spread it
    evenly)."""
    ins = _attention_inputs(shape, scale=kw.pop("scale", 0.3), **kw)
    kc = ins[1].clone()
    heavy = torch.zeros(kc.shape[-1], dtype=torch.bool)
    for s0 in range(64, kc.shape[-1], 192):
        heavy[s0:s0 + 64] = True
    if kc.dtype == torch.int8:  # int8 rows: a scale 4x as large (8 quarter powers of two more in the code row)
        kc[..., -1, heavy] += 8
    else:
        kc[..., heavy] *= 4
    ins[1] = kc
    return ins


def _rising(ins, top=6.0):
    """The same inputs with K^'s columns growing along the keys (1x to top x): a later key block's scores pass an
    earlier one's maximum by more than the prompt kernel's shift slack (8), so its softmax moves the shift and
    rescales the rows' O and l (plugins/ort/prompt_tiles.h kShiftSlack; the estimate's block sums alike). Sparse
    prefill's inputs, whose heavy blocks are 4x already, rise to 2x: scores past ~30 put float32's own rounding near
    the tolerance (1.5-2.2e-5 at 3x-6x there, 8.6e-6 at 2x, on v4 / v3 / v2)."""
    kc = ins[1]
    ins[1] = (kc * torch.linspace(1.0, top, kc.shape[-1], dtype=torch.float64).to(kc.dtype)).contiguous()
    return ins


def _dense_of(attrs: dict, projected: bool = False):
    """The case's answer with a dense prompt (a sparse prefill case must differ from it)."""
    plain = {n: v for n, v in attrs.items() if not n.startswith("prefill_")}
    return lambda ins: aqua_attention.reference(*(_unprojected(ins) if projected else
                                                  [x.double() if x.is_floating_point() else x for x in ins]), **plain)


def _prefill_case(name, shape, attrs, dtype="float32", projected=False, cache=None, cache_dtype=None, d=None,
                  differs=True, large=False, triton=True):
    """A sparse prefill case (triton: Triton runs it too; an int8 cache or key weights are the CPU kernels')."""
    return Case(f"prefill-{name}-{'x'.join(map(str, shape))}",
                lambda: _prefill_inputs(shape, dtype=getattr(torch, dtype), d=d, cache=cache), attrs, dtype=dtype,
                projected=projected, cache_dtype=cache_dtype,
                only=("function", "native", "triton") if triton else ("function", "native"), large=large,
                unlike=_dense_of(attrs, projected) if differs else None,
                check=None if differs else _same_as_dense(attrs))


def _same_as_dense(attrs):
    def check(outs, ins):  # nothing in the call is sparse: the dense answer, bit for bit on the same kernel path
        want = _dense_of(attrs)(ins)
        assert (outs[0].double() - want).abs().max() < 2e-5
    return check


# sparse prefill: from an empty cache (block boundaries), a left-padded batch whose chunk starts mid-block, a chunk
# after a past at g = 4 and r = 64, a sliding window, a prompt shorter than one block (dense), the int8 and float16
# caches, projected, with token selection, soft-capped, key weights, shared k, a float16 graph, scores rising along
# the keys; those of 700 rows are large for Triton's interpreter (~80 s each), which runs the small ones after them
PREFILL = [
    _prefill_case("empty-cache", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, **_prefill()}, large=True),
    _prefill_case("padded-mid-block", (2, 2, 3, 560, 32, 600, 640), {"k": 16, "rule": MAGNITUDE, **_prefill()},
                  large=True),
    _prefill_case("past-g4", (1, 2, 4, 560, 64, 900, 900), {"k": 32, "rule": MAGNITUDE, **_prefill(0.7, k_ratio=0.25)},
                  large=True),
    _prefill_case("window", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, "sliding_window": 200,
                                                           **_prefill()}, large=True),
    _prefill_case("short", (1, 2, 3, 40, 16, 40, 40), {"k": 8, "rule": GROUP, **_prefill()}, differs=False),
    _prefill_case("cache-int8", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, "cache_scales": 1,
                                                               **_prefill()}, cache=torch.int8, cache_dtype="int8",
                  triton=False),
    _prefill_case("cache-float16", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, **_prefill()},
                  cache=torch.float16, cache_dtype="float16", large=True),
    _prefill_case("projects", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": MAGNITUDE, **_prefill(k_ratio=0.5)},
                  projected=True, d=48, large=True),
    _prefill_case("tokens", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, **_tokens(ratio=0.25),
                                                           **_prefill()}, large=True),
    _prefill_case("softcap", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, "softcap": 5.0, **_prefill()},
                  large=True),
    _prefill_case("keyed", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": MAGNITUDE, "key_weights": _key_weights(2, 32),
                                                          **_prefill(stride=4, k_ratio=0.25)}, triton=False),
    _prefill_case("shared-k", (1, 2, 3, 700, 32, 700, 700), {"k": 8, "rule": MAGNITUDE, "head_prices": _prices(2),
                                                             **_prefill(k_ratio=0.25)}, large=True),
    _prefill_case("float16", (1, 2, 3, 700, 32, 700, 700), {"k": 16, "rule": GROUP, **_prefill()}, dtype="float16",
                  large=True),
    Case("prefill-rising-1x2x3x700x32x700x700", lambda: _rising(_prefill_inputs((1, 2, 3, 700, 32, 700, 700)), 2.0),
         {"k": 32, "rule": GROUP, **_prefill()}, only=("function", "native", "triton"),
         unlike=_dense_of({"k": 32, "rule": GROUP}), large=True),
    # sized for the interpreter (one KV head, r = 16, ~300 rows): block boundaries; a left-padded batch after a past,
    # its chunk starting mid-block; a past at g = 4, projected, estimating on half of r; a sliding window,
    # soft-capped, under token selection; shared k (the g rows share one KV head's budget); a float16 graph
    _prefill_case("small", (1, 1, 3, 384, 16, 384, 384), {"k": 8, "rule": GROUP, **_prefill()}),
    _prefill_case("small-padded-mid-block", (2, 1, 3, 200, 16, 390, 400), {"k": 8, "rule": MAGNITUDE, **_prefill()}),
    _prefill_case("small-past-g4-projects", (1, 1, 4, 256, 16, 448, 448), {"k": 8, "rule": MAGNITUDE,
                                                                            **_prefill(0.7, k_ratio=0.5)},
                  projected=True, d=24),
    _prefill_case("small-window-softcap-tokens", (1, 1, 3, 384, 16, 384, 384),
                  {"k": 8, "rule": GROUP, "sliding_window": 200, "softcap": 5.0, **_tokens(ratio=0.25),
                   **_prefill(0.8)}),
    _prefill_case("small-shared-k", (1, 1, 3, 384, 16, 384, 384), {"k": 4, "rule": MAGNITUDE, "head_prices": _prices(1),
                                                                   **_prefill(k_ratio=0.25)}),
    _prefill_case("small-float16", (1, 1, 3, 384, 16, 384, 384), {"k": 8, "rule": GROUP, **_prefill()},
                  dtype="float16"),
]
# bfloat16 prompt products (prompt_bf16, settings/precision.py; the native kernel: the function body ignores the
# attribute). Where the CPU runs them, against the reference on q^, K^ and V rounded to bfloat16 (what is left: the
# probabilities' rounding and float32 sums: 1.5e-3 to 3.6e-3 measured on these cases); elsewhere float32's answer.
BF16_OUT = 1e-2


def _bf16_check(attrs):
    plain = {n: v for n, v in attrs.items() if n != "prompt_bf16"}

    def check(outs, ins):
        exact = aqua_attention.reference(*[x.double() if x.is_floating_point() else x for x in ins], **plain)
        off = (outs[0].double() - exact).abs().max().item()
        runs = prompt_bf16_runs()
        assert (off > 1e-4) == runs, f"bfloat16 {'ran' if runs else 'did not run'}, yet the answer is {off:.1e} off"
        if runs:
            rounded = [x.to(torch.bfloat16).double() for x in ins[:3]] + list(ins[3:])
            err = (outs[0].double() - aqua_attention.reference(*rounded, **plain)).abs().max().item()
            assert err <= BF16_OUT, f"{err:.2e} from the reference on bfloat16 operands > {BF16_OUT:.0e}"
        else:
            assert off <= 2e-5, f"float32 here (no AVX512_BF16): {off:.2e} > 2e-5"
    return check


def _bf16_case(name, shape, attrs, cache=None, cache_dtype=None, inputs=None):
    attrs = {**attrs, "prompt_bf16": 1}
    return Case(f"bf16-{name}-{'x'.join(map(str, shape))}",
                inputs or (lambda: _attention_inputs(shape, scale=0.3, cache=cache)), attrs, only=("native",),
                cache_dtype=cache_dtype, versus_reference=False, check=_bf16_check(attrs))


# a prompt from an empty cache, one after a past with left padding, r = 48 (an odd count of 16-column panels), a
# short prompt (16 rows), a float16 cache, g = 4 and r = 128, soft-capped, sparse prefill on top, scores rising
# along the keys (the softmax's shift moves)
BF16 = [
    _bf16_case("empty-cache", (1, 2, 3, 300, 64, 300, 300), {"k": 64}),
    _bf16_case("past-padded", (2, 2, 3, 150, 32, 400, 420), {"k": 32}),
    _bf16_case("r48", (1, 2, 3, 200, 48, 260, 260), {"k": 48}),
    _bf16_case("sixteen-rows", (1, 1, 2, 16, 64, 40, 40), {"k": 64}),
    _bf16_case("cache-float16", (1, 2, 3, 300, 64, 300, 300), {"k": 64}, cache=torch.float16, cache_dtype="float16"),
    _bf16_case("g4-r128", (1, 2, 4, 130, 128, 130, 130), {"k": 128}),
    _bf16_case("softcap", (1, 2, 3, 200, 32, 200, 200), {"k": 32, "softcap": 5.0}),
    _bf16_case("prefill", (1, 2, 3, 700, 32, 700, 700), {"k": 32, "rule": GROUP, **_prefill()},
               inputs=lambda: _prefill_inputs((1, 2, 3, 700, 32, 700, 700))),
    _bf16_case("rising", (1, 2, 3, 300, 32, 700, 700), {"k": 32},
               inputs=lambda: _rising(_attention_inputs((1, 2, 3, 300, 32, 700, 700), scale=0.3))),
]
ATTENTION = [
    *[Case(f"{'x'.join(map(str, s))}-k{which}-rule{rule}", lambda s=s: _attention_inputs(s),
           {"k": _k(s[4], which), "rule": rule}, large=large)
      for s, large in ATTENTION_SHAPES for which in (1, "half", "r") for rule in RULES],
    # AQUA-Memory may cache V at its own width rv: out is rv wide (a split decode merges rv + 2 partials)
    *[Case(f"values-{rv}-wide-{'x'.join(map(str, s))}", lambda s=s, rv=rv: _attention_inputs(s, rv=rv),
           {"k": s[4] // 2, "rule": GROUP}, large=large)
      for s, rv, large in (((1, 2, 3, 1, 32, 3000, 3000), 48, True), ((2, 2, 3, 7, 16, 40, 40), 8, False),
                           ((2, 2, 3, 1, 64, 600, 600), 52, True), ((1, 2, 3, 2, 64, 300, 300), 100, True),
                           ((2, 2, 3, 2, 16, 50, 64), 24, False))],
    Case("softcap", lambda: _attention_inputs((2, 2, 3, 4, 16, 50, 64), scale=4.0), {"k": 8, "rule": GROUP, "softcap": 5.0},
         unlike=lambda ins: aqua_attention.reference(*[x.double() if x.is_floating_point() else x for x in ins], k=8,
                                                     rule=GROUP)),
    Case("float16", lambda: _attention_inputs((2, 3, 3, 2, 32, 120, 128), torch.float16), {"k": 16}, dtype="float16"),
    *[Case(f"projects-{'x'.join(map(str, s))}-d{d}-rule{rule}", lambda s=s, d=d: _attention_inputs(s, d=d),
           {"k": s[4] // 2, "rule": rule}, projected=True, large=large,
           unlike=lambda ins, rule=rule, s=s: aqua_attention.reference(*_unprojected(ins), k=s[4] // 2, rule=rule))
      for s, d, large in (((1, 2, 3, 1, 64, 300, 300), 64, False), ((2, 2, 3, 4, 16, 40, 40), 24, False),
                          ((1, 2, 3, 1, 64, 3000, 3000), 64, True), ((3, 3, 3, 1, 32, 300, 517), 32, True),
                          ((2, 2, 4, 1, 96, 700, 800), 128, True))
      for rule in (MAGNITUDE, GROUP)],
    Case("projects-float16", lambda: _attention_inputs((2, 3, 3, 2, 32, 200, 256), torch.float16, d=32),
         {"k": 16, "rule": GROUP}, dtype="float16", projected=True),
    # token selection: a decode step attends the pages its approximate scores choose, a prompt every token exactly
    *[Case(f"tokens-{'x'.join(map(str, s))}-{'-'.join(f'{a}{v}' for a, v in tok.items())}-rule{rule}",
           lambda s=s: _attention_inputs(s), {"k": s[4] // 2, "rule": rule, **_tokens(**tok)}, large=large,
           unlike=_dense(s[4]) if unlike else None)
      for s, tok, large, unlike in TOKEN_SHAPES for rule in (MAGNITUDE, GROUP)],
    Case("tokens-projects", lambda: _attention_inputs((1, 2, 3, 1, 64, 300, 300), d=64),
         {"k": 32, "rule": GROUP, **_tokens(ratio=0.3)}, projected=True, unlike=lambda ins: aqua_attention.reference(
             *_unprojected(ins), k=32, rule=GROUP, **_tokens(ratio=0.3))),
    # a float32 graph caching float16 (contract cache_dtype): the caches' values are exact in float64, so float32's
    # tolerance holds; decode split over threads, Llama's d = 128 (value vectors of 64), a prompt, projected, tokens
    *[Case(f"cache-float16-{'x'.join(map(str, s))}{'-projects' if d else ''}{'-tokens' if tok else ''}",
           lambda s=s, d=d: _attention_inputs(s, d=d, cache=torch.float16),
           {"k": s[4] // 2, "rule": GROUP, **(_tokens(ratio=0.25) if tok else {})}, projected=d is not None,
           cache_dtype="float16", only=("function", "native"))
      for s, d, tok in (((1, 2, 3, 1, 64, 700, 700), None, False), ((2, 1, 4, 1, 128, 300, 320), None, False),
                        ((2, 2, 3, 5, 16, 40, 40), None, False), ((1, 2, 3, 1, 64, 300, 300), 64, False),
                        ((1, 2, 3, 1, 64, 700, 700), None, True), ((3, 2, 3, 1, 32, 90, 130), 32, True))],
    # a float32 graph caching int8 rows (contract cache_dtype int8): the values q 2^e are exact in float64 and the
    # kernels apply each token's scale to its score and weight (the same products), so float32's tolerance holds;
    # decode split over threads, d = 128, a short prompt, projected, tokens, shared k
    *[Case(f"cache-int8-{'x'.join(map(str, s))}{'-projects' if d else ''}{'-tokens' if tok else ''}"
           f"{'-shared-k' if shared else ''}",
           lambda s=s, d=d: _attention_inputs(s, d=d, cache=torch.int8),
           {"k": s[4] // 2, "rule": GROUP, "cache_scales": 1, **(_tokens(ratio=0.25) if tok else {}),
            **({"head_prices": _prices(s[1])} if shared else {})}, projected=d is not None,
           cache_dtype="int8", only=("function", "native"))
      for s, d, tok, shared in (((1, 2, 3, 1, 64, 700, 700), None, False, False),
                                ((2, 1, 4, 1, 128, 300, 320), None, False, False),
                                ((2, 2, 3, 5, 16, 40, 40), None, False, False),
                                ((1, 2, 3, 1, 64, 300, 300), 64, False, False),
                                ((1, 2, 3, 1, 64, 700, 700), None, True, False),
                                ((3, 2, 3, 1, 32, 90, 130), 32, True, False),
                                ((2, 3, 3, 1, 32, 90, 130), None, False, True))],
    # key_weights (a weighted rule's int8 cache holds k^, the node scores k^ / w): decode split over threads, a
    # prompt, projected token selection, shared k, and the float caches the parity gates run the same graph with
    *[Case(f"keyed-{'x'.join(map(str, s))}-k{k}{'-projects' if d else ''}{'-tokens' if tok else ''}"
           f"{'-shared-k' if shared else ''}-{c}",
           lambda s=s, d=d, c=c: _attention_inputs(s, d=d, cache=getattr(torch, c) if c != "float32" else None),
           {"k": k, "rule": GROUP, "key_weights": _key_weights(s[1], s[4]),
            **({"cache_scales": 1} if c == "int8" else {}),
            **(_tokens(ratio=0.25) if tok else {}), **({"head_prices": _prices(s[1])} if shared else {})},
           projected=d is not None, cache_dtype=c, only=("function", "native"))
      for s, k, d, tok, shared, c in (((1, 2, 3, 1, 64, 700, 700), 16, None, False, False, "int8"),
                                      ((2, 2, 3, 24, 32, 50, 64), 8, None, False, False, "int8"),
                                      ((2, 2, 3, 24, 32, 50, 64), 32, None, False, False, "int8"),
                                      ((3, 2, 3, 1, 32, 90, 130), 8, 32, True, False, "int8"),
                                      ((2, 3, 3, 1, 32, 90, 130), 8, None, False, True, "int8"),
                                      ((1, 2, 3, 1, 64, 300, 300), 16, None, False, False, "float32"),
                                      ((2, 2, 3, 24, 32, 50, 64), 8, 48, False, False, "float32"))],
    Case("keyed-weights-per-kv-head-and-coordinate", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20)),
         {"k": 8, "key_weights": [1.0] * 16}, only=("native",), error="key_weights must hold"),
    Case("keyed-weights-positive", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20)),
         {"k": 8, "key_weights": [1.0] * 31 + [0.0]}, only=("native",), error="key_weights must be positive"),
    # shared k (head_prices, allocate's k sharing): per token the heads share Hkv g' k coordinates at their prices;
    # a row may keep none or all r. Decode split over threads or programs, batched prompts, projected, token
    # selection, float16, a float16 cache; the static rule ignores the prices (the last case: a price per kv head
    # or refused)
    *[Case(f"shared-k-{'x'.join(map(str, s))}-rule{rule}{'-projects' if d else ''}{'-tokens' if tok else ''}-{dt}",
           lambda s=s, d=d, dt=dt, c=c: _attention_inputs(s, getattr(torch, dt), d=d, cache=c),
           {"k": s[4] // 4, "rule": rule, "head_prices": _prices(s[1]), **(_tokens(ratio=0.25) if tok else {})},
           dtype=dt, projected=d is not None, cache_dtype=None if c is None else "float16",
           only=() if c is None else ("function", "native"),
           unlike=None if rule == STATIC else lambda ins, s=s, rule=rule, d=d: aqua_attention.reference(
               *(_unprojected(ins) if d else [x.double() if x.is_floating_point() else x for x in ins]), k=s[4] // 4, rule=rule, **(_tokens(ratio=0.25) if tok else {})))
      for s, rule, d, tok, dt, c in (((1, 3, 3, 1, 64, 700, 700), 0, None, False, "float32", None),
                                     ((2, 2, 3, 5, 16, 40, 40), 0, None, False, "float32", None),
                                     ((2, 3, 3, 1, 32, 90, 130), 1, None, False, "float32", None),
                                     ((1, 2, 3, 1, 64, 300, 300), 0, 64, False, "float32", None),
                                     ((1, 2, 3, 1, 64, 700, 700), 0, None, True, "float32", None),
                                     ((2, 3, 3, 2, 32, 120, 128), 0, None, False, "float16", None),
                                     ((2, 1, 4, 1, 128, 300, 320), 0, None, False, "float32", torch.float16),
                                     ((2, 2, 3, 3, 16, 40, 40), 2, None, False, "float32", None))],
    Case("shared-k-prices-per-kv-head", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20)),
         {"k": 8, "head_prices": [1.0, 2.0, 3.0]}, only=("native", "triton"), error="one price per kv head"),
    Case("tokens-float16", lambda: _attention_inputs((2, 3, 3, 1, 32, 200, 256), torch.float16),
         {"k": 16, "rule": GROUP, **_tokens(ratio=0.3)}, dtype="float16"),
    Case("tokens-softcap", lambda: _attention_inputs((2, 2, 3, 1, 16, 150, 160), scale=4.0),
         {"k": 8, "rule": MAGNITUDE, "softcap": 5.0, **_tokens(ratio=0.25)}),
    Case("tokens-ratio-past-1", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20)), {"k": 8, **_tokens(ratio=1.5)},
         only=("native", "triton"), error="token_ratio must be in"),
    Case("row-hidden-everywhere", lambda: _attention_inputs((2, 2, 3, 1, 16, 30, 30), hidden_row=True), {"k": 8},
         check=_zero_hidden_row),
    Case("past-the-buffer", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20))[:3] + [_length(21), torch.ones(1, 21, dtype=torch.int64)],
         {"k": 8}, only=("native", "triton"), error="total_length must fit"),
    Case("mask-of-another-length", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20))[:4] + [torch.ones(1, 19, dtype=torch.int64)],
         {"k": 8}, only=("native", "triton"), error="attention_mask"),
    # a sliding window (Gemma's, Mistral's local layers): decode, a prompt, token selection inside the window
    *[Case(f"sliding-window-{'x'.join(map(str, s))}-w{w}", lambda s=s: _attention_inputs(s),
           {"k": s[4] // 2, "rule": GROUP, "sliding_window": w, **(_tokens(ratio=0.5) if s[3] == 1 and w > 40 else {})},
           large=s[3] * s[5] > 3000,
           unlike=lambda ins, s=s: aqua_attention.reference(*[x.double() if x.is_floating_point() else x for x in ins],
                                                            k=s[4] // 2, rule=GROUP))
      for s, w in (((2, 2, 3, 1, 16, 90, 100), 24), ((2, 2, 3, 40, 16, 64, 64), 24), ((1, 2, 3, 1, 32, 300, 300), 100),
                   ((1, 2, 3, 20, 32, 300, 320), 50))],
    # prompts (T >= 16 tokens: blocked matrix products): from an empty cache with a left-padded batch (its padding
    # rows see nothing), a chunk after a past, a long one, every rule and k, values of another width, projected,
    # shared k, token selection (exact), float16, a float16 cache, soft-capped, scores rising along the keys
    # (the grid on the CPU's implementations: Triton takes a prompt through its decode kernel's programs, run on the
    # cases above with T <= 7 and the single prompt cases below; its interpreter would spend minutes here)
    *[Case(f"prompt-{'x'.join(map(str, s))}-k{which}-rule{rule}", lambda s=s: _attention_inputs(s),
           {"k": _k(s[4], which), "rule": rule}, large=large, only=("function", "native"))
      for s, large in (((2, 2, 3, 40, 16, 40, 40), False), ((1, 2, 3, 32, 64, 100, 128), False),
                       ((1, 1, 4, 300, 64, 300, 300), True), ((2, 1, 1, 17, 8, 30, 30), False),
                       ((1, 2, 8, 20, 128, 50, 64), True))
      for which in (1, "half", "r") for rule in RULES],
    Case("prompt-values-24-wide", lambda: _attention_inputs((2, 2, 3, 30, 16, 50, 64), rv=24), {"k": 8, "rule": GROUP}),
    Case("prompt-projects", lambda: _attention_inputs((1, 2, 3, 24, 32, 60, 64), d=48), {"k": 16, "rule": MAGNITUDE},
         projected=True),
    Case("prompt-shared-k", lambda: _attention_inputs((2, 3, 3, 20, 32, 40, 40)),
         {"k": 8, "rule": MAGNITUDE, "head_prices": _prices(3)},
         unlike=lambda ins: aqua_attention.reference(*[x.double() if x.is_floating_point() else x for x in ins], k=8),
         large=True),  # Triton: 25-45 s each in its interpreter; its shared k and tokens run at T <= 7 above
    Case("prompt-tokens", lambda: _attention_inputs((2, 2, 3, 40, 16, 90, 100)), {"k": 8, "rule": GROUP, **_tokens(ratio=0.2)},
         unlike=lambda ins: aqua_attention.reference(*[x.double() if x.is_floating_point() else x for x in ins], k=8,
                                                     rule=GROUP), large=True),
    Case("prompt-float16", lambda: _attention_inputs((2, 2, 3, 24, 32, 50, 64), torch.float16), {"k": 16},
         dtype="float16"),
    Case("prompt-cache-float16", lambda: _attention_inputs((2, 2, 3, 24, 32, 50, 64), cache=torch.float16),
         {"k": 16, "rule": GROUP}, cache_dtype="float16", only=("function", "native")),
    Case("prompt-cache-int8", lambda: _attention_inputs((2, 2, 3, 24, 32, 50, 64), cache=torch.int8),
         {"k": 16, "rule": GROUP, "cache_scales": 1}, cache_dtype="int8", only=("function", "native")),
    Case("prompt-cache-int8-projects", lambda: _attention_inputs((1, 2, 3, 40, 32, 90, 100), d=48, cache=torch.int8),
         {"k": 16, "rule": MAGNITUDE, "cache_scales": 1}, projected=True, cache_dtype="int8",
         only=("function", "native")),
    Case("prompt-softcap", lambda: _attention_inputs((2, 2, 3, 30, 16, 50, 64), scale=4.0),
         {"k": 8, "rule": GROUP, "softcap": 5.0}),
    Case("prompt-rising-scores", lambda: _rising(_attention_inputs((2, 2, 3, 300, 32, 700, 700), scale=0.3)),
         {"k": 32, "rule": GROUP}, only=("function", "native")),
    *PREFILL,
    *BF16,
    Case("prompt-bf16-2", lambda: _attention_inputs((1, 2, 3, 20, 16, 20, 20)), {"k": 8, "prompt_bf16": 2},
         only=("native",), error="prompt_bf16"),
    Case("prefill-threshold-past-1", lambda: _prefill_inputs((1, 2, 3, 400, 16, 400, 400)),
         {"k": 8, **_prefill(1.5)}, only=("native",), error="prefill_threshold"),
    Case("prefill-stride-0", lambda: _prefill_inputs((1, 2, 3, 400, 16, 400, 400)),
         {"k": 8, **_prefill(0.9, stride=0)}, only=("native",), error="prefill_stride"),
    # the capability table's triton column, asked by the host: an int8 cache is the CPU kernels'
    Case("int8-cache-on-triton", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20), cache=torch.int8),
         {"k": 8, "cache_scales": 1}, cache_dtype="int8", only=("triton",), error="the Triton kernels read the GPU's"),
    Case("k-past-r", lambda: _attention_inputs((1, 2, 3, 1, 16, 20, 20)), {"k": 17}, only=("native", "triton"),
         error="k must be in"),
    Case("keys-narrower-than-queries", lambda: [x[:, :, :8] if i == 1 else x for i, x in
                                                enumerate(_attention_inputs((1, 2, 3, 1, 16, 20, 20)))],
         {"k": 8}, only=("native", "triton"), error="disagree"),
    *[Case(f"projection-{bad}", lambda bad=bad: _attention_inputs((1, 2, 3, 1, 16, 20, 20))
           + [random_projection(*bad)], {"k": 8}, projected=True, only=("native", "triton"), error="projection must be")
      for bad in ((3, 16, 16), (2, 24, 16), (2, 16, 8))],  # Hkv, d, r wrong
]


# --------------------------------------------------------------------------------------------
# H2OAttention
# --------------------------------------------------------------------------------------------

def _live(expected):
    def check(outs, ins):  # the share of real tokens kept per head: 12 of 24, 11 of 21, 11 of 22
        assert (outs[4] >= 0).sum(-1).tolist() == expected
    return check


def _slots(n):
    def check(outs, ins):
        assert outs[1].shape[2] == n
    return check


def _h2o_projected(d, dtype=torch.float32):
    ins = h2o_inputs(2, 2, 3, 24, 16, H2O_MASKS["padded"], dtype=dtype)
    ins[0] = torch.randn(2, 2, 3, 24, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    return ins + [random_projection(2, d, 16).to(dtype)]


def _h2o_unprojected(attrs):
    def unlike(ins):
        return h2o_attention.reference(*[ins[0][..., :16]] + ins[1:8], **attrs)[0]
    return unlike


def _too_full_state():
    """9 tokens seen, budget 5, but 7 live slots: not a state this op could have left."""
    token = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, -1], [0, 1, 2, -1, -1, -1, -1, -1]]])
    past = (torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8), token)
    return h2o_inputs(1, 2, 3, 1, 16, np.ones((1, 10), np.int64), past=past)


H2O = [
    *[Case(f"{mask}-k{k}-rule{rule}", lambda mask=mask: h2o_inputs(H2O_MASKS[mask].shape[0], 2, 3,
                                                                    H2O_MASKS[mask].shape[1], 16, H2O_MASKS[mask]),
           {"k": k, "rule": rule, "ratio": 0.5}, check=_live([[12, 12]] if mask == "full" else [[11, 11], [11, 11]]),
           large=(rule, k) != (1, 8))  # Triton's interpreter runs one point of the grid per mask (about 10 s each)
      for rule, k in [*((rule, 8) for rule in RULES), (MAGNITUDE, 16), (MAGNITUDE, 1)] for mask in sorted(H2O_MASKS)],
    # Triton's interpreter (10-15 s a case) runs the wider of the value widths, float16 projected only and the
    # projection at d 16 with rule 0 and at d 24 with rule 1: each path once
    *[Case(f"values-{rv}-wide", lambda rv=rv: h2o_inputs(2, 2, 3, 24, 16, H2O_MASKS["padded"], rv=rv),
           {"k": 8, "rule": GROUP, "ratio": 0.5}, large=rv == 8) for rv in (8, 24)],
    Case("softcap-ratio-0.3", lambda: h2o_inputs(2, 2, 2, 24, 16, H2O_MASKS["padded"]),
         {"k": 6, "softcap": 2.0, "ratio": 0.3}),
    Case("float16", lambda: h2o_inputs(2, 2, 2, 24, 16, H2O_MASKS["padded"], dtype=torch.float16),
         {"k": 6, "ratio": 0.5}, dtype="float16", large=True),
    # r = 64, g = 4: Triton takes 32 slots per block, so a 41-slot cache spans two blocks of every pass
    Case("several-blocks", lambda: h2o_inputs(1, 1, 4, 80, 64, torch.ones(1, 80, dtype=torch.int64)),
         {"k": 48, "rule": GROUP, "ratio": 0.5}, check=_slots(41)),
    *[Case(f"projects-d{d}-rule{rule}", lambda d=d: _h2o_projected(d), {"k": 6, "rule": rule, "ratio": 0.5},
           projected=True, unlike=_h2o_unprojected({"k": 6, "rule": rule, "ratio": 0.5}),
           large=(rule, d) == (1, 16))
      for rule, d in ((0, 16), (1, 16), (1, 24))],
    Case("projects-float16", lambda: _h2o_projected(24, torch.float16), {"k": 6, "rule": GROUP, "ratio": 0.5},
         dtype="float16", projected=True),
    Case("projection-wrong-shape", lambda: _h2o_projected(16)[:8] + [random_projection(3, 16, 16)],
         {"k": 6, "ratio": 0.5}, projected=True, only=("native", "triton"), error="projection must be"),
    Case("state-not-its-own", _too_full_state, {"k": 8, "ratio": 0.5}, only=("native", "triton"),
         error="not this graph's state"),
    Case("keys-narrower-than-queries", lambda: [x if i != 1 else torch.zeros(1, 2, 1, 8) for i, x in
                                                enumerate(h2o_inputs(1, 2, 3, 1, 16, np.ones((1, 10), np.int64)))],
         {"k": 8, "ratio": 0.5}, only=("native", "triton"), error="disagree"),
    Case("ratio-past-1", lambda: h2o_inputs(1, 2, 3, 1, 16, np.ones((1, 1), np.int64)), {"k": 8, "ratio": 1.5},
         only=("native", "triton"), error="ratio in"),
]


# --------------------------------------------------------------------------------------------
# The cache updates and ValueProduct
# --------------------------------------------------------------------------------------------

def _update_inputs(past_slots, total, new=2, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.standard_normal((2, 3, past_slots, 5), dtype=np.float32)),
            torch.from_numpy(rng.standard_normal((2, 3, new, 5), dtype=np.float32)), _length(total)]


# (slots past C >= L, as a shared buffer, are written in place: test_ops.py binds one buffer as past and present)
UPDATES = [Case("growing", lambda: _update_inputs(4, 6), {}),  # a past of L - S slots: present grows to L
           Case("filled-to-the-end", lambda: _update_inputs(6, 6), {}),  # C = L: slots L-S..L-1 overwritten
           Case("empty-past", lambda: _update_inputs(0, 3, new=3), {}),
           # the caches a float32 graph may keep in another type (contract cache_dtype): bytes like any other
           Case("float16-cache", lambda: [x.half() if x.is_floating_point() else x for x in _update_inputs(4, 6)], {},
                cache_dtype="float16", only=("function", "native")),
           Case("int8-cache", lambda: [rules.int8_rows(x) if x.is_floating_point() else x
                                       for x in _update_inputs(4, 6)], {}, cache_dtype="int8",
                only=("function", "native"))]


def _probs(shape, dtype="float32", seed=3):
    b, h, g, t, length, cap, r = shape
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.random((b, h, g, t, length)).astype(dtype)),
            torch.from_numpy(rng.standard_normal((b, h, cap, r)).astype(dtype))]


# (B, Hkv, g, T, L, C, r): r not a multiple of the 32-column tile; decode (T = 1) and prefill rows
PRODUCT_SHAPES = [(1, 3, 3, 1, 1024, 1100, 64), (2, 2, 2, 5, 37, 40, 48), (1, 1, 1, 7, 5, 5, 20)]
PRODUCTS = [Case(f"{'x'.join(map(str, s))}-{dt}", lambda s=s, dt=dt: _probs(s, dt), {}, dtype=dt)
            for s in PRODUCT_SHAPES for dt in ("float32", "float16")]


# --------------------------------------------------------------------------------------------
# LogitRows
# --------------------------------------------------------------------------------------------

def _rows_inputs(b, t, v, every: bool, dtype=torch.float32):
    """rows [B, K, V] at each sequence's last position (a decode's, a prompt's) or at every one (K = T)."""
    gen = torch.Generator().manual_seed(4)
    k = t if every else 1
    index = torch.arange(t).expand(b, t).clone() if every else torch.tensor([[t - 1 - i % t] for i in range(b)])
    return [torch.randn(b, k, v, generator=gen).to(dtype), index, _length(t)]


def _rows_only(outs, ins):
    """The written rows equal the input's (the others are unspecified: the native kernel leaves them untouched)."""
    rows, index = ins[0], ins[1]
    got = outs[0].gather(1, index[..., None].expand(rows.shape))
    assert torch.equal(got, rows)


LOGIT_ROWS = [Case(f"{b}x{t}x{v}-{'all' if every else 'last'}-{dt}", lambda b=b, t=t, v=v, every=every, dt=dt:
                   _rows_inputs(b, t, v, every, getattr(torch, dt)), {}, dtype=dt, versus_reference=every,
                   check=_rows_only)
              for b, t, v in ((2, 7, 50), (3, 1, 33), (1, 300, 1024)) for every in (False, True)
              for dt in ("float32", "float16")] + [
    Case("index-past-t", lambda: [torch.ones(1, 1, 8), torch.tensor([[5]]), _length(4)], {}, only=("native",),
         error="not a position")]


# --------------------------------------------------------------------------------------------
# QuantizeRows
# --------------------------------------------------------------------------------------------

def _rows_to_quantize(kind: str) -> list:
    """x [B, Hkv, S, w] float32 rows an int8 cache stores: K^ columns / V rows of a decode step and a prompt, and the
    edges every implementation must write alike: zeros, table scales times 127 and their neighbours, rows below and
    above the table's scales, ties at half a step, magnitudes over 2^+-30."""
    gen = torch.Generator().manual_seed(5)
    if kind == "decode":
        return [torch.randn(2, 3, 1, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[None, :, None, None]]
    if kind == "prompt":
        return [torch.randn(1, 3, 40, 48, generator=gen) * torch.linspace(3, 0.3, 48)]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 40, 16)) * np.exp2(rng.integers(-30, 30, (6, 40, 1)))).astype(np.float32)
    x[0, :6] = 0.0
    x[0, 1, 0], x[0, 2, 0] = 127.0, np.nextafter(np.float32(127.0), np.float32(200.0))  # scale 1 exactly, then past it
    x[0, 3] = 1e-41  # below 2^-32 * 127: the lowest code
    x[0, 4, :2] = [3e38, -3e38]  # past 2^31.75 * 127: the top code, the values saturate
    x[0, 5, :3] = [127.0, 0.5, 1.5]  # scale 1: the halves round to even
    x[1, 0] = int8_scales()[140] * 127 * np.linspace(-1, 1, 16, dtype=np.float32)  # max / 127 is a table scale
    return [torch.from_numpy(x)[None]]


def _edge_codes(outs, ins):
    """The edges land where ops.spec says: zeros and the smallest rows on the lowest code, 127 on scale 1 and one ulp
    more on the next, the largest saturated on the top code, halves to even."""
    rows = outs[0][0].numpy()
    assert rows[0, 0, -1] == -128 and rows[0, 1, -1] == 0 and rows[0, 2, -1] == 1 and rows[0, 3, -1] == -128
    assert list(rows[0, 4, :3]) == [127, -127, 0] and rows[0, 4, -1] == 127 and list(rows[0, 5, :3]) == [127, 0, 2]


QUANTIZE_ROWS = [Case(kind, lambda kind=kind: _rows_to_quantize(kind), {}, check=_edge_codes if kind == "edges" else None)
                 for kind in ("decode", "prompt", "edges")]


# --------------------------------------------------------------------------------------------
# MatMulQ4A8
# --------------------------------------------------------------------------------------------

def _q4a8_inputs(lead: tuple, k: int, n: int, block: int, seed: int = 0, edges: bool = False) -> list:
    """a [*lead, K] (rows of different magnitudes), MatMulNBits' int4 blocks b [N, K / block, block / 2] and scales
    [N, K / block]; edges: a block of zeros (scale 0), a block whose values sit on halves of its step (ties to
    even), one of magnitude 2^20 and one of 2^-20."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead, k, generator=gen) * torch.exp2(torch.randint(-3, 4, (*lead, 1), generator=gen).float())
    if edges:
        flat = a.reshape(-1, k)
        flat[0, :block] = 0.0
        flat[0, block:2 * block] = (torch.arange(block) % 5 - 2) * 0.5 + 0.25  # max 1.25: steps of 1.25 / 127
        flat[0, block] = 1.25 * 63.5 / 127  # exactly half a step above 63: rounds to 64 (even)
        flat[-1, :block] *= 2.0 ** 20
        flat[-1, block:2 * block] *= 2.0 ** -20
    b = torch.randint(0, 256, (n, k // block, block // 2), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, k // block, generator=gen) * 0.02
    return [a, b, scales]


Q4A8 = [Case(f"{'x'.join(map(str, lead))}-k{k}-n{n}-b{block}", lambda lead=lead, k=k, n=n, block=block:
             _q4a8_inputs(lead, k, n, block, edges=block == 32), {"K": k, "N": n, "block_size": block})
        for lead, k, n, block in (((1, 1), 64, 32, 32),  # a decode row
                                  ((1, 70), 576, 96, 32),  # a prompt: 4-row tiles and 2 left over
                                  ((2, 37), 128, 40, 16),  # N past a 32-column pair: padding columns
                                  ((1, 9), 256, 64, 64), ((1, 5), 256, 48, 128), ((1, 3), 64, 17, 8))] + [
    Case("a-not-k-wide", lambda: _q4a8_inputs((1, 3), 64, 32, 32)[:0] + [torch.ones(1, 3, 48)] +
         _q4a8_inputs((1, 3), 64, 32, 32)[1:], {"K": 64, "N": 32, "block_size": 32}, only=("native",),
         error="expected a"),
    Case("block-not-dividing-k", lambda: _q4a8_inputs((1, 2), 64, 32, 32), {"K": 64, "N": 32, "block_size": 24},
         only=("native",), error="block_size a multiple of 8")]

# MatMulQ4A8Gated: N = 2 I stacked [gate; up] rows; I a whole pair of panels, a prompt's, I past a panel (padding),
# I below one panel
Q4A8_GATED = [Case(f"{'x'.join(map(str, lead))}-k{k}-n{n}-b{block}", lambda lead=lead, k=k, n=n, block=block:
                   _q4a8_inputs(lead, k, n, block, edges=block == 32), {"K": k, "N": n, "block_size": block})
              for lead, k, n, block in (((1, 1), 64, 64, 32), ((1, 70), 576, 96, 32), ((2, 37), 128, 40, 16),
                                        ((1, 3), 64, 34, 8))] + [
    Case("n-odd", lambda: _q4a8_inputs((1, 2), 64, 33, 32), {"K": 64, "N": 33, "block_size": 32}, only=("native",),
         error="N must be even")]


FLOAT32 = {"float32": {"*": (1e-5, True)}}
CATALOGUE = [
    OpCases(topk_gather_dot.OP, SCORES, {**FLOAT32, "float16": {"scores": (2e-3, True)}}),
    OpCases(aqua_attention.OP, ATTENTION, {"float32": {"out": (2e-5, False)}, "float16": {"out": (4e-3, False)}}),
    OpCases(cache_update.KEY, UPDATES, {"float32": {"present": (0.0, False)}}),
    OpCases(cache_update.VALUE, UPDATES, {"float32": {"present": (0.0, False)}}),
    OpCases(value_product.OP, PRODUCTS, {**FLOAT32, "float16": {"out": (2e-3, True)}}),
    # heavy: a float32 sum over the tokens seen, its rounding grows with it
    OpCases(h2o_attention.OP, H2O, {"float32": {"present_heavy": (1e-5, True), "*": (1e-5, False)},
                                    "float16": {"out": (2e-2, False)}}, int_outputs=("present_token",)),
    OpCases(logit_rows.OP, LOGIT_ROWS, {"float32": {"logits": (0.0, False)}, "float16": {"logits": (0.0, False)}}),
    OpCases(quantize_rows.OP, QUANTIZE_ROWS, {"float32": {"rows": (0.0, False)}}, int_outputs=("rows",)),  # the bytes
    # the activations' int8 values are the same everywhere (rules.int8_groups): float32 sums of a few hundred terms
    OpCases(matmul_q4a8.OP, Q4A8, {"float32": {"y": (1e-5, True)}}),
    # the product's rounding through silu's e^x (exp_lanes: 2 ulp; ORT's Sigmoid): 1e-7 to 7e-7 measured
    OpCases(matmul_q4a8.GATED, Q4A8_GATED, {"float32": {"y": (1e-5, True)}}),
]


# --------------------------------------------------------------------------------------------
# Golden tables: the tie-breaks and the budget's edge ratios, which every implementation reproduces
# --------------------------------------------------------------------------------------------

# (query rows [g, r] of one KV head and token, k, rule) -> the coordinates each row keeps
SELECTION_GOLDEN = [
    ([[1.5, 1.5, 1.5, 1.5, 0.2, -0.1, 0.0, 0.3]], 2, 0, [[0, 1]]),  # a four-way tie: the lower indices
    ([[0.25] * 8], 3, 0, [[0, 1, 2]]),  # all tied
    ([[0.1, -2.0, 0.3, 2.0, -0.3, 0.0, 1.0, -1.0]], 3, 0, [[1, 3, 6]]),  # magnitudes, signs ignored; -2 and 2 tie
    ([[1.0, 0.0, 0.0, 2.0], [0.0, 3.0, 0.0, -2.0]], 2, 1, [[1, 3], [1, 3]]),  # the group's sums 1, 3, 0, 4
    ([[1.0, 2.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0]], 1, 1, [[0], [0]]),  # group sums tie: the lower index
    ([[0.0, 0.0, 5.0, 9.0]], 2, 2, [[0, 1]]),  # static: the first k whatever the magnitudes
]

# (ratio, real tokens seen, tokens kept): the float32 attribute (0.3 -> 0.30000001) keeps what the double keeps
BUDGET_GOLDEN = [(0.5, 1, 1), (0.5, 2, 1), (0.5, 3, 2), (0.5, 7, 4), (0.5, 24, 12), (0.3, 10, 3), (0.3, 11, 4),
                 (0.1, 5, 1), (0.7, 10, 7), (0.9, 30, 27), (1.0, 13, 13), (0.25, 40, 10)]
