"""The GPU kernel of AquaAttention, in Triton: the fused node's contract (ops/aqua_attention.py,
plugins/ort/aqua_attention.cc) for the PyTorch host.

    query [B, Hkv, g, T, d] (q^ itself, d = r, when no projection)   projection [Hkv, d, r] (optional)
    key_cache [B, Hkv, r, C] (dim-major K^)   value_cache [B, Hkv, C, rv]   mask [B|1, 1, 1, T, L] float32
        -> out [B, Hkv, g, T, rv] = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L]

One program per (sequence, KV head, token, split of the L positions), holding the g query rows of the group
padded to 16 (the tensor cores' smallest M; the two products below are tl.dot):

    q [g, d] --x P (chunks of d)--> q^ [g, r] --selection (select.py)--> q_sel (others zeroed)
    per block of 64 positions:  K^[union rows, block] (only the selected rows load: with the group rule exactly k)
        --> s [16, block] --softcap?, + mask--> online softmax (m, l)  -->  o [16, rv] += e^(s - m) V[block]
    --> the split's (o, m, l)

(token selection at a decode step: page_score_kernel first scores the pages with the selected rows of K^, the
host chooses pages by ops.rules, and the programs walk only the chosen pages' positions, all r coordinates)
then merge_kernel, one program per (sequence, KV head, token, query row), merges the splits:
out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M). No [B, Hkv, g, T, L] tensor is written. Splits exist so
that decode at small batch still fills the GPU (flash-decoding). A mask entry at or below -1e37 hides its
position, and a row hidden everywhere outputs zeros (the CPU kernel's rule).
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

PROGRAMS_WANTED = 1056  # (sequence, KV head, token) programs times splits: 8 per SM of an H100's 132 (bench_gpu --tune)


def select_kernel(q_ptr, p_ptr, qs_ptr, rows_ptr, T, D: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                  K: tl.constexpr, RULE: tl.constexpr, PROJECT: tl.constexpr, HKV: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """The selection, once per (sequence, KV head, token) -> qs [rows, BLOCK_M, BLOCK_R] float32: q^ with the
    unselected coordinates zeroed, rows past g zero (the tensor cores' M of 16); rows [rows, BLOCK_R] int8: the
    union of the group's selections (the rows of K^ that load)."""
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    tt = row % T
    bh = row // T
    j = tl.arange(0, BLOCK_G)
    in_g = j < G
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    q_row = q_ptr + ((bh * G + j) * T + tt) * D  # [BLOCK_G] pointers to the g rows of this token
    qg = query_rows(q_row, p_ptr + (bh % HKV) * D * R, in_g, c, in_r, D, R, PROJECT, BLOCK_G, BLOCK_D, CHUNK_D, BLOCK_R)
    # coordinate i kept iff fewer than K coordinates beat it (ties: the lower index)
    keep = keep_of(qg, c, in_r, R, K, RULE) & in_g[:, None]
    out = qs_ptr + row * BLOCK_M * BLOCK_R
    tl.store(out + j[:, None] * BLOCK_R + c[None, :], tl.where(keep, qg, 0.0), mask=in_g[:, None])
    m_id = tl.arange(0, BLOCK_M)  # the padding rows, stored rather than assembled in registers (see aqua_attention)
    tl.store(out + m_id[:, None] * BLOCK_R + c[None, :], tl.zeros([BLOCK_M, BLOCK_R], tl.float32),
             mask=(m_id >= G)[:, None])
    tl.store(rows_ptr + row * BLOCK_R + c, (tl.max(keep.to(tl.int32), axis=0) > 0).to(tl.int8))


def aqua_attention_kernel(qs_ptr, rows_ptr, key_ptr, value_ptr, mask_ptr, pages_ptr, o_ptr, ml_ptr,
                          HKV, T, L, C, SPLITS, SPLIT_LEN, MASK_BATCH, N_POS,
                          R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
                          PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    sp = tl.program_id(1)
    tt = row % T
    bh = row // T
    b = bh // HKV
    c = tl.arange(0, BLOCK_R)
    v = tl.arange(0, BLOCK_V)
    in_v = v < RV
    m_id = tl.arange(0, BLOCK_M)
    qs = tl.load(qs_ptr + (row * BLOCK_M + m_id[:, None]) * BLOCK_R + c[None, :])  # select_kernel's
    if not IEEE:
        qs = qs.to(key_ptr.dtype.element_ty)
    rows = (tl.load(rows_ptr + row * BLOCK_R + c) != 0) & (c < R)
    # -- one pass over this split's positions: online softmax and the value product
    key = key_ptr + bh * R * C
    value = value_ptr + bh * C * RV
    mrow = mask_ptr + b * MASK_BATCH + tt * L
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
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
        if IEEE:  # float32 products, not tf32 (_ieee says when)
            sc = tl.dot(qs, kb.to(tl.float32), input_precision="ieee")
        else:
            sc = tl.dot(qs, kb)
        if SOFTCAP > 0.0:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates correctly at both ends
            sc = (1.0 - 2.0 / (tl.exp(2.0 * sc / SOFTCAP) + 1.0)) * SOFTCAP
        sc = tl.where(vis[None, :], sc + mk[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        base = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - base)  # 0 while nothing was visible (m = -inf)
        e = tl.exp(sc - base[:, None])
        vb = tl.load(value + s[:, None] * RV + v[None, :], mask=vis[:, None] & in_v[None, :], other=0.0)
        acc = acc * alpha + tl.sum(e, axis=1)
        if IEEE:
            o = o * alpha[:, None] + tl.dot(e, vb.to(tl.float32), input_precision="ieee")
        else:
            o = o * alpha[:, None] + tl.dot(e.to(vb.dtype), vb)
        m = m_new
    part = row * SPLITS + sp
    in_m = m_id < G
    tl.store(o_ptr + (part * G + m_id[:, None]) * RV + v[None, :], o, mask=in_m[:, None] & in_v[None, :])
    tl.store(ml_ptr + (part * G + m_id) * 2, m, mask=in_m)
    tl.store(ml_ptr + (part * G + m_id) * 2 + 1, acc, mask=in_m)


def merge_kernel(o_ptr, ml_ptr, out_ptr, T, SPLITS, G: tl.constexpr, RV: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """The splits of one query row of one (sequence, KV head, token) merged, BLOCK_N splits at a time (at batch 1
    a row has ~100 splits: one at a time would be a chain of dependent loads): out[b, h, j, t] = sum_i o_i
    e^(m_i - M) / sum_i l_i e^(m_i - M) over the splits that saw a visible position (l_i > 0); a row that saw
    none outputs zeros."""
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    j = tl.program_id(1)  # the query row in the group
    tt = row % T
    bh = row // T
    i = tl.arange(0, BLOCK_N)
    v = tl.arange(0, BLOCK_V)
    top = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    num = tl.zeros([BLOCK_V], tl.float32)
    for n0 in range(0, SPLITS, BLOCK_N):
        part = row * SPLITS + n0 + i
        in_n = n0 + i < SPLITS
        li = tl.load(ml_ptr + (part * G + j) * 2 + 1, mask=in_n, other=0.0)
        mi = tl.load(ml_ptr + (part * G + j) * 2, mask=in_n, other=float("-inf"))
        mi = tl.where(li > 0.0, mi, float("-inf"))  # a split that saw nothing visible: o = 0, l = 0
        oi = tl.load(o_ptr + (part * G + j)[:, None] * RV + v[None, :], mask=in_n[:, None] & (v < RV)[None, :],
                     other=0.0)
        new = tl.maximum(top, tl.max(mi, axis=0))
        base = tl.where(new > float("-inf"), new, 0.0)
        a_old = tl.exp(top - base)
        a_new = tl.where(li > 0.0, tl.exp(mi - base), 0.0)
        den = den * a_old + tl.sum(li * a_new, axis=0)
        num = num * a_old + tl.sum(oi * a_new[:, None], axis=0)
        top = new
    res = num / tl.where(den > 0.0, den, 1.0)  # hidden rows: 0 / 1
    tl.store(out_ptr + ((bh * G + j) * T + tt) * RV + v, res.to(out_ptr.dtype.element_ty), mask=v < RV)


def page_score_kernel(qs_ptr, rows_ptr, key_ptr, mask_ptr, best_ptr, HKV, L, C, MASK_BATCH, N_PAGES,
                      R: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_S: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    """Token selection's score pass at a decode step: one program per (sequence, KV head, block of positions)
    -> best [B * Hkv, N_PAGES]: each page's largest approximate score over the group's rows and its visible
    positions (-inf: none visible); only the selected rows of K^ load."""
    bh = tl.program_id(0)  # a decode step: T = 1, so select_kernel's row is the (sequence, KV head)
    blk = tl.program_id(1)
    c = tl.arange(0, BLOCK_R)
    m_id = tl.arange(0, BLOCK_M)
    qs = tl.load(qs_ptr + (bh * BLOCK_M + m_id[:, None]) * BLOCK_R + c[None, :])
    if not IEEE:
        qs = qs.to(key_ptr.dtype.element_ty)
    rows = (tl.load(rows_ptr + bh * BLOCK_R + c) != 0) & (c < R)
    s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    mk = tl.load(mask_ptr + (bh // HKV) * MASK_BATCH + s, mask=s < L, other=float("-inf"))
    vis = (s < L) & (mk > -1e37)
    kb = tl.load(key_ptr + bh * R * C + c[:, None] * C + s[None, :], mask=rows[:, None] & vis[None, :], other=0.0)
    if IEEE:
        sc = tl.dot(qs, kb.to(tl.float32), input_precision="ieee")
    else:
        sc = tl.dot(qs, kb)
    if SOFTCAP > 0.0:
        sc = (1.0 - 2.0 / (tl.exp(2.0 * sc / SOFTCAP) + 1.0)) * SOFTCAP
    sc = tl.where((m_id < G)[:, None] & vis[None, :], sc, float("-inf"))
    best = tl.max(tl.reshape(tl.max(sc, axis=0), [BLOCK_S // PAGE, PAGE]), axis=1)
    page = blk * (BLOCK_S // PAGE) + tl.arange(0, BLOCK_S // PAGE)
    tl.store(best_ptr + bh * N_PAGES + page, best, mask=page < N_PAGES)


def _kernel(interpret: bool):
    return jit(aqua_attention_kernel, interpret)


def block_s(width: int) -> int:
    """Positions per block (a whole number of pages): the [width, positions] tiles of K^ and V each stay <= 16 KB
    of float16, so two or three pipeline stages of both fit in shared memory."""
    return max(PAGE, min(64, 8192 // next_pow2(width)))


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


def most_pages(tokens: Tokens, total: int, n_pages: int) -> int:
    """The most pages any row of a step over ``total`` positions can choose (ops.rules.pages_wanted's bound, from
    host integers: no device sync, so a step can be captured in a CUDA graph): the attended tokens' pages plus
    the forced sink and window pages, each run possibly straddling one more page."""
    attended = tokens.budget if tokens.budget else int(rules.budget(tokens.ratio, total))
    forced = -(-tokens.sink // PAGE) + -(-tokens.window // PAGE) + 2
    return max(1, min(n_pages, -(-min(attended, total) // PAGE) + forced))


def chosen_pages(best: torch.Tensor, mask: torch.Tensor, tokens: Tokens) -> torch.Tensor:
    """best [B, Hkv, P] (page_score_kernel), mask [B|1, 1, 1, 1, L] -> [B * Hkv, n] int32: each row's chosen pages
    (ops.rules.select_pages) ascending, -1 past its last; n = most_pages."""
    b, hkv, n_pages = best.shape
    visible = (mask[:, 0, 0, 0] > rules.MASKED)[:, None].expand(b, hkv, mask.shape[-1])
    forced = rules.forced_pages(visible, tokens.sink, tokens.window)
    chosen = rules.select_pages(best, forced, rules.tokens_attended(visible, tokens.ratio, tokens.budget))
    ids = torch.where(chosen, torch.arange(n_pages, device=best.device), n_pages).sort(-1).values
    ids = ids[..., :most_pages(tokens, mask.shape[-1], n_pages)]
    return torch.where(ids < n_pages, ids, -1).to(torch.int32).reshape(b * hkv, -1).contiguous()


def aqua_attention(query, key_cache, value_cache, total: int, mask, k: int, rule: int = 0, softcap: float = 0.0,
                   projection=None, interpret: bool | None = None, splits: int | None = None,
                   tokens: Tokens | None = None, warps: int = 4, stages: int = 2, block: int | None = None):
    """The node on the GPU (or in the interpreter): out [B, Hkv, g, T, rv] in query's dtype. splits: of the
    positions per (sequence, KV head, token); None chooses (split_count). tokens: token selection (a decode step
    scores pages with page_score_kernel and attends the chosen ones with all r coordinates; a prompt attends every
    token with all r). warps, stages, block (positions per block): the main kernel's launch (tools/bench_gpu.py
    tunes them)."""
    r = _check(query, key_cache, value_cache, total, mask, k, rule, projection, tokens)
    b, hkv, g, t, d = query.shape
    cap, rv = key_cache.shape[3], value_cache.shape[3]
    if b * hkv * g * t * rv == 0 or total == 0:
        return query.new_zeros(b, hkv, g, t, rv)
    if interpret is None:
        interpret = not query.is_cuda
    q = query.contiguous()
    p = (projection if projection is not None else q).to(q.dtype).contiguous()  # q: a pointer PROJECT never reads
    kc, vc = key_cache.to(q.dtype).contiguous(), value_cache.to(q.dtype).contiguous()
    mk = mask.to(torch.float32).contiguous()
    mask_batch = 0 if mask.shape[0] == 1 else t * total
    pages, n_pos = q, total
    if tokens is not None and tokens.on:
        if t == 1:
            qs, rows = _select(q, p, r, k, rule, projection is not None, interpret)
            pages = chosen_pages(_page_scores(qs, rows, g, kc, mk, total, mask_batch, softcap, interpret), mk, tokens)
            n_pos = pages.shape[1] * PAGE
        k = r  # the chosen tokens, or a prompt's, are attended with every coordinate
    qs, rows = _select(q, p, r, k, rule, projection is not None, interpret)
    block = block or block_s(max(r, rv))
    n = splits or split_count(b * hkv * t, n_pos, block)
    split_len = -(-(-(-n_pos // n)) // block) * block  # whole blocks
    n = -(-n_pos // split_len)
    o = torch.empty(b * hkv * t * n, g, rv, dtype=torch.float32, device=query.device)
    ml = torch.empty(b * hkv * t * n, g, 2, dtype=torch.float32, device=query.device)
    out = torch.empty(b, hkv, g, t, rv, dtype=query.dtype, device=query.device)
    kernel, _ = _kernel(interpret)
    merge, _ = jit(merge_kernel, interpret)
    with triton_for(interpret):  # the interpreter also reads the mode while it runs
        kernel[(b * hkv * t, n)](qs, rows, kc, vc, mk, pages, o, ml, hkv, t, total, cap, n, split_len, mask_batch,
                                 n_pos, R=r, RV=rv, G=g, SOFTCAP=float(softcap), BLOCK_R=qs.shape[2],
                                 BLOCK_V=next_pow2(rv), BLOCK_S=block, PAGED=pages is not q, PAGE=PAGE,
                                 BLOCK_M=qs.shape[1], IEEE=_ieee(q.dtype, interpret), num_warps=warps,
                                 num_stages=stages)
        merge[(b * hkv * t, g)](o, ml, out, t, n, G=g, RV=rv, BLOCK_N=min(32, next_pow2(n)), BLOCK_V=next_pow2(rv))
    return out


def _select(q, p, r: int, k: int, rule: int, projected: bool, interpret: bool):
    """select_kernel over every (sequence, KV head, token) -> (qs [rows, BLOCK_M, BLOCK_R] float32, rows
    [rows, BLOCK_R] int8); the kernels that read them take BLOCK_M and BLOCK_R from qs's shape."""
    b, hkv, g, t, d = q.shape
    block_m, block_r = max(16, group_block(g)), next_pow2(r)
    qs = torch.empty(b * hkv * t, block_m, block_r, dtype=torch.float32, device=q.device)
    rows = torch.empty(b * hkv * t, block_r, dtype=torch.int8, device=q.device)
    kernel, _ = jit(select_kernel, interpret)
    with triton_for(interpret):
        kernel[(b * hkv * t,)](q, p, qs, rows, t, D=d, R=r, G=g, K=k, RULE=rule, PROJECT=projected, HKV=hkv,
                               BLOCK_G=group_block(g), BLOCK_D=next_pow2(d), CHUNK_D=min(16, next_pow2(d)),
                               BLOCK_R=block_r, BLOCK_M=block_m)
    return qs, rows


def _ieee(dtype, interpret: bool) -> bool:
    """The products in float32 ("ieee", not tf32): for float32 caches, and in the interpreter, whose tl.dot
    reads bfloat16 operands wrongly (Triton 3.9: relative error 1e9); 16-bit operands on a GPU use the tensor
    cores, their probabilities rounded to the cache's dtype as flash attention does."""
    return dtype == torch.float32 or interpret


def _page_scores(qs, rows, g: int, kc, mk, total: int, mask_batch: int, softcap: float,
                 interpret: bool) -> torch.Tensor:
    """page_score_kernel's best [B, Hkv, P] for a decode step (qs, rows: _select's at the node's k)."""
    b, hkv, r, cap = kc.shape
    n_pages = -(-total // PAGE)
    block = block_s(r)
    best = torch.empty(b, hkv, n_pages, dtype=torch.float32, device=kc.device)
    kernel, _ = jit(page_score_kernel, interpret)
    with triton_for(interpret):
        kernel[(b * hkv, -(-total // block))](qs, rows, kc, mk, best, hkv, total, cap, mask_batch, n_pages, R=r,
                                                G=g, SOFTCAP=float(softcap), BLOCK_R=qs.shape[2], BLOCK_S=block,
                                                PAGE=PAGE, BLOCK_M=qs.shape[1], IEEE=_ieee(kc.dtype, interpret))
    return best
