"""What the Triton kernels share: the interpreter switch, binding a kernel to a mode (``jit``), block-size helpers,
and the selection rule as one jit helper, ``keep_of`` (ops.rules is its definition; plugins/ort/aqua_ops.h is the
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


def jit(raw, interpret: bool):
    """raw: a kernel (or keep_of) written as a plain module-level function whose free names are tl, GROUP, STATIC
    and keep_of -> (it as a @triton.jit function of the mode, triton). Triton's interpreter re-executes a kernel's
    source in the function's globals (closures are lost), so each mode's names live in a scope of its own: one
    process can interpret the kernels and compile them ahead of time (the TensorRT plugin) side by side."""
    if (raw, interpret) in _JITTED:
        return _JITTED[raw, interpret]
    helper = None if raw is keep_of else jit(keep_of, interpret)[0]
    with triton_for(interpret) as (triton, tl):
        scope = {**raw.__globals__, "tl": tl, "GROUP": tl.constexpr(GROUP), "STATIC": tl.constexpr(STATIC),
                 "keep_of": helper}
        _JITTED[raw, interpret] = triton.jit(types.FunctionType(raw.__code__, scope, raw.__name__)), triton
    return _JITTED[raw, interpret]


def next_pow2(n: int) -> int:
    """n rounded up to a power of two (Triton's block shapes)."""
    return 1 << max(0, (n - 1).bit_length())


def group_block(g: int) -> int:
    """BLOCK_G: the group's g query rows padded to a power of two (the group rule loads them together)."""
    return next_pow2(g)
