"""The GPU kernels of H2OAttention, in Triton: the node's contract (ops/h2o_attention.py, plugins/ort/h2o_attention.cc)
on fixed-capacity slot buffers updated in place, for the PyTorch host.

    query_hat [B, Hkv, g, T, r]  key_new [B, Hkv, T, r]  value_new [B, Hkv, T, rv]  attention_mask [B, L]
    (or the query q [B, Hkv, g, T, d] and projection P [Hkv, d, r]: q^ = q P, on the host)
    key [B, Hkv, r, C] (dim-major K^)  value [B, Hkv, C, rv]  heavy [B, Hkv, C] f32  token [B, Hkv, C] i64  (in place)
        -> out [B, Hkv, g, T, rv]

The T new tokens are taken one at a time (what makes a T-token prefill evict exactly as T one-token forwards),
each a step of four launches; the slot passes split the C slots over programs (flash-decoding), so that a
decode step fills the GPU:

    select_kernel (select.py), once for the T tokens: the group's union of selected coordinates, q^ there
    score_kernel   (seq-head, split): K^[union rows, block] (a dense tile) --> s [g, block], kept for the heavy
                   pass; online softmax over the live slots (m, l, o += e^(s - m) V); the split's first free slot
    merge_kernel   (seq-head): the splits merged with the new token itself (its score q^[I] . k^_new) --> out;
                   (M, 1 / L) kept; real? the new token into the first free slot, its heavy = sum_g its weight
    heavy_kernel   (seq-head, split): real? heavy += sum_g e^(s - M) / L over the older live slots; the split's
                   eviction candidate (smallest heavy outside the budget // 2 most recent real tokens; ties: the
                   later token) and live count
    evict_kernel   (seq-head): the splits' candidates merged; real and live > budget(n)? free the candidate

First, tables_kernel computes per sequence ``before`` [B, L + 1] (real tokens before each position) and ``keep``
[B, L] (the budget after the token at each position, rules.budget in float64 as the CPU kernel does), so the
step kernels need no float64 and no prefix sum. triton is imported only when the kernels are built; without a GPU
``interpret=True`` runs them in Triton's interpreter on the CPU (how the tests check them).
"""

from __future__ import annotations

import numpy as np
import torch

from ...ops import rules
from ...ops.spec import FREE, RULE_NAMES
from .select import ieee, jit, next_pow2, select, triton_for

tl = selected_rows = key_tile = capped = products = online_step = merge_parts = least_heavy = None  # select.jit

PROGRAMS_WANTED = 1056  # (sequence, KV head) programs times splits, as aqua_attention's
TABLE_BLOCK = 8192  # positions per step of tables_kernel's running sum: its steps are latency, so few and wide
HEAVY_BLOCK = 256  # slots per block of the heavy pass: vectors only, so long blocks amortise its reductions


def score_kernel(qs_ptr, idx_ptr, key_ptr, value_ptr, token_ptr, sc_ptr, o_ptr, ml_ptr, free_ptr, T, tt, CAP,
                 SPLITS, SPLIT_LEN, R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr,
                 BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr,
                 IEEE: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    qs, krow, use = selected_rows(qs_ptr, idx_ptr, key_ptr, bh * T + tt, bh, R, CAP, BLOCK_U, BLOCK_M, IEEE)
    m_id = tl.arange(0, BLOCK_M)
    v = tl.arange(0, BLOCK_V)
    in_v = v < RV
    value = value_ptr + bh.to(tl.int64) * CAP * RV
    token = token_ptr + bh.to(tl.int64) * CAP
    scores = sc_ptr + (bh.to(tl.int64) * G + m_id[:, None]) * CAP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    free = CAP
    p0 = sp * SPLIT_LEN
    for s0 in range(p0, tl.minimum(CAP, p0 + SPLIT_LEN), BLOCK_S):  # splits are whole blocks
        kb, s, in_s = key_tile(krow, use, s0, token, 0, CAP, BLOCK_U, BLOCK_S, False, 16)
        live = tl.load(token + s, mask=in_s, other=-1) >= 0
        free = tl.minimum(free, tl.min(tl.where(in_s & ~live, s, CAP), axis=0))
        sc = products(qs, kb, SOFTCAP, IEEE)
        tl.store(scores + s[None, :], sc, mask=(m_id < G)[:, None] & in_s[None, :])  # the heavy pass's
        vb = tl.load(value + s[:, None] * RV + v[None, :], mask=live[:, None] & in_v[None, :], other=0.0)
        m, acc, o = online_step(m, acc, o, tl.where(live[None, :], sc, float("-inf")), vb, IEEE)
    part = bh * SPLITS + sp
    in_m = m_id < G
    tl.store(o_ptr + (part * G + m_id[:, None]) * RV + v[None, :], o, mask=in_m[:, None] & in_v[None, :])
    tl.store(ml_ptr + (part * G + m_id) * 2, m, mask=in_m)
    tl.store(ml_ptr + (part * G + m_id) * 2 + 1, acc, mask=in_m)
    tl.store(free_ptr + part, free)


def merge_kernel(qs_ptr, idx_ptr, kn_ptr, vn_ptr, key_ptr, value_ptr, heavy_ptr, token_ptr, mask_ptr, o_ptr, ml_ptr,
                 free_ptr, stat_ptr, slot_ptr, out_ptr, HEADS, T, tt, L, CAP, SPLITS,
                 R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_U: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HEADS
    pos = L - T + tt
    row = bh * T + tt
    v = tl.arange(0, BLOCK_V)
    in_v = v < RV
    i = tl.arange(0, BLOCK_N)
    # the same flag as vectors: Triton's interpreter mis-types (vector & scalar) of booleans
    real = tl.load(mask_ptr + b * L + pos) != 0
    real_v = tl.load(mask_ptr + b * L + pos + v * 0) != 0
    free = CAP
    for n0 in range(0, SPLITS, BLOCK_N):
        part_free = tl.load(free_ptr + bh * SPLITS + n0 + i, mask=n0 + i < SPLITS, other=CAP)
        free = tl.minimum(free, tl.min(part_free, axis=0))
    u = tl.arange(0, BLOCK_U)
    idx = tl.load(idx_ptr + row * BLOCK_U + u)
    kn_sel = tl.load(kn_ptr + row * R + tl.where(idx >= 0, idx, 0), mask=idx >= 0, other=0.0).to(tl.float32)
    vn = tl.load(vn_ptr + row * RV + v, mask=in_v, other=0.0)
    heavy_new = tl.zeros([], tl.float32)
    for j in tl.static_range(G):
        s_new = capped(tl.sum(tl.load(qs_ptr + (row * BLOCK_M + j) * BLOCK_U + u) * kn_sel, axis=0), SOFTCAP)
        # the new token is one more split (m = its score, l = 1, o = its value) when it is real
        top, den, num = merge_parts(o_ptr, ml_ptr, bh * SPLITS, SPLITS, j, tl.where(real, s_new, float("-inf")),
                                    tl.where(real, 1.0, 0.0), tl.where(real_v, vn.to(tl.float32), 0.0), G, RV,
                                    BLOCK_N, BLOCK_V)
        inv = tl.where(den > 0.0, 1.0 / tl.maximum(den, 1e-30), 0.0)  # no live slot: out 0
        tl.store(out_ptr + ((bh * G + j) * T + tt) * RV + v, (num * inv).to(out_ptr.dtype.element_ty), mask=in_v)
        top = tl.where(top > float("-inf"), top, 0.0)
        tl.store(stat_ptr + (bh * G + j) * 2, top)
        tl.store(stat_ptr + (bh * G + j) * 2 + 1, inv)
        heavy_new += tl.where(real, tl.exp(s_new - top) * inv, 0.0)
    # -- real? the new token into the first free slot (the host sized the buffers so that there is one)
    c = tl.arange(0, BLOCK_R)
    key = key_ptr + bh.to(tl.int64) * R * CAP
    real_c = tl.load(mask_ptr + b * L + pos + c * 0) != 0
    tl.store(key + c * CAP + free, tl.load(kn_ptr + row * R + c, mask=c < R), mask=(c < R) & real_c)
    tl.store(value_ptr + (bh.to(tl.int64) * CAP + free) * RV + v, vn, mask=in_v & real_v)
    tl.store(token_ptr + bh.to(tl.int64) * CAP + free, pos.to(tl.int64), mask=real)
    tl.store(heavy_ptr + bh.to(tl.int64) * CAP + free, heavy_new, mask=real)
    tl.store(slot_ptr + bh, tl.where(real, free, -1))


def heavy_kernel(heavy_ptr, token_ptr, sc_ptr, stat_ptr, slot_ptr, mask_ptr, before_ptr, keep_ptr, cand_h_ptr,
                 cand_t_ptr, cand_s_ptr, cand_n_ptr, HEADS, T, tt, L, CAP, SPLITS, SPLIT_LEN, G: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // HEADS
    pos = L - T + tt
    blk = tl.arange(0, BLOCK_S)
    real_s = tl.load(mask_ptr + b * L + pos + blk * 0) != 0
    new = tl.load(slot_ptr + bh)  # the new token's slot (its heavy already final), -1 when not real
    m_id = tl.arange(0, BLOCK_M)
    in_m = m_id < G
    top = tl.load(stat_ptr + (bh * G + m_id) * 2, mask=in_m, other=0.0)
    inv = tl.load(stat_ptr + (bh * G + m_id) * 2 + 1, mask=in_m, other=0.0)
    n = tl.load(before_ptr + b * (L + 1) + pos + 1)
    budget = tl.load(keep_ptr + b * L + pos)
    heavy = heavy_ptr + bh.to(tl.int64) * CAP
    token = token_ptr + bh.to(tl.int64) * CAP
    scores = sc_ptr + (bh.to(tl.int64) * G + m_id[:, None]) * CAP
    best_h = tl.full([], float("inf"), tl.float32)
    best_t = tl.full([], -1, tl.int64)
    best_s = tl.full([], -1, tl.int32)
    n_live = tl.full([], 0, tl.int32)
    p0 = sp * SPLIT_LEN
    end = tl.minimum(CAP, p0 + SPLIT_LEN)
    for s0 in range(p0, end, BLOCK_S):  # blocks of its own size (no tile of K^ here): the split's end masks
        s = s0 + blk
        in_s = s < end
        tk = tl.load(token + s, mask=in_s, other=-1)
        hv = tl.load(heavy + s, mask=in_s, other=0.0)
        is_live = tk >= 0
        old = is_live & (s != new) & real_s
        sc = tl.load(scores + s[None, :], mask=in_m[:, None] & old[None, :], other=0.0)
        w = tl.where(in_m[:, None] & old[None, :], tl.exp(sc - top[:, None]) * inv[:, None], 0.0)
        hv = tl.where(old, hv + tl.sum(w, axis=0), hv)
        tl.store(heavy + s, hv, mask=old)
        # eviction candidates: live, outside the budget // 2 most recent real tokens; the smallest heavy, ties:
        # the later token
        seen_at = tl.load(before_ptr + b * (L + 1) + tk, mask=is_live, other=0)
        cand = is_live & (n - seen_at > budget // 2)
        n_live += tl.sum(is_live.to(tl.int32), axis=0)
        best_h, best_t, best_s = least_heavy(hv, tk, s, cand, best_h, best_t, best_s)
    part = bh * SPLITS + sp
    tl.store(cand_h_ptr + part, best_h)
    tl.store(cand_t_ptr + part, best_t)
    tl.store(cand_s_ptr + part, best_s)
    tl.store(cand_n_ptr + part, n_live)


def evict_kernel(cand_h_ptr, cand_t_ptr, cand_s_ptr, cand_n_ptr, token_ptr, mask_ptr, keep_ptr, HEADS, T, tt, L, CAP,
                 SPLITS, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HEADS
    pos = L - T + tt
    i = tl.arange(0, BLOCK_N)
    best_h = tl.full([], float("inf"), tl.float32)
    best_t = tl.full([], -1, tl.int64)
    best_s = tl.full([], -1, tl.int32)
    n_live = tl.full([], 0, tl.int32)
    for n0 in range(0, SPLITS, BLOCK_N):  # the splits' candidates in slot order, as one pass would meet them
        part = bh * SPLITS + n0 + i
        in_n = n0 + i < SPLITS
        h = tl.load(cand_h_ptr + part, mask=in_n, other=float("inf"))
        t = tl.load(cand_t_ptr + part, mask=in_n, other=-1)
        s = tl.load(cand_s_ptr + part, mask=in_n, other=-1)
        n_live += tl.sum(tl.load(cand_n_ptr + part, mask=in_n, other=0), axis=0)
        best_h, best_t, best_s = least_heavy(h, t, s, in_n & (s >= 0), best_h, best_t, best_s)
    real = tl.load(mask_ptr + b * L + pos) != 0
    budget = tl.load(keep_ptr + b * L + pos)
    tl.store(token_ptr + bh.to(tl.int64) * CAP + best_s, -1, mask=real & (n_live > budget) & (best_s >= 0))


def block_s(cap: int) -> int:
    """Slots per block of the slot passes: 64 (a [64, rv] tile of V, a [U, 64] tile of K^), fewer for a small
    cache (at least 16, tl.dot's smallest N)."""
    return max(16, min(64, next_pow2(cap)))


def tables_kernel(mask_ptr, ratio_ptr, before_ptr, keep_ptr, L, BLOCK: tl.constexpr):
    """One program per sequence: before [L + 1], the real tokens before each position (a running prefix sum in
    blocks), and keep [L], rules.budget after each position's token in float64 (the ratio read as the double it
    is; ceil as truncation plus one where below)."""
    b = tl.program_id(0)
    ratio = tl.load(ratio_ptr)
    tl.store(before_ptr + b * (L + 1), tl.zeros([], tl.int64))
    carry = tl.zeros([], tl.int64)
    for p0 in range(0, L, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        in_p = p < L
        real = (tl.load(mask_ptr + b * L + p, mask=in_p, other=0) != 0).to(tl.int32)
        seen = tl.cumsum(real, axis=0).to(tl.int64) + carry
        tl.store(before_ptr + b * (L + 1) + p + 1, seen, mask=in_p)
        x = seen.to(tl.float64)
        y = ratio * x - 1e-6 * x - 1e-9
        up = y.to(tl.int64)
        tl.store(keep_ptr + b * L + p, tl.maximum(up + (up.to(tl.float64) < y).to(tl.int64), 1), mask=in_p)
        carry += tl.sum(real, axis=0).to(tl.int64)


def slot_tables(mask: torch.Tensor, ratio: float, interpret: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """tables_kernel: before [B, L + 1] int64, keep [B, L] int64 (one launch: torch's int64 prefix sum alone took
    53 us at 32k positions, batch 8, on an H100, and the same kernel in steps of 1024 positions about 100 us)."""
    b, length = mask.shape
    before = torch.empty(b, length + 1, dtype=torch.int64, device=mask.device)
    keep = torch.empty(b, length, dtype=torch.int64, device=mask.device)
    ratio_t = torch.full((1,), ratio, dtype=torch.float64, device=mask.device)
    kernel, _ = jit(tables_kernel, interpret)
    with triton_for(interpret):
        kernel[(b,)](mask, ratio_t, before, keep, length, BLOCK=TABLE_BLOCK, num_warps=16)
    return before, keep


def check_state(token: torch.Tensor, before: torch.Tensor, first: int, ratio: float) -> None:
    """The state the slot search relies on (as the CPU kernel checks): a row holds at most min(n, budget(n))
    live tokens, all at positions before the new ones. token [B, Hkv, C], before [B, L + 1]."""
    n = before[:, first].cpu().numpy()
    limit = torch.from_numpy(np.minimum(n, rules.budget(ratio, n)))[:, None]
    live = (token >= 0).sum(-1).cpu()
    if (live > limit).any() or (token >= first).any():
        raise ValueError("H2OAttention: past_token holds more live slots than the eviction budget allows, or tokens "
                         "not yet seen: the cache is not this graph's state")


def h2o_attention(q, key_new, value_new, past_key, past_value, past_heavy, past_token, mask, k: int, rule: int = 0,
                  softcap: float = 0.0, ratio: float = 0.5, interpret: bool | None = None, projection=None,
                  check: bool = True, block: int | None = None, warps: int = 4, stages: int = 2,
                  heavy_block: int | None = None):
    """The node on the GPU (or in the interpreter): shapes and outputs as ops.h2o_attention.reference's, (out, present_key
    [B, Hkv, C', r] holding dim-major K^, present_value, present_heavy, present_token). When the past already
    has C' slots, present is past: the buffers are updated in place. projection P [Hkv, d, r]: q is the query
    [B, Hkv, g, T, d] and q^ = q P, one float32 batched matmul before the kernel (a [B, Hkv, g, T, r] tensor,
    small beside the slots the kernel reads). check: verify the slot state first (check_state, a device sync);
    a served loop that replays a captured step checks its state once, before capturing, and passes False.
    When the buffers already hold the slots the mask's length can need, no step reads a device value on the host.
    block, warps, stages, heavy_block: the slot passes' launch (tools/bench_gpu.py)."""
    dt = q.dtype
    if projection is not None:
        if projection.dim() != 3 or tuple(projection.shape[:2]) != (q.shape[1], q.shape[-1]):
            raise ValueError(f"H2OAttention: projection must be [Hkv, d, r] for a query of shape {tuple(q.shape)}, "
                             f"got {tuple(projection.shape)}")
        q = q.float() @ projection.float()[:, None]
    b, hkv, g, t, r = q.shape
    c, rv = past_key.shape[2], value_new.shape[-1]
    if key_new.shape != (b, hkv, t, r) or value_new.shape != (b, hkv, t, rv) or past_key.shape != (b, hkv, c, r) \
            or past_value.shape != (b, hkv, c, rv) or past_heavy.shape != (b, hkv, c) or past_token.shape != (b, hkv, c) \
            or mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < t:
        raise ValueError("H2OAttention: the inputs disagree on B, Hkv, T, r or the slots C, or attention_mask is "
                         "shorter than the new tokens")
    if not 1 <= k <= r or rule not in RULE_NAMES or not 0.0 < ratio <= 1.0:
        raise ValueError(f"H2OAttention: k must be in [1, r={r}], rule in {{{', '.join(map(str, RULE_NAMES))}}}, "
                         "ratio in (0, 1]")
    if past_heavy.dtype != torch.float32 or past_token.dtype != torch.int64:
        raise ValueError("H2OAttention: past_heavy must be float32 and past_token int64")
    if interpret is None:
        interpret = not q.is_cuda
    mask = mask.contiguous()
    before, keep = slot_tables(mask, ratio, interpret)
    if check:
        check_state(past_token, before, mask.shape[1] - t, ratio)
    cap = c if c >= rules.slots_needed(ratio, [mask.shape[1]]) else \
        max(c, rules.slots_needed(ratio, before[:, -1].cpu().numpy()))  # the first bound needs no device value
    key, value, heavy, token = past_key, past_value, past_heavy, past_token
    if cap > c:  # widen: keys are dim-major, so the r rows of each head grow from c to cap slots
        key = torch.zeros(b, hkv, r, cap, dtype=dt, device=q.device)
        key[..., :c] = past_key.reshape(b, hkv, r, c)
        key = key.reshape(b, hkv, cap, r)
        value = torch.cat([past_value, past_value.new_zeros(b, hkv, cap - c, rv)], 2)
        heavy = torch.cat([past_heavy, past_heavy.new_zeros(b, hkv, cap - c)], 2)
        token = torch.cat([past_token, past_token.new_full((b, hkv, cap - c), FREE)], 2)
    out = q.new_empty(b, hkv, g, t, rv, dtype=dt)
    if b * hkv * t == 0:
        return out, key, value, heavy, token
    for x in (key, value, heavy, token):
        if not x.is_contiguous():
            raise ValueError("H2OAttention: the slot buffers must be contiguous (they are updated in place)")
    _steps(q.contiguous(), key_new.to(dt).contiguous(), value_new.to(dt).contiguous(), key, value, heavy, token,
           mask, before, keep, out, k, rule, softcap, interpret, block or block_s(cap), warps, stages,
           heavy_block or min(HEAVY_BLOCK, next_pow2(cap)))
    return out, key, value, heavy, token


def _steps(q, kn, vn, key, value, heavy, token, mask, before, keep, out, k: int, rule: int, softcap: float,
           interpret: bool, block: int, warps: int, stages: int, heavy_block: int) -> None:
    """The T new tokens one at a time, each the four launches of the module's diagram (select_kernel once for
    all T). q [B, Hkv, g, T, r] q^; kn, vn the new keys and values in the buffers' dtype; the buffers in place."""
    b, hkv, g, t, r = q.shape
    cap, rv, length = token.shape[2], vn.shape[-1], mask.shape[1]
    qs, idx = select(q, q, r, k, rule, False, interpret)
    rows, block_m, block_u = b * hkv, qs.shape[1], qs.shape[2]
    n = max(1, min(-(-PROGRAMS_WANTED // rows), -(-cap // block)))
    split_len = -(-(-(-cap // n)) // block) * block  # whole blocks
    n = -(-cap // split_len)
    f32, dev = dict(dtype=torch.float32, device=q.device), q.device
    sc, stat = torch.empty(rows, g, cap, **f32), torch.empty(rows, g, 2, **f32)
    o, ml = torch.empty(rows * n, g, rv, **f32), torch.empty(rows * n, g, 2, **f32)
    free, slot = (torch.empty(x, dtype=torch.int32, device=dev) for x in (rows * n, rows))
    cand = [torch.empty(rows * n, dtype=d, device=dev) for d in (torch.float32, torch.int64, torch.int32, torch.int32)]
    kernels = [jit(x, interpret)[0] for x in (score_kernel, merge_kernel, heavy_kernel, evict_kernel)]
    common = dict(RV=rv, G=g, SOFTCAP=float(softcap), BLOCK_U=block_u, BLOCK_M=block_m)
    block_v, block_n = max(16, next_pow2(rv)), min(32, next_pow2(n))
    with triton_for(interpret):  # the interpreter also reads the mode while it runs
        for tt in range(t):
            kernels[0][(rows, n)](qs, idx, key, value, token, sc, o, ml, free, t, tt, cap, n, split_len, R=r,
                                  BLOCK_V=block_v, BLOCK_S=block, IEEE=ieee(key.dtype, interpret), **common,
                                  num_warps=warps, num_stages=stages)
            kernels[1][(rows,)](qs, idx, kn, vn, key, value, heavy, token, mask, o, ml, free, stat, slot, out, hkv,
                                t, tt, length, cap, n, R=r, BLOCK_R=next_pow2(r), BLOCK_V=block_v, BLOCK_N=block_n,
                                **common)
            kernels[2][(rows, n)](heavy, token, sc, stat, slot, mask, before, keep, *cand, hkv, t, tt, length, cap, n,
                                  split_len, G=g, BLOCK_M=block_m, BLOCK_S=heavy_block, num_warps=warps)
            kernels[3][(rows,)](*cand, token, mask, keep, hkv, t, tt, length, cap, n, BLOCK_N=block_n)
