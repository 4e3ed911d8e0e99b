"""AquaAttention over a prompt (T > 1) on the GPU, in Triton: flash attention's tiles, 64 rows of one query head
against one key block at a time, over the key blocks each query block's list holds (prefill.block_lists: every block
its rows can see, or those sparse prefill keeps).

    select_kernel (select.py) --> qs, idx: each row's kept coordinates --scattered--> q^ with the others zeroed
        [B * Hkv * g, T, BLOCK_R] (zeros add exact zeros, so the full-width product is the selected one)
    prompt_kernel, one program per (sequence, KV head, query head of the group, query block of 64 positions):
        per listed key block:  K^[:, block] [BLOCK_R, 64], V[block] [64, rv]
            s = softcap(q^ K^) [64, 64] --visible (causal, window, padding)--> online softmax (m, l)
            o [64, rv] += e^(s - m) V
        --> out = o / l (a row that saw nothing: 0, the CPU kernel's rule)

One pass per row, no splits (a prompt has programs enough) and no merge. The decode kernel (aqua_attention.py) keeps
its programs per token, which a single row fills.
"""

from __future__ import annotations

import torch

from ...ops.spec import PREFILL_BLOCK
from .select import ieee, jit, next_pow2, triton_for

tl = key_tile = scores_of = online_step = None  # bound per mode by select.jit


def prompt_kernel(q_ptr, key_ptr, value_ptr, mask_ptr, list_ptr, count_ptr, out_ptr, HKV, T, L, C, MASK_BATCH, WINDOW,
                  N_QB, N_LIST, R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, QBLOCK: tl.constexpr, IEEE: tl.constexpr):
    head = tl.program_id(0)  # (b * Hkv + h) * G + j
    qb = tl.program_id(1)  # the call's query block
    bh = head // G
    b = bh // HKV
    start = L - T
    pos = (start // QBLOCK + qb) * QBLOCK + tl.arange(0, QBLOCK)  # the block's positions
    tt = pos - start
    in_t = (tt >= 0) & (tt < T)
    c = tl.arange(0, BLOCK_R)
    v = tl.arange(0, BLOCK_V)
    in_v = v < RV
    rows = head.to(tl.int64) * T + tt
    qt = tl.load(q_ptr + rows[:, None] * BLOCK_R + c[None, :], mask=in_t[:, None], other=0.0)
    if not IEEE:
        qt = qt.to(key_ptr.dtype.element_ty)
    use = c < R
    krow = key_ptr + bh.to(tl.int64) * R * C + tl.where(use, c, 0).to(tl.int64) * C
    value = value_ptr + bh.to(tl.int64) * C * RV
    arow = mask_ptr + b * MASK_BATCH
    lo = tl.where(WINDOW > 0, pos - WINDOW + 1, 0)
    blocks = list_ptr + (bh * N_QB + qb) * N_LIST
    m = tl.full([QBLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([QBLOCK], tl.float32)
    o = tl.zeros([QBLOCK, BLOCK_V], tl.float32)
    for i in range(0, tl.load(count_ptr + bh * N_QB + qb)):
        kb, s, ok = key_tile(krow, use, tl.load(blocks + i), blocks, N_LIST, C, BLOCK_R, QBLOCK, False, QBLOCK)
        sc, real = scores_of(qt, kb, s, ok, arow, L, 0, L - 1, SOFTCAP, IEEE)  # real: in range, not padding
        vis = real[None, :] & (s[None, :] <= pos[:, None]) & (s[None, :] >= lo[:, None])  # each row's own bounds
        vb = tl.load(value + s[:, None] * RV + v[None, :], mask=real[:, None] & in_v[None, :], other=0.0)
        m, acc, o = online_step(m, acc, o, tl.where(vis, sc, float("-inf")), vb, IEEE)
    res = o / tl.where(acc > 0.0, acc, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * RV + v[None, :], res.to(out_ptr.dtype.element_ty),
             mask=in_t[:, None] & in_v[None, :])


def dense_rows(qs, idx, g: int, t: int, r: int, dtype) -> torch.Tensor:
    """select's qs [B * Hkv * T, BLOCK_M, BLOCK_U] and idx [B * Hkv * T, BLOCK_U] -> each query row's q^ with its
    unkept coordinates zeroed, [B * Hkv * g, T, BLOCK_R] in ``dtype`` (the products' operand type; padding
    coordinates zero)."""
    rows, _, block_u = qs.shape
    block_r = max(16, next_pow2(r))
    at = idx.clamp(0, block_r - 1).long()[:, None].expand(rows, g, block_u)  # (a dry launch leaves idx unwritten)
    full = torch.zeros(rows, g, block_r, dtype=torch.float32, device=qs.device)
    full.scatter_add_(2, at, torch.where(idx[:, None] >= 0, qs[:, :g], 0.0))  # unused places add 0 at coordinate 0
    return full.view(-1, t, g, block_r).transpose(1, 2).reshape(-1, t, block_r).to(dtype).contiguous()


def prompt(qs, idx, kc, vc, mk, total: int, g: int, softcap: float, window: int, lists, interpret: bool,
           dtype) -> torch.Tensor:
    """prompt_kernel: select's qs, idx over the T call rows, kc [B, Hkv, r, C], vc [B, Hkv, C, rv], mask [B|1, L]
    int32, lists (prefill.block_lists' (lists, counts, NBq)) -> out [B, Hkv, g, T, rv] in ``dtype``."""
    b, hkv, r, cap = kc.shape
    rv = vc.shape[3]
    t = qs.shape[0] // (b * hkv)
    blocks, counts, n_qb = lists
    exact = ieee(kc.dtype, interpret)
    q = dense_rows(qs, idx, g, t, r, torch.float32 if exact else kc.dtype)
    out = torch.empty(b, hkv, g, t, rv, dtype=dtype, device=kc.device)
    kernel, _ = jit(prompt_kernel, interpret)
    with triton_for(interpret):
        kernel[(b * hkv * g, n_qb)](q, kc, vc, mk, blocks, counts, out, hkv, t, total, cap,
                                    0 if mk.shape[0] == 1 else total, int(window), n_qb, blocks.shape[1], R=r, RV=rv,
                                    G=g, SOFTCAP=float(softcap), BLOCK_R=q.shape[2], BLOCK_V=next_pow2(rv),
                                    QBLOCK=PREFILL_BLOCK, IEEE=exact)
    return out
