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

(token selection at a decode step: page_score_kernel first scores the pages with the selected rows of K^, the
host chooses pages by ops.rules, and the programs walk only the chosen pages' positions, all r coordinates)
and the host merges the splits, out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M): no [B, Hkv, g, T, L]
tensor is written. Splits exist so that decode at small batch still fills the GPU (flash-decoding). A mask
entry at or below -1e37 hides its position, and a row hidden everywhere outputs zeros (the CPU kernel's rule).
triton is imported only when the kernel is built; without a GPU ``interpret=True`` runs it in Triton's
interpreter on the CPU (how the tests check it).
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from ...ops import rules
from ...ops.spec import PAGE, RULE_NAMES
from .select import group_block, jit, next_pow2, triton_for

tl = keep_of = query_rows = None  # the kernels' free names, bound per mode by select.jit (triton is imported only there)

PROGRAMS_WANTED = 264  # (sequence, KV head, token) programs times splits: two waves of an H100's 132 SMs


def aqua_attention_kernel(q_ptr, p_ptr, key_ptr, value_ptr, mask_ptr, pages_ptr, o_ptr, ml_ptr,
                          HKV, T, L, C, SPLITS, SPLIT_LEN, MASK_BATCH, N_POS,
                          D: tl.constexpr, R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr,
                          K: tl.constexpr, RULE: tl.constexpr, SOFTCAP: tl.constexpr, PROJECT: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
                          PAGED: tl.constexpr, PAGE: tl.constexpr):
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
    qg = query_rows(q_row, p_ptr + (bh % HKV) * D * R, in_g, c, in_r, D, R, PROJECT, BLOCK_G, BLOCK_D, CHUNK_D, BLOCK_R)
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
    for s0 in range(p0, tl.minimum(N_POS, p0 + SPLIT_LEN), BLOCK_S):
        at = s0 + tl.arange(0, BLOCK_S)  # the split's positions, or its places in the row's chosen pages
        in_s = (at < N_POS) & (at < p0 + SPLIT_LEN)
        if PAGED:  # pages_ptr [B * Hkv, N_POS / PAGE]: the chosen pages ascending, -1 past the last
            pg = tl.load(pages_ptr + bh * (N_POS // PAGE) + at // PAGE, mask=in_s, other=-1)
            s = pg * PAGE + at % PAGE
            in_s = in_s & (pg >= 0) & (s < L)
        else:
            s = at
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


def page_score_kernel(q_ptr, p_ptr, key_ptr, mask_ptr, best_ptr, HKV, L, C, MASK_BATCH, N_PAGES,
                      D: tl.constexpr, R: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RULE: tl.constexpr,
                      SOFTCAP: tl.constexpr, PROJECT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                      CHUNK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PAGE: tl.constexpr):
    """Token selection's score pass at a decode step: one program per (sequence, KV head, block of positions)
    -> best [B * Hkv, N_PAGES]: each page's largest approximate score over the group's rows and its visible
    positions (-inf: none visible); only the selected rows of K^ load."""
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    j = tl.arange(0, BLOCK_G)
    in_g = j < G
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    qg = query_rows(q_ptr + (bh * G + j) * D, p_ptr + (bh % HKV) * D * R, in_g, c, in_r, D, R, PROJECT, BLOCK_G,
                    BLOCK_D, CHUNK_D, BLOCK_R)
    keep = keep_of(qg, c, in_r, R, K, RULE) & in_g[:, None]
    qs = tl.where(keep, qg, 0.0)
    rows = tl.max(keep.to(tl.int32), axis=0) > 0
    s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    mk = tl.load(mask_ptr + (bh // HKV) * MASK_BATCH + s, mask=s < L, other=float("-inf"))
    vis = (s < L) & (mk > -1e37)
    kb = tl.load(key_ptr + bh * R * C + c[:, None] * C + s[None, :], mask=rows[:, None] & vis[None, :], other=0.0)
    sc = tl.sum(qs[:, :, None] * kb.to(tl.float32)[None, :, :], axis=1)
    if SOFTCAP > 0.0:
        sc = (1.0 - 2.0 / (tl.exp(2.0 * sc / SOFTCAP) + 1.0)) * SOFTCAP
    sc = tl.where(in_g[:, None] & vis[None, :], sc, float("-inf"))
    best = tl.max(tl.reshape(tl.max(sc, axis=0), [BLOCK_S // PAGE, PAGE]), axis=1)
    page = blk * (BLOCK_S // PAGE) + tl.arange(0, BLOCK_S // PAGE)
    tl.store(best_ptr + bh * N_PAGES + page, best, mask=page < N_PAGES)


def _kernel(interpret: bool):
    return jit(aqua_attention_kernel, interpret)


def block_s(g: int, width: int) -> int:
    """Positions per block: a program's [g, width, positions] product tile holds <= 8k elements (a whole number of
    pages)."""
    return max(PAGE, 8192 // (group_block(g) * next_pow2(width)))


def split_count(rows: int, length: int, block: int, wanted: int = PROGRAMS_WANTED) -> int:
    """Splits of the L positions per (sequence, KV head, token): enough programs for the GPU, each split at
    least a block long."""
    return max(1, min(-(-wanted // max(rows, 1)), -(-length // block)))


def _check(query, key_cache, value_cache, total: int, mask, k: int, rule: int, projection, tokens) -> int:
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
    if tokens is not None and (not 0 < tokens.ratio <= 1 or min(tokens.budget, tokens.sink, tokens.window) < 0):
        raise ValueError("AquaAttention: token_ratio must be in (0, 1], token_budget, token_sink and token_window "
                         ">= 0")
    return r


@dataclass(frozen=True)
class Tokens:
    """The node's token-selection attributes (ops/aqua_attention.py TOKEN_ATTRS)."""

    ratio: float = 1.0
    budget: int = 0
    sink: int = 0
    window: int = 0

    @property
    def on(self) -> bool:
        return self.ratio < 1 or self.budget > 0


def chosen_pages(best: torch.Tensor, mask: torch.Tensor, tokens: Tokens) -> torch.Tensor:
    """best [B, Hkv, P] (page_score_kernel), mask [B|1, 1, 1, 1, L] -> [B * Hkv, n] int32: each row's chosen pages
    (ops.rules.select_pages) ascending, -1 past its last; n the most any row chose."""
    b, hkv, n_pages = best.shape
    visible = (mask[:, 0, 0, 0] > rules.MASKED)[:, None].expand(b, hkv, mask.shape[-1])
    forced = rules.forced_pages(visible, tokens.sink, tokens.window)
    chosen = rules.select_pages(best, forced, rules.tokens_attended(visible, tokens.ratio, tokens.budget))
    ids = torch.where(chosen, torch.arange(n_pages, device=best.device), n_pages).sort(-1).values
    ids = ids[..., :max(1, int(chosen.sum(-1).max()))]
    return torch.where(ids < n_pages, ids, -1).to(torch.int32).reshape(b * hkv, -1).contiguous()


def aqua_attention(query, key_cache, value_cache, total: int, mask, k: int, rule: int = 0, softcap: float = 0.0,
                   projection=None, interpret: bool | None = None, splits: int | None = None,
                   tokens: Tokens | None = None):
    """The node on the GPU (or in the interpreter): out [B, Hkv, g, T, rv] in query's dtype. splits: of the
    positions per (sequence, KV head, token); None chooses (split_count). tokens: token selection (a decode step
    scores pages with page_score_kernel and attends the chosen ones with all r coordinates; a prompt attends every
    token with all r)."""
    r = _check(query, key_cache, value_cache, total, mask, k, rule, projection, tokens)
    b, hkv, g, t, d = query.shape
    cap, rv = key_cache.shape[3], value_cache.shape[3]
    out = query.new_zeros(b, hkv, g, t, rv)
    if out.numel() == 0 or total == 0:
        return out
    if interpret is None:
        interpret = not query.is_cuda
    q = query.contiguous()
    p = (projection if projection is not None else q).to(q.dtype).contiguous()  # q: a pointer PROJECT never reads
    kc, vc = key_cache.to(q.dtype).contiguous(), value_cache.to(q.dtype).contiguous()
    mk = mask.to(torch.float32).contiguous()
    shapes = dict(D=d, R=r, G=g, RULE=rule, SOFTCAP=float(softcap), PROJECT=projection is not None,
                  BLOCK_G=group_block(g), BLOCK_D=next_pow2(d), CHUNK_D=min(16, next_pow2(d)), BLOCK_R=next_pow2(r))
    mask_batch = 0 if mask.shape[0] == 1 else t * total
    pages, n_pos, width = q, total, max(r, rv)
    if tokens is not None and tokens.on:
        if t == 1:
            pages = chosen_pages(_page_scores(q, p, kc, mk, total, k, mask_batch, shapes, interpret), mk, tokens)
            n_pos = pages.shape[1] * PAGE
        k = r  # the chosen tokens, or a prompt's, are attended with every coordinate
    block = block_s(g, width)
    n = splits or split_count(b * hkv * t, n_pos, block)
    split_len = -(-(-(-n_pos // n)) // block) * block  # whole blocks
    n = -(-n_pos // split_len)
    o = torch.empty(b * hkv * t * n, g, rv, dtype=torch.float32, device=query.device)
    ml = torch.empty(b * hkv * t * n, g, 2, dtype=torch.float32, device=query.device)
    kernel, _ = _kernel(interpret)
    with triton_for(interpret):  # the interpreter also reads the mode while it runs
        kernel[(b * hkv * t, n)](q, p, kc, vc, mk, pages, o, ml, hkv, t, total, cap, n, split_len, mask_batch, n_pos,
                                 RV=rv, K=k, BLOCK_V=next_pow2(rv), BLOCK_S=block, PAGED=pages is not q, PAGE=PAGE,
                                 **shapes)
    return _merge(o, ml, b, hkv, g, t, n, rv).to(query.dtype)


def _page_scores(q, p, kc, mk, total: int, k: int, mask_batch: int, shapes: dict, interpret: bool) -> torch.Tensor:
    """page_score_kernel's best [B, Hkv, P] for a decode step."""
    b, hkv, g, _, _ = q.shape
    n_pages = -(-total // PAGE)
    block = block_s(g, shapes["R"])
    best = torch.empty(b, hkv, n_pages, dtype=torch.float32, device=q.device)
    kernel, _ = jit(page_score_kernel, interpret)
    with triton_for(interpret):
        kernel[(b * hkv, -(-total // block))](q, p, kc, mk, best, hkv, total, kc.shape[3], mask_batch, n_pages, K=k,
                                                BLOCK_S=block, PAGE=PAGE, **shapes)
    return best


def _merge(o, ml, b, hkv, g, t, n, rv):
    """The splits' (o, m, l) [b*hkv*t*n, g, ...] merged: out [B, Hkv, g, T, rv] float32 = sum_i o_i e^(m_i - M) /
    sum_i l_i e^(m_i - M)."""
    o = o.view(b * hkv * t, n, g, rv)
    m, l = ml.view(b * hkv * t, n, g, 2).unbind(-1)
    live = l > 0  # a split that saw no visible position has o = 0, l = 0
    top = torch.where(live, m, float("-inf")).amax(1, keepdim=True)
    w = torch.where(live, torch.exp(m - torch.where(torch.isfinite(top), top, 0.0)), 0.0)
    den = (l * w).sum(1)
    res = (o * w[..., None]).sum(1) / torch.where(den > 0, den, 1.0)[..., None]  # hidden rows: 0 / 1
    return res.view(b, hkv, t, g, rv).transpose(2, 3)
