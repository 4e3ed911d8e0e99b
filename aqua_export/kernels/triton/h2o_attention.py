"""The GPU kernel of H2OAttention, in Triton: the node's contract (ops/h2o_attention.py, plugins/ort/h2o_attention.cc) on
fixed-capacity slot buffers updated in place, for the PyTorch host.

    query_hat [B, Hkv, g, T, r]  key_new [B, Hkv, T, r]  value_new [B, Hkv, T, rv]  attention_mask [B, L]
    (or the query q [B, Hkv, g, T, d] and projection P [Hkv, d, r]: q^ = q P, on the host)
    key [B, Hkv, r, C] (dim-major K^)  value [B, Hkv, C, rv]  heavy [B, Hkv, C] f32  token [B, Hkv, C] i64  (in place)
        -> out [B, Hkv, g, T, rv]

One program per (sequence, KV head); within it the T new tokens are taken one at a time (what makes a
T-token prefill evict exactly as T one-token forwards), each in four passes over the slots in blocks:

    real? --first free slot s (min over blocks)--> K^[:, s] = k^, V[s] = v, token[s] = position, heavy[s] = 0
    selection of the g rows (select.py) --K^ rows of the group's union only-->
      pass 0: running max and sum of exp over the live slots (online softmax)
      pass 1: w = exp(score - max) / sum; out = w @ V; real? heavy += sum_g w
    real? live > budget(n): free the smallest heavy outside the budget // 2 most recent real tokens
          (blockwise argmin, ties: the later token)

The host precomputes, per sequence, ``before`` [B, L + 1] (real tokens before each position) and ``keep``
[B, L] (the budget after the token at each position, rules.budget in float64 as the CPU kernel does), so the
kernel needs no float64 and no prefix sum. triton is imported only when the kernel is built; without a GPU
``interpret=True`` runs it in Triton's interpreter on the CPU (how the tests check it).
"""

from __future__ import annotations

import numpy as np
import torch

from ...ops import rules
from ...ops.spec import FREE, RULE_NAMES
from .select import group_block, jit, next_pow2, triton_for

tl = keep_of = None  # the kernel's free names, bound per mode by select.jit (triton is imported only there)


def h2o_attention_kernel(q_ptr, kn_ptr, vn_ptr, key_ptr, value_ptr, heavy_ptr, token_ptr, mask_ptr,
                         before_ptr, keep_ptr, out_ptr, HEADS, T, L, CAP,
                         R: tl.constexpr, RV: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                         RULE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HEADS
    c = tl.arange(0, BLOCK_R)
    in_r = c < R
    in_v = c < RV  # BLOCK_R covers both widths
    j = tl.arange(0, BLOCK_G)
    in_g = j < G
    blk = tl.arange(0, BLOCK_S)
    key = key_ptr + bh * R * CAP
    value = value_ptr + bh * CAP * RV
    heavy = heavy_ptr + bh * CAP
    token = token_ptr + bh * CAP
    before = before_ptr + b * (L + 1)
    first = L - T
    for tt in range(0, T):
        pos = first + tt
        real = tl.load(mask_ptr + b * L + pos) != 0
        # the same flag as vectors: Triton's interpreter mis-types (vector & scalar) of booleans
        real_r = tl.load(mask_ptr + b * L + pos + c * 0) != 0
        real_s = tl.load(mask_ptr + b * L + pos + blk * 0) != 0
        # -- the new token into the first free slot
        free = CAP
        for s0 in range(0, CAP, BLOCK_S):
            s = s0 + blk
            tk = tl.load(token + s, mask=s < CAP, other=0)
            free = tl.minimum(free, tl.min(tl.where((tk < 0) & (s < CAP), s, CAP), axis=0))
        row = (bh * T + tt) * R
        tl.store(key + c * CAP + free, tl.load(kn_ptr + row + c, mask=in_r), mask=in_r & real_r)
        tl.store(value + free * RV + c, tl.load(vn_ptr + (bh * T + tt) * RV + c, mask=in_v),
                 mask=in_v & real_r)
        tl.store(token + free, pos.to(tl.int64), mask=real)
        tl.store(heavy + free, 0.0, mask=real)
        tl.debug_barrier()
        # -- selection (select.py): coordinate i kept iff fewer than K coordinates beat it (ties: lower index)
        both = in_g[:, None] & in_r[None, :]
        qg = tl.load(q_ptr + ((bh * G + j[:, None]) * T + tt) * R + c[None, :], mask=both,
                     other=0.0).to(tl.float32)
        keep_c = keep_of(qg, c, in_r, R, K, RULE) & in_g[:, None]
        qs = tl.where(keep_c, qg, 0.0)
        rows = tl.max(keep_c.to(tl.int32), axis=0) > 0
        # -- two passes over the slots, the scores computed in each (only the union's rows of K^ load):
        #    0: running max and sum of exp over the live slots; 1: w, out = w @ V, heavy += sum_g w
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK_G], tl.float32)
        o = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
        for p in tl.static_range(2):
            for s0 in range(0, CAP, BLOCK_S):
                s = s0 + blk
                in_s = s < CAP
                live = tl.load(token + s, mask=in_s, other=-1) >= 0
                kb = tl.load(key + c[:, None] * CAP + s[None, :], mask=rows[:, None] & in_s[None, :],
                             other=0.0)
                sc = tl.sum(qs[:, :, None] * kb.to(tl.float32)[None, :, :], axis=1)
                if SOFTCAP > 0.0:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates correctly at both ends
                    sc = (1.0 - 2.0 / (tl.exp(2.0 * sc / SOFTCAP) + 1.0)) * SOFTCAP
                if p == 0:
                    sc = tl.where(live[None, :], sc, float("-inf"))
                    m_new = tl.maximum(m, tl.max(sc, axis=1))
                    seen = m_new > float("-inf")
                    scale = tl.where(seen, tl.exp(m - tl.where(seen, m_new, 0.0)), 0.0)
                    e = tl.where(live[None, :], tl.exp(sc - tl.where(seen, m_new, 0.0)[:, None]), 0.0)
                    acc = acc * scale + tl.sum(e, axis=1)
                    m = m_new
                else:
                    w = tl.where(live[None, :] & in_g[:, None], tl.exp(sc - m[:, None]) * acc[:, None], 0.0)
                    vb = tl.load(value + s[:, None] * RV + c[None, :],
                                 mask=(in_s & live)[:, None] & in_v[None, :], other=0.0).to(tl.float32)
                    o += tl.sum(w[:, :, None] * vb[None, :, :], axis=1)
                    hv = tl.load(heavy + s, mask=in_s, other=0.0)
                    tl.store(heavy + s, hv + tl.sum(w, axis=0), mask=in_s & live & real_s)
            if p == 0:  # from here acc is 1 / sum (0 when no slot is live), m finite
                acc = tl.where(acc > 0.0, 1.0 / tl.maximum(acc, 1e-30), 0.0)
                m = tl.where(m > float("-inf"), m, 0.0)
        tl.store(out_ptr + ((bh * G + j[:, None]) * T + tt) * RV + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=in_g[:, None] & in_v[None, :])
        tl.debug_barrier()
        # -- eviction: blockwise argmin of heavy among the candidates, ties -> the later token
        n = tl.load(before + pos + 1)
        budget = tl.load(keep_ptr + b * L + pos)
        best_h = tl.full([], float("inf"), tl.float32)
        best_t = tl.full([], -1, tl.int64)
        best_s = tl.full([], -1, tl.int32)
        n_live = tl.full([], 0, tl.int64)
        for s0 in range(0, CAP, BLOCK_S):
            s = s0 + blk
            in_s = s < CAP
            tk = tl.load(token + s, mask=in_s, other=-1)
            hv = tl.load(heavy + s, mask=in_s, other=0.0)
            is_live = tk >= 0
            seen_at = tl.load(before + tk, mask=is_live, other=0)
            cand = is_live & (n - seen_at > budget // 2)
            n_live += tl.sum(is_live.to(tl.int64), axis=0)
            h_min = tl.min(tl.where(cand, hv, float("inf")), axis=0)
            at_min = cand & (hv == h_min)
            t_max = tl.max(tl.where(at_min, tk, -1), axis=0)
            s_max = tl.max(tl.where(at_min & (tk == t_max), s, -1), axis=0)
            better = (h_min < best_h) | ((h_min == best_h) & (t_max > best_t))
            best_h = tl.where(better, h_min, best_h)
            best_t = tl.where(better, t_max, best_t)
            best_s = tl.where(better, s_max, best_s)
        tl.store(token + best_s, -1, mask=real & (n_live > budget) & (best_s >= 0))
        tl.debug_barrier()


def _kernel(interpret: bool):
    return jit(h2o_attention_kernel, interpret)


def block_s(g: int, r: int, cap: int) -> int:
    """Slots per block: a program's [g, r, slots] product tile holds <= 8k elements."""
    return max(16, min(next_pow2(cap), 8192 // (group_block(g) * next_pow2(r))))


def _tables(mask: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """before [B, L + 1]: real tokens before each position; keep [B, L]: the budget after each position's token
    (rules.budget, computed where the mask is)."""
    before = torch.nn.functional.pad((mask != 0).long().cumsum(1), (1, 0))
    return before, rules.budget(ratio, before[:, 1:])


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
                  softcap: float = 0.0, ratio: float = 0.5, interpret: bool | None = None, projection=None):
    """The node on the GPU (or in the interpreter): shapes and outputs as ops.h2o_attention.reference's, (out, present_key
    [B, Hkv, C', r] holding dim-major K^, present_value, present_heavy, present_token). When the past already
    has C' slots, present is past: the buffers are updated in place. projection P [Hkv, d, r]: q is the query
    [B, Hkv, g, T, d] and q^ = q P, one float32 batched matmul before the kernel (a [B, Hkv, g, T, r] tensor,
    small beside the slots the kernel reads)."""
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
    before, keep = _tables(mask, ratio)
    check_state(past_token, before, mask.shape[1] - t, ratio)
    cap = max(c, rules.slots_needed(ratio, before[:, -1].cpu().numpy()))
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
    kernel, _ = _kernel(interpret)
    tensors = [x.contiguous() for x in (q, key_new.to(dt), value_new.to(dt))]
    for x in (key, value, heavy, token):
        if not x.is_contiguous():
            raise ValueError("H2OAttention: the slot buffers must be contiguous (they are updated in place)")
    with triton_for(interpret):  # the interpreter also reads the mode while it runs
        kernel[(b * hkv,)](*tensors, key, value, heavy, token, mask.contiguous(), before, keep, out, hkv, t,
                           mask.shape[1], cap, R=r, RV=rv, G=g, K=k, RULE=rule, SOFTCAP=float(softcap),
                           BLOCK_G=group_block(g), BLOCK_R=next_pow2(max(r, rv)),
                           BLOCK_S=block_s(g, max(r, rv), cap))
    return out, key, value, heavy, token
