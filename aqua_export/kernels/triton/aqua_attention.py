"""The GPU kernel of AquaAttention, in Triton: the fused node's contract (ops/aqua_attention.py,
plugins/ort/aqua_attention.cc) for the PyTorch host.

    query [B, Hkv, g, T, d] (q^ itself, d = r, when no projection)   projection [Hkv, d, r] (optional)
    key_cache [B, Hkv, r, C] (dim-major K^)   value_cache [B, Hkv, C, rv]   mask [B|1, 1, 1, T, L] float32
        -> out [B, Hkv, g, T, rv] = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L]

One program per (sequence, KV head, token, split of the L positions), holding the g query rows of the group:

    q [g, d] --x P (chunks of d)--> q^ [g, r] --selection (select.py)--> q_sel (others zeroed)
    per block of positions:  K^[union rows, block] (only the selected rows load: with the group rule exactly k)
        --> s [g, block] --softcap?, + mask--> online softmax (m, l)  -->  o [g, rv] += e^(s - m) V[block]
    --> the split's (o, m, l)

and the host merges the splits, out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M): no [B, Hkv, g, T, L]
tensor is written. Splits exist so that decode at small batch still fills the GPU (flash-decoding). A mask
entry at or below -1e37 hides its position, and a row hidden everywhere outputs zeros (the CPU kernel's rule).
triton is imported only when the kernel is built; without a GPU ``interpret=True`` runs it in Triton's
interpreter on the CPU (how the tests check it).
"""

from __future__ import annotations

import torch

from ...ops.spec import RULE_NAMES
from .select import group_block, jit, next_pow2, triton_for

tl = keep_of = None  # the kernel's free names, bound per mode by select.jit (triton is imported only there)

PROGRAMS_WANTED = 264  # (sequence, KV head, token) programs times splits: two waves of an H100's 132 SMs


def aqua_attention_kernel(q_ptr, p_ptr, key_ptr, value_ptr, mask_ptr, o_ptr, ml_ptr,
                          HKV, T, L, C, SPLITS, SPLIT_LEN, MASK_BATCH,
                          D: tl.constexpr, R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr,
                          K: tl.constexpr, RULE: tl.constexpr, SOFTCAP: tl.constexpr, PROJECT: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    sp = tl.program_id(1)
    tt = row % T
    bh = row // T
    b = bh // HKV
    j = tl.arange(0, BLOCK_G)
    in_g = j < G
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    v = tl.arange(0, BLOCK_V)
    in_v = v < RV
    q_row = q_ptr + ((bh * G + j) * T + tt) * D  # [BLOCK_G] pointers to the g rows of this token
    # -- q^ = q P, or q^ given
    if PROJECT:
        qg = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
        for e0 in tl.static_range(0, BLOCK_D, CHUNK_D):
            e = e0 + tl.arange(0, CHUNK_D)
            in_d = e < D
            qd = tl.load(q_row[:, None] + e[None, :], mask=in_g[:, None] & in_d[None, :], other=0.0)
            pd = tl.load(p_ptr + (bh % HKV) * D * R + e[:, None] * R + c[None, :],
                         mask=in_d[:, None] & in_r[None, :], other=0.0)
            qg += tl.sum(qd.to(tl.float32)[:, :, None] * pd.to(tl.float32)[None, :, :], axis=1)
    else:
        qg = tl.load(q_row[:, None] + c[None, :], mask=in_g[:, None] & in_r[None, :], other=0.0).to(tl.float32)
    # -- selection (select.py): coordinate i kept iff fewer than K coordinates beat it (ties: the lower index)
    keep = keep_of(qg, c, in_r, R, K, RULE) & in_g[:, None]
    qs = tl.where(keep, qg, 0.0)
    rows = tl.max(keep.to(tl.int32), axis=0) > 0  # the union of the g selections
    # -- one pass over this split's positions: online softmax and the value product
    key = key_ptr + bh * R * C
    value = value_ptr + bh * C * RV
    mrow = mask_ptr + b * MASK_BATCH + tt * L
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_G], tl.float32)
    o = tl.zeros([BLOCK_G, BLOCK_V], tl.float32)
    p0 = sp * SPLIT_LEN
    for s0 in range(p0, tl.minimum(L, p0 + SPLIT_LEN), BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        in_s = (s < L) & (s < p0 + SPLIT_LEN)
        mk = tl.load(mrow + s, mask=in_s, other=float("-inf"))
        vis = in_s & (mk > -1e37)  # the CPU kernel's kHidden
        kb = tl.load(key + c[:, None] * C + s[None, :], mask=rows[:, None] & vis[None, :], other=0.0)
        sc = tl.sum(qs[:, :, None] * kb.to(tl.float32)[None, :, :], axis=1)
        if SOFTCAP > 0.0:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates correctly at both ends
            sc = (1.0 - 2.0 / (tl.exp(2.0 * sc / SOFTCAP) + 1.0)) * SOFTCAP
        sc = tl.where(vis[None, :], sc + mk[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        base = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - base)  # 0 while nothing was visible (m = -inf)
        e = tl.exp(sc - base[:, None])
        vb = tl.load(value + s[:, None] * RV + v[None, :], mask=vis[:, None] & in_v[None, :], other=0.0)
        acc = acc * alpha + tl.sum(e, axis=1)
        o = o * alpha[:, None] + tl.sum(e[:, :, None] * vb.to(tl.float32)[None, :, :], axis=1)
        m = m_new
    part = row * SPLITS + sp
    tl.store(o_ptr + (part * G + j[:, None]) * RV + v[None, :], o, mask=in_g[:, None] & in_v[None, :])
    tl.store(ml_ptr + (part * G + j) * 2, m, mask=in_g)
    tl.store(ml_ptr + (part * G + j) * 2 + 1, acc, mask=in_g)


def _kernel(interpret: bool):
    return jit(aqua_attention_kernel, interpret)


def block_s(g: int, width: int) -> int:
    """Positions per block: a program's [g, width, positions] product tile holds <= 8k elements."""
    return max(16, 8192 // (group_block(g) * next_pow2(width)))


def split_count(rows: int, length: int, block: int, wanted: int = PROGRAMS_WANTED) -> int:
    """Splits of the L positions per (sequence, KV head, token): enough programs for the GPU, each split at
    least a block long."""
    return max(1, min(-(-wanted // max(rows, 1)), -(-length // block)))


def _check(query, key_cache, value_cache, total: int, mask, k: int, rule: int, projection) -> int:
    """The shapes the node accepts (the CPU kernel's checks); returns r."""
    if query.dim() != 5 or key_cache.dim() != 4 or value_cache.dim() != 4 or mask.dim() != 5:
        raise ValueError("AquaAttention: expected query [B,Hkv,g,T,d], key_cache [B,Hkv,r,C], value_cache "
                         "[B,Hkv,C,rv] and mask [B|1,1,1,T,L]")
    b, hkv, _, t, d = query.shape
    r = key_cache.shape[2]
    if projection is not None and tuple(projection.shape) != (hkv, d, r):
        raise ValueError(f"AquaAttention: projection must be [Hkv, d, r] = {(hkv, d, r)}, got {tuple(projection.shape)}")
    if key_cache.shape[:2] != (b, hkv) or value_cache.shape[:2] != (b, hkv) or (projection is None and d != r):
        raise ValueError("AquaAttention: query_hat, key_cache and value_cache disagree on B, Hkv or r")
    if not 0 <= total <= min(key_cache.shape[3], value_cache.shape[2]) or mask.shape[0] not in (1, b) \
            or tuple(mask.shape[1:]) != (1, 1, t, total):
        raise ValueError("AquaAttention: total_length must fit both caches and mask must be [B|1,1,1,T,L]")
    if not 1 <= k <= r or rule not in RULE_NAMES:
        raise ValueError(f"AquaAttention: k must be in [1, r={r}] and rule in {{{', '.join(map(str, RULE_NAMES))}}}")
    return r


def aqua_attention(query, key_cache, value_cache, total: int, mask, k: int, rule: int = 0, softcap: float = 0.0,
                   projection=None, interpret: bool | None = None, splits: int | None = None):
    """The node on the GPU (or in the interpreter): out [B, Hkv, g, T, rv] in query's dtype. splits: of the
    positions per (sequence, KV head, token); None chooses (split_count)."""
    r = _check(query, key_cache, value_cache, total, mask, k, rule, projection)
    b, hkv, g, t, d = query.shape
    cap, rv = key_cache.shape[3], value_cache.shape[3]
    out = query.new_zeros(b, hkv, g, t, rv)
    if out.numel() == 0 or total == 0:
        return out
    if interpret is None:
        interpret = not query.is_cuda
    kernel, _ = _kernel(interpret)
    width = max(r, rv)
    block = block_s(g, width)
    n = splits or split_count(b * hkv * t, total, block)
    per_split = -(-total // n)
    split_len = -(-per_split // block) * block  # whole blocks
    n = -(-total // split_len)
    o = torch.empty(b * hkv * t * n, g, rv, dtype=torch.float32, device=query.device)
    ml = torch.empty(b * hkv * t * n, g, 2, dtype=torch.float32, device=query.device)
    q = query.contiguous()
    p = (projection if projection is not None else q).to(q.dtype).contiguous()  # q: a pointer PROJECT never reads
    kc, vc = key_cache.to(q.dtype).contiguous(), value_cache.to(q.dtype).contiguous()
    mk = mask.to(torch.float32).contiguous()
    with triton_for(interpret):  # the interpreter also reads the mode while it runs
        kernel[(b * hkv * t, n)](q, p, kc, vc, mk, o, ml, hkv, t, total, cap, n, split_len,
                                 0 if mask.shape[0] == 1 else t * total, D=d, R=r, RV=rv, G=g, K=k, RULE=rule,
                                 SOFTCAP=float(softcap), PROJECT=projection is not None, BLOCK_G=group_block(g),
                                 BLOCK_D=next_pow2(d), CHUNK_D=min(16, next_pow2(d)), BLOCK_R=next_pow2(r),
                                 BLOCK_V=next_pow2(rv), BLOCK_S=block)
    # merge the splits: [b*hkv*t, n, g, ...] -> out
    o = o.view(b * hkv * t, n, g, rv)
    m, l = ml.view(b * hkv * t, n, g, 2).unbind(-1)
    live = l > 0  # a split that saw no visible position has o = 0, l = 0
    top = torch.where(live, m, float("-inf")).amax(1, keepdim=True)
    w = torch.where(live, torch.exp(m - torch.where(torch.isfinite(top), top, 0.0)), 0.0)
    den = (l * w).sum(1)
    res = (o * w[..., None]).sum(1) / torch.where(den > 0, den, 1.0)[..., None]  # hidden rows: 0 / 1
    return res.view(b, hkv, t, g, rv).transpose(2, 3).to(query.dtype)
