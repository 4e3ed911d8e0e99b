"""What the Triton kernels share: the interpreter switch, binding a kernel to a mode (``jit``), block-size helpers,
a group's q^ rows (``query_rows``) and the selection rule as one jit helper, ``keep_of`` (ops.rules is its definition; plugins/ort/aqua_ops.h is the
C++ twin).

The selection is computed as a rank rather than a sort, so it is exact and branch-free: coordinate c is kept iff
fewer than k coordinates beat it, where j beats c when score_j > score_c, or they are equal and j < c (ties go to
the lower index). Scores: |q^| (MAGNITUDE), the group's summed |q^| (GROUP), r - c (STATIC); padding lanes -1.

triton is imported only when a kernel is built (``triton_for``). Without a GPU, ``interpret=True`` runs the same
kernels in Triton's interpreter on the CPU (how the tests check them on machines without a GPU).
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager

from ...ops.spec import GROUP, STATIC

_JITTED: dict = {}  # (function, interpret) -> (jitted, triton)
tl = None  # keep_of's free name, bound per mode by jit (triton is imported only there)


@contextmanager
def triton_for(interpret: bool):
    """Yields (triton, triton.language) with Triton's interpreter on or off for the kernels decorated inside:
    triton.jit decides at decoration time whether a kernel is interpreted, and language functions follow the
    setting at first import, so the interpreter is selected before anything imports triton."""
    previous = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        try:
            import triton
            import triton.language as tl
        except ImportError as e:
            raise RuntimeError("the GPU kernel needs triton: pip install triton") from e
        yield triton, tl
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def keep_of(qg, c, in_r, R: tl.constexpr, K: tl.constexpr, RULE: tl.constexpr):
    """(jit helper) qg [G, BLOCK_R] float32 query rows (one row, or a GQA group's), c = arange(BLOCK_R), in_r = c < R
    -> keep [G, BLOCK_R]: the coordinates each row keeps (the group rule gives every row the same set)."""
    if RULE == GROUP:
        a = tl.zeros_like(qg) + tl.sum(tl.abs(qg), axis=0)[None, :]
    elif RULE == STATIC:
        a = tl.zeros_like(qg) + (R - c).to(tl.float32)[None, :]
    else:
        a = tl.abs(qg)
    a = tl.where(in_r[None, :], a, -1.0)
    beats = (a[:, None, :] > a[:, :, None]) | ((a[:, None, :] == a[:, :, None]) & (c[None, None, :] < c[None, :, None]))
    return (tl.sum(beats.to(tl.int32), axis=2) < K) & in_r[None, :]


def query_rows(q_row, p_ptr, in_g, c, in_r, D: tl.constexpr, R: tl.constexpr, PROJECT: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """(jit helper) q_row [G] pointers to a token's g query rows, p_ptr its KV head's P [D, R] -> q^ [G, BLOCK_R]
    float32: q P in chunks of CHUNK_D rows of P (PROJECT), else the rows themselves (D = R)."""
    if PROJECT:
        qg = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
        for e0 in tl.static_range(0, BLOCK_D, CHUNK_D):
            e = e0 + tl.arange(0, CHUNK_D)
            in_d = e < D
            qd = tl.load(q_row[:, None] + e[None, :], mask=in_g[:, None] & in_d[None, :], other=0.0)
            pd = tl.load(p_ptr + e[:, None] * R + c[None, :], mask=in_d[:, None] & in_r[None, :], other=0.0)
            qg += tl.sum(qd.to(tl.float32)[:, :, None] * pd.to(tl.float32)[None, :, :], axis=1)
    else:
        qg = tl.load(q_row[:, None] + c[None, :], mask=in_g[:, None] & in_r[None, :], other=0.0).to(tl.float32)
    return qg


HELPERS = (keep_of, query_rows)  # the jit helpers every kernel's scope binds


def jit(raw, interpret: bool):
    """raw: a kernel (or a helper) written as a plain module-level function whose free names are tl, GROUP, STATIC
    and the HELPERS -> (it as a @triton.jit function of the mode, triton). Triton's interpreter re-executes a
    kernel's source in the function's globals (closures are lost), so each mode's names live in a scope of its own:
    one process can interpret the kernels and compile them ahead of time (the TensorRT plugin) side by side."""
    if (raw, interpret) in _JITTED:
        return _JITTED[raw, interpret]
    helpers = {} if raw in HELPERS else {h.__name__: jit(h, interpret)[0] for h in HELPERS}
    with triton_for(interpret) as (triton, tl):
        scope = {**raw.__globals__, "tl": tl, "GROUP": tl.constexpr(GROUP), "STATIC": tl.constexpr(STATIC),
                 **helpers}
        fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__)
        # a new function object starts without annotations: copied, or Triton's compiler sees no tl.constexpr
        # parameter (the interpreter does not care, so only a real GPU would show it)
        fn.__annotations__, fn.__doc__, fn.__module__ = dict(raw.__annotations__), raw.__doc__, raw.__module__
        _JITTED[raw, interpret] = triton.jit(fn), triton
    return _JITTED[raw, interpret]


def next_pow2(n: int) -> int:
    """n rounded up to a power of two (Triton's block shapes)."""
    return 1 << max(0, (n - 1).bit_length())


def group_block(g: int) -> int:
    """BLOCK_G: the group's g query rows padded to a power of two (the group rule loads them together)."""
    return next_pow2(g)
