"""What the Triton kernels share: the interpreter switch, binding a kernel to a mode (``jit``), block-size helpers,
a group's q^ rows (``query_rows``), the selection rule as one jit helper, ``keep_of`` (ops.rules is its definition;
plugins/ort/aqua_ops.h is the C++ twin), and the selection computed once per (sequence, KV head, token) by
``select_kernel``, compacted to the group's union of coordinates, with the jit helpers that read it back
(``selected_rows``), load K^ tiles of those rows (``key_tile``) and score them (``scores_of``).

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

import torch

from ...ops.spec import GROUP, MAGNITUDE, STATIC

_JITTED: dict = {}  # (function, interpret) -> (jitted, triton)
# None, or a list that every interpreted kernel launch is appended to as (kernel, args, kwargs): the constexpr
# combinations the hosts launch, which tests/test_triton_compile.py compiles for GPU targets. DRY: the launches are
# only recorded, their outputs left unwritten (what the hosts return then is not an answer; a host that reads a
# kernel's output to launch the next, H2O's, needs them run)
LAUNCHES: list | None = None
DRY = False


class _Recorded:
    """An interpreted kernel whose launches LAUNCHES records (when it is a list)."""

    def __init__(self, raw, kernel):
        self.raw, self.kernel = raw, kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            if LAUNCHES is not None:
                LAUNCHES.append((self.raw, args, kwargs))
                if DRY:
                    return None
            return launch(*args, **kwargs)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


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


def ordered_key(x):
    """(jit helper) float32 x -> int64 keys in the floats' order (-0.0 as +0.0, which compare equal)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


def kth_key(key, cand, need):
    """(jit helper) key [N] (ordered_key), cand [N] the entries that compete -> the need-th largest key among
    them, found by a 4-way search on the keys: count(key >= lo) >= need > count(key > hi) throughout, and each
    step counts three thresholds in one reduction (21-bit fields of an int64), so the range shrinks 4x a step: 16
    steps cover 2^32 keys (need 0: it climbs past every key)."""
    lo = tl.min(tl.where(cand, key, 2147483647), axis=0)
    hi = tl.max(tl.where(cand, key, -2147483648), axis=0)
    for _ in range(16):
        t1 = lo + (hi - lo + 1) // 4
        t2 = lo + (hi - lo + 1) // 2
        t3 = lo + (hi - lo + 1) * 3 // 4
        packed = tl.where(cand, (key >= t1).to(tl.int64) + ((key >= t2).to(tl.int64) << 21)
                          + ((key >= t3).to(tl.int64) << 42), 0)
        counts = tl.sum(packed, axis=0)
        ok1 = (counts & 0x1FFFFF) >= need
        ok2 = ((counts >> 21) & 0x1FFFFF) >= need
        ok3 = (counts >> 42) >= need
        new_lo = tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, lo)))
        hi = tl.where(ok3, hi, tl.where(ok2, t3 - 1, tl.where(ok1, t2 - 1, t1 - 1)))
        lo = new_lo
    return lo


def keep_of(qg, c, in_r, R: tl.constexpr, K: tl.constexpr, RULE: tl.constexpr):
    """(jit helper) qg [G, BLOCK_R] float32 query rows (one row, or a GQA group's), c = arange(BLOCK_R), in_r = c < R
    -> keep [G, BLOCK_R]: the coordinates each row keeps (the group rule gives every row the same set, ranked
    once; K >= R keeps every coordinate without a rank)."""
    if K >= R:
        return tl.broadcast_to(in_r[None, :], qg.shape)
    if RULE == MAGNITUDE:
        a = tl.where(in_r[None, :], tl.abs(qg), -1.0)
        beats = (a[:, None, :] > a[:, :, None]) | ((a[:, None, :] == a[:, :, None]) & (c[None, None, :] < c[None, :, None]))
        return (tl.sum(beats.to(tl.int32), axis=2) < K) & in_r[None, :]
    if RULE == GROUP:
        a1 = tl.sum(tl.abs(qg), axis=0)
    else:
        a1 = (R - c).to(tl.float32)
    a1 = tl.where(in_r, a1, -1.0)
    beats1 = (a1[None, :] > a1[:, None]) | ((a1[None, :] == a1[:, None]) & (c[None, :] < c[:, None]))
    return tl.broadcast_to(((tl.sum(beats1.to(tl.int32), axis=1) < K) & in_r)[None, :], qg.shape)


def priced_rows(qg, j, c, h, price, G: tl.constexpr, R: tl.constexpr, RULE: tl.constexpr):
    """(jit helper) KV head h's query rows qg [BLOCK_G, BLOCK_R] (padding zero), j / c their row and coordinate
    numbers, price its price -> (score * price [BLOCK_G, BLOCK_R] float32, each entry's flat index in the layer's
    pooled order (kv head, row, coordinate)): |q^| per row, or under GROUP the group's summed |q^| on every row
    (one set per group: row 0's index). ops.rules' pooled selection."""
    if RULE == GROUP:
        a = tl.sum(tl.abs(qg), axis=0) * price
        return tl.broadcast_to(a[None, :], qg.shape), tl.broadcast_to((h * R + c)[None, :], qg.shape)
    return tl.abs(qg) * price, (h * G + j[:, None]) * R + c[None, :]


def pooled_keep(qg, j, c, in_g, in_r, h, price, cut_v, cut_i, G: tl.constexpr, R: tl.constexpr,
                RULE: tl.constexpr):
    """(jit helper) -> keep [BLOCK_G, BLOCK_R]: what the token's pooled cut (cut_v, cut_i: the layer's K-th
    priced score and its flat index, pool.py) keeps of KV head h's rows: a priced score above the cut, or equal
    to it at a flat index no later (ties to the lower flat index)."""
    s, flat = priced_rows(qg, j, c, h, price, G, R, RULE)
    return ((s > cut_v) | ((s == cut_v) & (flat <= cut_i))) & in_g[:, None] & in_r[None, :]


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


def select_kernel(q_ptr, p_ptr, qs_ptr, idx_ptr, qf_ptr, idxf_ptr, price_ptr, cutv_ptr, cuti_ptr, T, D: tl.constexpr,
                  R: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RULE: tl.constexpr, PROJECT: tl.constexpr,
                  HKV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_U: tl.constexpr, FULL: tl.constexpr,
                  POOLED: tl.constexpr):
    """The selection, once per (sequence, KV head, token), compacted to the union of the group's selected
    coordinates: idx [rows, BLOCK_U] int32, the union's coordinates ascending, -1 past its last; qs [rows,
    BLOCK_M, BLOCK_U] float32, q^ at those coordinates with each row's unselected ones zeroed, rows past g and
    places past the union zero (the tensor cores' M of 16). The kernels that read K^ then load a dense
    [BLOCK_U, block] tile: only the rows they need, no masked-off lanes. FULL: also the selection of every
    coordinate (qf [rows, BLOCK_M, BLOCK_R], idxf [rows, BLOCK_R]; token selection attends with all r, sparse
    prefill's estimate ranks them) from the same q^, so a step or a prompt projects once. POOLED: the rows keep what their token's pooled cut keeps (cutv, cuti
    [B * T], pool.py; price [Hkv]) instead of K each."""
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    tt = row % T
    bh = row // T
    j = tl.arange(0, BLOCK_G)
    in_g = j < G
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    q_row = q_ptr + ((bh * G + j) * T + tt) * D  # [BLOCK_G] pointers to the g rows of this token
    qg = query_rows(q_row, p_ptr + (bh % HKV) * D * R, in_g, c, in_r, D, R, PROJECT, BLOCK_G, BLOCK_D, CHUNK_D, BLOCK_R)
    if POOLED:
        at = (bh // HKV) * T + tt
        keep = pooled_keep(qg, j, c, in_g, in_r, bh % HKV, tl.load(price_ptr + bh % HKV), tl.load(cutv_ptr + at),
                           tl.load(cuti_ptr + at), G, R, RULE)
    else:  # coordinate i kept iff fewer than K coordinates beat it (ties: the lower index)
        keep = keep_of(qg, c, in_r, R, K, RULE) & in_g[:, None]
    union = tl.max(keep.to(tl.int32), axis=0)  # [BLOCK_R] 0/1
    place = tl.cumsum(union, axis=0) - 1  # each union coordinate's place, ascending
    n = tl.sum(union, axis=0)
    u = tl.arange(0, BLOCK_U)
    m_id = tl.arange(0, BLOCK_M)
    out = qs_ptr + row * BLOCK_M * BLOCK_U
    # three disjoint parts of qs, so no store overlaps another: the union's places of the g rows, the padding
    # rows, the places past the union
    tl.store(out + j[:, None] * BLOCK_U + place[None, :], tl.where(keep, qg, 0.0),
             mask=in_g[:, None] & (union > 0)[None, :])
    tl.store(out + m_id[:, None] * BLOCK_U + u[None, :], tl.zeros([BLOCK_M, BLOCK_U], tl.float32),
             mask=(m_id >= G)[:, None] | (u >= n)[None, :])
    tl.store(idx_ptr + row * BLOCK_U + place, c, mask=union > 0)
    tl.store(idx_ptr + row * BLOCK_U + u, tl.full([BLOCK_U], -1, tl.int32), mask=u >= n)
    if FULL:
        full = qf_ptr + row * BLOCK_M * BLOCK_R
        tl.store(full + m_id[:, None] * BLOCK_R + c[None, :], tl.zeros([BLOCK_M, BLOCK_R], tl.float32),
                 mask=(m_id >= G)[:, None] | (c >= R)[None, :])
        tl.store(full + j[:, None] * BLOCK_R + c[None, :], qg, mask=in_g[:, None] & in_r[None, :])
        tl.store(idxf_ptr + row * BLOCK_R + c, tl.where(in_r, c, -1))


def selected_rows(qs_ptr, idx_ptr, key_ptr, row, bh, R: tl.constexpr, C, BLOCK_U: tl.constexpr,
                  BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    """(jit helper) -> (qs [BLOCK_M, BLOCK_U] in the products' dtype, [BLOCK_U] pointers to the rows of K^ the
    union selects (row 0 where unused), [BLOCK_U] in use) for select_kernel's row ``row`` and sequence-head bh."""
    u = tl.arange(0, BLOCK_U)
    qs = tl.load(qs_ptr + (row * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]) * BLOCK_U + u[None, :])
    if not IEEE:
        qs = qs.to(key_ptr.dtype.element_ty)
    idx = tl.load(idx_ptr + row * BLOCK_U + u)
    use = idx >= 0
    return qs, key_ptr + bh.to(tl.int64) * R * C + tl.where(use, idx, 0).to(tl.int64) * C, use


def key_tile(krow, use, s0, pages_ptr, N_LIST, C, BLOCK_U: tl.constexpr, BLOCK_S: tl.constexpr,
             PAGED: tl.constexpr, PAGE: tl.constexpr):
    """(jit helper) -> (K^ [BLOCK_U, BLOCK_S] at the block's positions, the positions [BLOCK_S], in range
    [BLOCK_S]). Unpaged: positions s0 + arange, loaded under the capacity C only, so the loads stay 16-byte
    vectors (a mask that varies inside a vector would split them); positions past L hold whatever the cache has
    there and the caller discards their scores. Paged (pages_ptr: the first slots of the row's chosen pages, -1
    past the last): the block covers BLOCK_S / PAGE list places, each page's PAGE positions contiguous."""
    if PAGED:
        at = s0 // PAGE + tl.arange(0, BLOCK_S // PAGE)
        pg = tl.load(pages_ptr + at, mask=at < N_LIST, other=-1)
        s2 = pg[:, None] + tl.arange(0, PAGE)[None, :]  # [NPG, PAGE]
        ok2 = (pg >= 0)[:, None] & (s2 < C)
        kb = tl.load(krow[:, None, None] + s2[None, :, :], mask=use[:, None, None] & ok2[None, :, :], other=0.0)
        return tl.reshape(kb, [BLOCK_U, BLOCK_S]), tl.reshape(s2, [BLOCK_S]), tl.reshape(ok2, [BLOCK_S])
    s = tl.multiple_of(s0, BLOCK_S) + tl.arange(0, BLOCK_S)
    in_c = s < C
    kb = tl.load(krow[:, None] + s[None, :], mask=use[:, None] & in_c[None, :], other=0.0)
    return kb, s, in_c


def capped(sc, SOFTCAP: tl.constexpr):
    """(jit helper) softcap(sc) = SOFTCAP tanh(sc / SOFTCAP) when SOFTCAP > 0, written 1 - 2 / (exp(2x) + 1) so
    that it saturates correctly at both ends."""
    if SOFTCAP > 0.0:
        sc = (1.0 - 2.0 / (tl.exp(2.0 * sc / SOFTCAP) + 1.0)) * SOFTCAP
    return sc


def products(qs, kb, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """(jit helper) qs [BLOCK_M, BLOCK_U], kb [BLOCK_U, BLOCK_S] -> capped(qs . kb) [BLOCK_M, BLOCK_S] float32:
    float32 products ("ieee", not tf32) when IEEE (ieee says when), else the tensor cores on 16-bit operands."""
    if IEEE:
        sc = tl.dot(qs, kb.to(tl.float32), input_precision="ieee")
    else:
        sc = tl.dot(qs, kb)
    return capped(sc, SOFTCAP)


def scores_of(qs, kb, s, ok, arow, L, LO, HI, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """(jit helper) -> (softcap(q^[I] . K^[I, s]) [BLOCK_M, BLOCK_S], the visible positions [BLOCK_S]: in range,
    in [LO, HI] (the query's own position and its sliding window's start) and not padding in the attention_mask row
    ``arow`` (ops.rules.visible))."""
    inside = ok & (s < L) & (s >= LO) & (s <= HI)
    real = tl.load(arow + s, mask=inside, other=0)
    return products(qs, kb, SOFTCAP, IEEE), inside & (real != 0)


def online_step(m, acc, o, sc, vb, IEEE: tl.constexpr):
    """(jit helper) one block of an online softmax: running max m [BLOCK_M], sum acc [BLOCK_M] and value
    product o [BLOCK_M, BLOCK_V], the block's scores sc [BLOCK_M, BLOCK_S] (-inf where hidden) and values vb
    [BLOCK_S, BLOCK_V] (zero where hidden) -> the new (m, acc, o). Probabilities are rounded to the values'
    dtype for the tensor cores (as flash attention does) unless IEEE."""
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    base = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m - base)  # 0 while nothing was visible (m = -inf)
    e = tl.exp(sc - base[:, None])
    acc = acc * alpha + tl.sum(e, axis=1)
    if IEEE:
        o = o * alpha[:, None] + tl.dot(e, vb.to(tl.float32), input_precision="ieee")
    else:
        o = o * alpha[:, None] + tl.dot(e.to(vb.dtype), vb)
    return m_new, acc, o


def merge_parts(o_ptr, ml_ptr, first, SPLITS, j, top, den, num, G: tl.constexpr, RV: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """(jit helper) query row j's split results (o [parts, G, RV], (m, l) [parts, G, 2]; parts first ..
    first + SPLITS) folded, BLOCK_N at a time, into a running (top, den [], num [BLOCK_V]): the max, the sum of
    l e^(m - top) and of o e^(m - top); a split that saw nothing visible (l = 0) counts for nothing."""
    i = tl.arange(0, BLOCK_N)
    v = tl.arange(0, BLOCK_V)
    for n0 in range(0, SPLITS, BLOCK_N):
        part = first + n0 + i
        in_n = n0 + i < SPLITS
        li = tl.load(ml_ptr + (part * G + j) * 2 + 1, mask=in_n, other=0.0)
        mi = tl.load(ml_ptr + (part * G + j) * 2, mask=in_n, other=float("-inf"))
        mi = tl.where(li > 0.0, mi, float("-inf"))
        oi = tl.load(o_ptr + (part * G + j)[:, None] * RV + v[None, :], mask=in_n[:, None] & (v < RV)[None, :],
                     other=0.0)
        new = tl.maximum(top, tl.max(mi, axis=0))
        base = tl.where(new > float("-inf"), new, 0.0)
        a_old = tl.exp(top - base)
        a_new = tl.where(li > 0.0, tl.exp(mi - base), 0.0)
        den = den * a_old + tl.sum(li * a_new, axis=0)
        num = num * a_old + tl.sum(oi * a_new[:, None], axis=0)
        top = new
    return top, den, num


def least_heavy(h, t, s, ok, best_h, best_t, best_s):
    """(jit helper) H2O's eviction candidate of a block folded into the running one (best_h, best_t, best_s):
    among the entries ok, the smallest heavy h, ties to the later token t, then its slot s."""
    h_min = tl.min(tl.where(ok, h, float("inf")), axis=0)
    at_min = ok & (h == h_min)
    t_max = tl.max(tl.where(at_min, t, -1), axis=0)
    s_max = tl.max(tl.where(at_min & (t == t_max), s, -1), axis=0)
    better = (h_min < best_h) | ((h_min == best_h) & (t_max > best_t))
    return tl.where(better, h_min, best_h), tl.where(better, t_max, best_t), tl.where(better, s_max, best_s)


# the jit helpers every kernel's scope binds; a helper's scope binds those before it (it calls only them)
HELPERS = (ordered_key, kth_key, keep_of, priced_rows, pooled_keep, query_rows, selected_rows, key_tile, capped,
           products, scores_of, online_step, merge_parts, least_heavy)


def jit(raw, interpret: bool):
    """raw: a kernel (or a helper) written as a plain module-level function whose free names are tl, the rule
    codes (MAGNITUDE, GROUP, STATIC) and the HELPERS (for a helper, those before it) -> (it as a @triton.jit
    function of the mode, triton).
    Triton's interpreter re-executes a kernel's source in the function's globals (closures are lost), so each
    mode's names live in a scope of its own: one process can interpret the kernels and compile them ahead of
    time (the TensorRT plugin) side by side."""
    if (raw, interpret) in _JITTED:
        return _JITTED[raw, interpret]
    bound = HELPERS[:HELPERS.index(raw)] if raw in HELPERS else HELPERS
    helpers = {h.__name__: jit(h, interpret)[0] for h in bound}
    with triton_for(interpret) as (triton, tl):
        scope = {**raw.__globals__, "tl": tl, "GROUP": tl.constexpr(GROUP), "STATIC": tl.constexpr(STATIC),
                 "MAGNITUDE": tl.constexpr(MAGNITUDE),
                 **helpers}
        fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__)
        # a new function object starts without annotations: copied, or Triton's compiler sees no tl.constexpr
        # parameter (the interpreter does not care, so only a real GPU would show it)
        fn.__annotations__, fn.__doc__, fn.__module__ = dict(raw.__annotations__), raw.__doc__, raw.__module__
        kernel = triton.jit(fn)
        _JITTED[raw, interpret] = (_Recorded(raw, kernel) if interpret and raw not in HELPERS else kernel), triton
    return _JITTED[raw, interpret]


def next_pow2(n: int) -> int:
    """n rounded up to a power of two (Triton's block shapes)."""
    return 1 << max(0, (n - 1).bit_length())


def group_block(g: int) -> int:
    """BLOCK_G: the group's g query rows padded to a power of two (the group rule loads them together)."""
    return next_pow2(g)


def union_block(r: int, g: int, k: int, rule: int, pooled: bool = False) -> int:
    """BLOCK_U: the most coordinates a group's union can hold (k for the shared rules, g k for per-row
    magnitude, r when pooled, at most r), padded to a power of two of at least 16 (tl.dot's smallest K)."""
    most = r if pooled else k if rule in (GROUP, STATIC) else g * k
    return max(16, next_pow2(min(r, most)))


def select(q, p, r: int, k: int, rule: int, projected: bool, interpret: bool, full: bool = False, pool=None):
    """select_kernel over every (sequence, KV head, token) of q [B, Hkv, g, T, d] (P [Hkv, d, r] when projected)
    -> (qs [rows, BLOCK_M, BLOCK_U] float32, idx [rows, BLOCK_U] int32), and with ``full`` the same for every
    coordinate after them (qf, idxf: BLOCK_U = BLOCK_R); the kernels that read them take BLOCK_M and BLOCK_U from
    qs's shape. pool: (prices [Hkv] float32, cut values, cut indices [B * T]; pool.pool_cuts) for a pooled node."""
    b, hkv, g, t, d = q.shape
    # BLOCK_R at least 16: the full selection's qf is a tl.dot operand, whose K Triton < 3.9 requires >= 16 on a GPU
    rows, block_m, block_r = b * hkv * t, max(16, group_block(g)), max(16, next_pow2(r))
    block_u = union_block(r, g, k, rule, pool is not None)
    price, cut_v, cut_i = pool if pool is not None else (q, q, q)  # pointers a plain selection never reads
    qs = torch.empty(rows, block_m, block_u, dtype=torch.float32, device=q.device)
    idx = torch.empty(rows, block_u, dtype=torch.int32, device=q.device)
    qf = torch.empty(rows, block_m, block_r, dtype=torch.float32, device=q.device) if full else qs
    idxf = torch.empty(rows, block_r, dtype=torch.int32, device=q.device) if full else idx
    kernel, _ = jit(select_kernel, interpret)
    with triton_for(interpret):
        kernel[(rows,)](q, p, qs, idx, qf, idxf, price, cut_v, cut_i, t, D=d, R=r, G=g, K=k, RULE=rule,
                        PROJECT=projected, HKV=hkv, BLOCK_G=group_block(g), BLOCK_D=next_pow2(d),
                        CHUNK_D=min(16, next_pow2(d)), BLOCK_R=block_r, BLOCK_M=block_m, BLOCK_U=block_u, FULL=full,
                        POOLED=pool is not None)
    return (qs, idx, qf, idxf) if full else (qs, idx)


def ieee(dtype, interpret: bool) -> bool:
    """The products in float32 ("ieee", not tf32): for float32 caches, and in the interpreter, whose tl.dot
    reads bfloat16 operands wrongly (Triton 3.9: relative error 1e9); 16-bit operands on a GPU use the tensor
    cores, their probabilities rounded to the cache's dtype as flash attention does."""
    return dtype == torch.float32 or interpret
