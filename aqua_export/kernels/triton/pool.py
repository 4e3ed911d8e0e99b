"""The pooled selection's cut on the GPU, in Triton (a node with head_prices: ops.rules, pooled; allocate.head_prices):
per (sequence, token) the layer's heads share Hkv g' k coordinates, so before any (sequence, KV head, token) selects,
each token's cut is found over all its heads:

    pool_score_kernel, per (sequence, KV head, token):
        q [g, d] --x P--> q^ [g, r] --select.priced_rows--> score * price, at each entry's flat index (kv head, row,
        coordinate) of the token's row of ``priced`` [B * T, Hkv g' r]            (g' = g, or 1: the group rule)
    pool_cut_kernel, per (sequence, token), the row in registers:
        the K-th largest priced score, K = Hkv g' k (select.kth_key), and among the entries equal to it the
        (K - above)-th in flat order (ties to the lower flat index)  -->  cut value, cut index [B * T]

select.select_kernel (POOLED) then keeps, per row, what the cut keeps (select.pooled_keep): a row keeps anywhere from
0 to r coordinates, and the union compaction after it is unchanged.
"""

from __future__ import annotations

import torch

from ...ops.spec import GROUP
from .select import group_block, jit, next_pow2, triton_for

tl = query_rows = priced_rows = ordered_key = kth_key = None  # the kernels' free names, bound per mode by select.jit


def pool_score_kernel(q_ptr, p_ptr, price_ptr, out_ptr, T, N, D: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                      RULE: tl.constexpr, PROJECT: tl.constexpr, HKV: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    tt = row % T
    bh = row // T
    h = bh % HKV
    j = tl.arange(0, BLOCK_G)
    in_g = j < G
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    q_row = q_ptr + ((bh * G + j) * T + tt) * D
    qg = query_rows(q_row, p_ptr + h * D * R, in_g, c, in_r, D, R, PROJECT, BLOCK_G, BLOCK_D, CHUNK_D, BLOCK_R)
    s, flat = priced_rows(qg, j, c, h, tl.load(price_ptr + h), G, R, RULE)
    write = in_g[:, None] & in_r[None, :]
    if RULE == GROUP:
        write = write & (j == 0)[:, None]  # one set per group
    tl.store(out_ptr + ((bh // HKV) * T + tt).to(tl.int64) * N + flat, s, mask=write)


def pool_cut_kernel(priced_ptr, cutv_ptr, cuti_ptr, N, NEED, BLOCK_N: tl.constexpr):
    at = tl.program_id(0)  # b * T + t
    n = tl.arange(0, BLOCK_N)
    cand = n < N
    x = tl.load(priced_ptr + at.to(tl.int64) * N + n, mask=cand, other=0.0)
    key = ordered_key(x)
    lo = kth_key(key, cand, NEED)
    n_above = tl.sum((cand & (key > lo)).to(tl.int32), axis=0)
    tie = cand & (key == lo)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
    last = tie & (tie_rank == NEED - n_above - 1)  # the K-th entry in rank order
    tl.store(cutv_ptr + at, tl.max(tl.where(last, x, float("-inf")), axis=0))
    tl.store(cuti_ptr + at, tl.max(tl.where(last, n, -1), axis=0))


def pool_cuts(q, p, prices, r: int, k: int, rule: int, projected: bool, interpret: bool):
    """q [B, Hkv, g, T, d] (P [Hkv, d, r] when projected), prices [Hkv] -> select.select's pool: (prices float32,
    cut values [B * T] float32, cut indices [B * T] int32), each token's cut of the pooled selection at k < r.
    prices given as a float32 tensor on q's device is used as is (no copy: a step stays capturable in a CUDA graph);
    a list is copied there."""
    b, hkv, g, t, d = q.shape
    gp = 1 if rule == GROUP else g
    n = hkv * gp * r
    price = torch.as_tensor(prices, dtype=torch.float32, device=q.device).contiguous()
    priced = torch.empty(b * t, n, dtype=torch.float32, device=q.device)
    cut_v = torch.empty(b * t, dtype=torch.float32, device=q.device)
    cut_i = torch.empty(b * t, dtype=torch.int32, device=q.device)
    score, _ = jit(pool_score_kernel, interpret)
    cut, _ = jit(pool_cut_kernel, interpret)
    block = next_pow2(n)
    with triton_for(interpret):
        score[(b * hkv * t,)](q, p, price, priced, t, n, D=d, R=r, G=g, RULE=rule, PROJECT=projected, HKV=hkv,
                              BLOCK_G=group_block(g), BLOCK_D=next_pow2(d), CHUNK_D=min(16, next_pow2(d)),
                              BLOCK_R=next_pow2(r))
        cut[(b * t,)](priced, cut_v, cut_i, n, hkv * gp * k, BLOCK_N=block, num_warps=max(4, min(16, block // 512)))
    return price, cut_v, cut_i
