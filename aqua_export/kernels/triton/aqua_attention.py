"""The GPU kernel of AquaAttention, in Triton: the fused node's contract (ops/aqua_attention.py,
plugins/ort/aqua_attention.cc) for the PyTorch host.

    query [B, Hkv, g, T, d] (q^ itself, d = r, when no projection)   projection [Hkv, d, r] (optional)
    key_cache [B, Hkv, r, C] (dim-major K^)   value_cache [B, Hkv, C, rv]   attention_mask [B|1, L]
        -> out [B, Hkv, g, T, rv] = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L]
    (mask: the keys the query at position L - T + t sees, ops.rules.visible, read per block from attention_mask)

A decode step (T = 1): one program per (sequence, KV head, split of the L positions), holding the g query rows of
the group padded to 16 (the tensor cores' smallest M; the two products below are tl.dot):

    select_kernel (select.py), once per (sequence, KV head, token):
        q [g, d] --x P (chunks of d)--> q^ [g, r] --selection--> idx [U]: the group's union of kept coordinates,
        qs [16, U]: q^ there, each row's unkept ones zeroed          (U = k with the group rule)
    per block of 64 positions:  K^[idx, block] (a dense [U, 64] tile: only the union's rows load)
        --> s [16, block] --softcap?, mask--> online softmax (m, l)  -->  o [16, rv] += e^(s - m) V[block]
    --> the split's (o, m, l)

(token selection at a decode step, tokens.py: page_score_kernel scores the pages with the union's rows of K^,
choose_kernel chooses them on the device by ops.rules, and the programs walk only the chosen pages' positions,
all r coordinates) then merge_kernel, one program per (sequence, KV head, token, query row), merges the splits:
out = sum_i o_i e^(m_i - M) / sum_i l_i e^(m_i - M). No [B, Hkv, g, T, L] tensor is written. Splits exist so
that decode at small batch still fills the GPU (flash-decoding). A row hidden everywhere outputs zeros (the CPU
kernel's rule).
A prompt (T > 1) runs prompt.py's tiles instead: 64 rows of one query head per program, over the key blocks its query
block's list holds (every visible one, or those sparse prefill keeps: prefill.py).
triton is imported only when the kernel is built; without a GPU ``interpret=True`` runs it in Triton's
interpreter on the CPU (how the tests check it).
"""

from __future__ import annotations

import torch

from ...ops.spec import PAGE, RULE_NAMES, STATIC
from .pool import pool_cuts
from .prefill import Prefill, block_lists
from .prompt import prompt
from .select import ieee, jit, next_pow2, select, triton_for
from .tokens import Tokens, chosen_pages

tl = selected_rows = key_tile = scores_of = online_step = merge_parts = None  # bound per mode by select.jit

PROGRAMS_WANTED = 1056  # (sequence, KV head, token) programs times splits: 8 per SM of an H100's 132 (bench_gpu --tune)


def aqua_attention_kernel(qs_ptr, idx_ptr, key_ptr, value_ptr, mask_ptr, pages_ptr, o_ptr, ml_ptr,
                          HKV, T, L, C, SPLITS, SPLIT_LEN, MASK_BATCH, WINDOW, N_POS, N_LIST,
                          R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr,
                          BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
                          PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)  # (b * Hkv + h) * T + t
    sp = tl.program_id(1)
    tt = row % T
    bh = row // T
    b = bh // HKV
    v = tl.arange(0, BLOCK_V)
    in_v = v < RV
    m_id = tl.arange(0, BLOCK_M)
    qs, krow, use = selected_rows(qs_ptr, idx_ptr, key_ptr, row, bh, R, C, BLOCK_U, BLOCK_M, IEEE)
    # -- one pass over this split's positions: online softmax and the value product
    value = value_ptr + bh.to(tl.int64) * C * RV
    arow = mask_ptr + b * MASK_BATCH
    hi = L - T + tt  # the query's position: it sees keys up to it, after its window's start
    lo = tl.where(WINDOW > 0, tl.maximum(hi - WINDOW + 1, 0), 0)
    pages = pages_ptr + bh * N_LIST
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    p0 = sp * SPLIT_LEN
    for s0 in range(p0, tl.minimum(N_POS, p0 + SPLIT_LEN), BLOCK_S):  # splits are whole blocks
        kb, s, ok = key_tile(krow, use, s0, pages, N_LIST, C, BLOCK_U, BLOCK_S, PAGED, PAGE)
        sc, vis = scores_of(qs, kb, s, ok, arow, L, lo, hi, SOFTCAP, IEEE)
        sc = tl.where(vis[None, :], sc, float("-inf"))
        vb = tl.load(value + s[:, None] * RV + v[None, :], mask=vis[:, None] & in_v[None, :], other=0.0)
        m, acc, o = online_step(m, acc, o, sc, vb, IEEE)
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
    v = tl.arange(0, BLOCK_V)
    top, den, num = merge_parts(o_ptr, ml_ptr, row * SPLITS, SPLITS, j, tl.full([], float("-inf"), tl.float32),
                                tl.zeros([], tl.float32), tl.zeros([BLOCK_V], tl.float32), G, RV, BLOCK_N, BLOCK_V)
    res = num / tl.where(den > 0.0, den, 1.0)  # hidden rows: 0 / 1
    tl.store(out_ptr + ((bh * G + j) * T + tt) * RV + v, res.to(out_ptr.dtype.element_ty), mask=v < RV)


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


def _check(query, key_cache, value_cache, total: int, mask, k: int, rule: int, projection, tokens, prices) -> int:
    """The shapes the node accepts (the CPU kernel's checks); returns r."""
    if query.dim() != 5 or key_cache.dim() != 4 or value_cache.dim() != 4 or mask.dim() != 2:
        raise ValueError("AquaAttention: expected query [B,Hkv,g,T,d], key_cache [B,Hkv,r,C], value_cache "
                         "[B,Hkv,C,rv] and attention_mask [B,L]")
    b, hkv, _, t, d = query.shape
    r = key_cache.shape[2]
    if projection is not None and tuple(projection.shape) != (hkv, d, r):
        raise ValueError(f"AquaAttention: projection must be [Hkv, d, r] = {(hkv, d, r)}, got {tuple(projection.shape)}")
    if key_cache.shape[:2] != (b, hkv) or value_cache.shape[:2] != (b, hkv) or (projection is None and d != r):
        raise ValueError("AquaAttention: query_hat, key_cache and value_cache disagree on B, Hkv or r")
    if not t <= total <= min(key_cache.shape[3], value_cache.shape[2]) or mask.shape[0] not in (1, b) \
            or mask.shape[1] != total:
        raise ValueError("AquaAttention: total_length must fit both caches and the T new tokens, and attention_mask "
                         "must be [B|1,L]")
    if not 1 <= k <= r or rule not in RULE_NAMES:
        raise ValueError(f"AquaAttention: k must be in [1, r={r}] and rule in {{{', '.join(map(str, RULE_NAMES))}}}")
    if tokens is not None and (not 0 < tokens.ratio <= 1 or min(tokens.budget, tokens.sink, tokens.window) < 0):
        raise ValueError("AquaAttention: token_ratio must be in (0, 1], token_budget, token_sink and token_window "
                         ">= 0")
    if prices is not None and len(prices) != hkv:
        raise ValueError("AquaAttention: head_prices must hold one price per kv head")
    return r


def aqua_attention(query, key_cache, value_cache, total: int, mask, k: int, rule: int = 0, softcap: float = 0.0,
                   projection=None, interpret: bool | None = None, splits: int | None = None,
                   tokens: Tokens | None = None, warps: int = 4, stages: int = 2, block: int | None = None,
                   prices=None, window: int = 0, prefill: Prefill | None = None):
    """The node on the GPU (or in the interpreter): out [B, Hkv, g, T, rv] in query's dtype. splits: of the
    positions per (sequence, KV head, token); None chooses (split_count). tokens: token selection (a decode step
    scores pages with page_score_kernel and attends the chosen ones with all r coordinates; a prompt attends every
    token with all r). warps, stages, block (positions per block): the main kernel's launch (tools/bench_gpu.py
    tunes them). prices: [Hkv], the heads share the layer's k per token (ops.rules, pooled; pool.py): a float32 tensor
    on the device keeps the step free of host copies. mask: attention_mask [B|1, L]; window: the node's
    sliding_window (0: none). A prompt (T > 1) runs prompt.prompt_kernel over prefill.block_lists' key blocks;
    prefill: sparse prefill's attributes, or None (every visible block)."""
    r = _check(query, key_cache, value_cache, total, mask, k, rule, projection, tokens, prices)
    b, hkv, g, t, d = query.shape
    cap, rv = key_cache.shape[3], value_cache.shape[3]
    if b * hkv * g * t * rv == 0 or total == 0:
        return query.new_zeros(b, hkv, g, t, rv)
    if interpret is None:
        interpret = not query.is_cuda
    q = query.contiguous()
    p = (projection if projection is not None else q).to(q.dtype).contiguous()  # q: a pointer PROJECT never reads
    kc, vc = key_cache.to(q.dtype).contiguous(), value_cache.to(q.dtype).contiguous()
    mk = mask.to(torch.int32).contiguous()
    mask_batch = 0 if mask.shape[0] == 1 else total
    pages, n_pos, n_list = q, total, 0
    prompt_exact = tokens is not None and tokens.on and t > 1  # a prompt under token selection: every coordinate
    pool = pool_cuts(q, p, prices, r, k, rule, projection is not None, interpret) \
        if prices is not None and k < r and rule != STATIC and not prompt_exact else None
    if tokens is not None and tokens.on and t == 1:
        # the pages chosen on the k selected coordinates, then attended with every coordinate
        sel, sel_idx, qs, idx = select(q, p, r, k, rule, projection is not None, interpret, full=True, pool=pool)
        pages = chosen_pages(sel, sel_idx, g, kc, mk, total, softcap, tokens, interpret, window)
        n_list = pages.shape[1]
        n_pos = n_list * PAGE
    else:  # a prompt with token selection attends every token with every coordinate
        k = r if prompt_exact else k
        # sparse prefill's estimate reads every coordinate of q^: select's full rows, so the prompt projects once
        sparse = t > 1 and prefill is not None and prefill.on
        qs, idx, *whole = select(q, p, r, k, rule, projection is not None, interpret, full=sparse, pool=pool)
    if t > 1:  # flash attention's tiles over each query block's key blocks (prompt.py)
        qhat = whole[0].view(b, hkv, t, -1, whole[0].shape[2])[..., :g, :r].transpose(2, 3) if whole else q
        lists = block_lists(qhat, kc, mk, total, window, softcap, prefill)
        return prompt(qs, idx, kc, vc, mk, total, g, softcap, window, lists, interpret, query.dtype)
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
        kernel[(b * hkv * t, n)](qs, idx, kc, vc, mk, pages, o, ml, hkv, t, total, cap, n, split_len, mask_batch,
                                 int(window), n_pos, n_list, R=r, RV=rv, G=g, SOFTCAP=float(softcap), BLOCK_U=qs.shape[2],
                                 BLOCK_V=next_pow2(rv), BLOCK_S=block, PAGED=pages is not q, PAGE=PAGE,
                                 BLOCK_M=qs.shape[1], IEEE=ieee(q.dtype, interpret), num_warps=warps,
                                 num_stages=stages)
        merge[(b * hkv * t, g)](o, ml, out, t, n, G=g, RV=rv, BLOCK_N=min(32, next_pow2(n)), BLOCK_V=next_pow2(rv))
    return out
