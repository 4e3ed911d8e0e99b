"""Token selection's decode step on the GPU, in Triton: which pages AquaAttention attends (ops.rules' token rules),
chosen on the device with no host round trip, so a step can be captured in a CUDA graph.

    select_kernel (select.py) at the node's k --> qs, idx: the group's union of selected coordinates
    page_score_kernel, per (sequence, KV head, block of positions from the row's origin, ops.rules.page_origin):
        K^[union rows, block] (a dense tile: only the selected rows load)  -->  q^[I] . K^[I, s]
        --> best [B * Hkv, P]: each page's largest score over the group's rows and its visible positions
            count [B * Hkv, P]: each page's visible positions
    choose_kernel, per (sequence, KV head), every page score in registers:
        forced = the pages of the first `sink` and the last `window` visible tokens (prefix sums of count)
        want   = max(ceil(attended / PAGE), forced pages), attended = budget(ratio, visible) or the fixed budget
        the other pages' best-scored want - forced: the threshold found by select.kth_key (a 4-way search on
        the scores' ordered bits), ties at it to the lower page (a prefix sum)
        --> pages [B * Hkv, N_LIST]: the chosen pages ascending, -1 past the last (N_LIST = most_pages)
    chosen_pages: those pages as their first slots (origin + PAGE page), what the attention walks

aqua_attention then walks only those pages' positions with every coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops import rules
from ...ops.spec import PAGE
from .select import ieee, jit, next_pow2, triton_for

# the kernels' free names, bound per mode by select.jit
tl = selected_rows = key_tile = scores_of = ordered_key = kth_key = None

SCORE_BLOCK = 256  # positions per page_score_kernel program: a [32, 256] bfloat16 tile of K^ is 16 KB


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


def page_score_kernel(qs_ptr, idx_ptr, key_ptr, mask_ptr, origin_ptr, best_ptr, count_ptr, HKV, L, C, MASK_BATCH,
                      WINDOW, N_PAGES,
                      R: tl.constexpr, G: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_U: tl.constexpr,
                      BLOCK_S: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    bh = tl.program_id(0)  # a decode step: T = 1, so select_kernel's row is the (sequence, KV head)
    blk = tl.program_id(1)
    qs, krow, use = selected_rows(qs_ptr, idx_ptr, key_ptr, bh, bh, R, C, BLOCK_U, BLOCK_M, IEEE)
    origin = tl.load(origin_ptr + tl.where(MASK_BATCH > 0, bh // HKV, 0))  # positions (and pages) counted from it
    kb, s, ok = key_tile(krow + origin, use, blk * BLOCK_S, qs_ptr, 0, C - origin, BLOCK_U, BLOCK_S, False, PAGE)
    lo = tl.where(WINDOW > 0, tl.maximum(L - WINDOW, 0), 0)  # the step's position is L - 1
    sc, vis = scores_of(qs, kb, s + origin, ok, mask_ptr + (bh // HKV) * MASK_BATCH, L, lo, L - 1, SOFTCAP, IEEE)
    sc = tl.where((tl.arange(0, BLOCK_M) < G)[:, None] & vis[None, :], sc, float("-inf"))
    best = tl.max(tl.reshape(tl.max(sc, axis=0), [BLOCK_S // PAGE, PAGE]), axis=1)
    count = tl.sum(tl.reshape(vis.to(tl.int32), [BLOCK_S // PAGE, PAGE]), axis=1)
    page = blk * (BLOCK_S // PAGE) + tl.arange(0, BLOCK_S // PAGE)
    tl.store(best_ptr + bh * N_PAGES + page, best, mask=page < N_PAGES)
    tl.store(count_ptr + bh * N_PAGES + page, count, mask=page < N_PAGES)


def choose_kernel(best_ptr, count_ptr, pages_ptr, N_PAGES, N_LIST, RATIO, BUDGET, SINK, WINDOW,
                  BLOCK_P: tl.constexpr, PAGE: tl.constexpr):
    bh = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    in_p = p < N_PAGES
    score = tl.load(best_ptr + bh * N_PAGES + p, mask=in_p, other=float("-inf"))
    count = tl.load(count_ptr + bh * N_PAGES + p, mask=in_p, other=0)
    seen = tl.cumsum(count, axis=0)  # visible tokens up to the end of each page
    total = tl.sum(count, axis=0)
    forced = (count > 0) & ((seen - count < SINK) | (seen > total - WINDOW))
    # attended: the fixed budget, or rules.budget in float64 (ceil as truncation plus one where below)
    x = total.to(tl.float64)
    y = tl.cast(RATIO, tl.float64) * x - 1e-6 * x - 1e-9
    up = y.to(tl.int64)
    attended = tl.where(BUDGET > 0, BUDGET, tl.maximum(up + (up.to(tl.float64) < y).to(tl.int64), 1))
    attended = tl.minimum(attended, total)
    n_forced = tl.sum(forced.to(tl.int32), axis=0)
    need = tl.maximum((attended + PAGE - 1) // PAGE, n_forced) - n_forced
    cand = in_p & ~forced & (score > float("-inf"))
    key = ordered_key(score)
    lo = kth_key(key, cand, need)  # the need-th largest candidate score
    above = cand & (key > lo)
    tie = cand & (key == lo)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1  # ties go to the lower page
    chosen = forced | above | (tie & (tie_rank < need - n_above))  # need 0: lo climbs past every key
    place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    n = tl.sum(chosen.to(tl.int32), axis=0)
    out = pages_ptr + bh * N_LIST
    tl.store(out + place, p, mask=chosen & (place < N_LIST))  # disjoint from the -1s below
    tl.store(out + p, tl.full([BLOCK_P], -1, tl.int32), mask=(p >= n) & (p < N_LIST))


def most_pages(tokens: Tokens, total: int, n_pages: int) -> int:
    """The most pages any row of a step over ``total`` positions can choose (ops.rules.pages_wanted's bound, from
    host integers: no device sync, so a step can be captured in a CUDA graph): the attended tokens' pages plus
    the forced sink and window pages, each run possibly straddling one more page."""
    attended = tokens.budget if tokens.budget else int(rules.budget(tokens.ratio, total))
    forced = -(-tokens.sink // PAGE) + -(-tokens.window // PAGE) + 2
    return max(1, min(n_pages, -(-min(attended, total) // PAGE) + forced))


def page_origin(mask, total: int, window: int = 0):
    """attention_mask [B|1, L] -> [B|1] int32: each row's first slot a decode step sees (ops.rules.page_origin), on
    the device (no host sync)."""
    vis = mask[:, :total] != 0
    if window > 0:
        vis[:, :max(total - window, 0)] = False
    return torch.where(vis.any(-1), vis.to(torch.int32).argmax(-1), 0).to(torch.int32)


def page_scores(qs, idx, g: int, kc, mask, total: int, softcap: float, interpret: bool, window: int = 0,
                origin=None):
    """page_score_kernel: qs, idx (select.select at the node's k), kc [B, Hkv, r, C], attention_mask [B|1, L] int32,
    the sliding window, origin (page_origin) -> (best [B * Hkv, P] float32, count [B * Hkv, P] int32),
    P = ceil(L / PAGE) pages from each row's origin."""
    b, hkv, r, cap = kc.shape
    origin = page_origin(mask, total, window) if origin is None else origin
    n_pages = -(-total // PAGE)
    best = torch.empty(b * hkv, n_pages, dtype=torch.float32, device=kc.device)
    count = torch.empty(b * hkv, n_pages, dtype=torch.int32, device=kc.device)
    kernel, _ = jit(page_score_kernel, interpret)
    with triton_for(interpret):
        kernel[(b * hkv, -(-total // SCORE_BLOCK))](
            qs, idx, kc, mask, origin, best, count, hkv, total, cap, 0 if mask.shape[0] == 1 else total, int(window), n_pages,
            R=r, G=g, SOFTCAP=float(softcap), BLOCK_U=qs.shape[2], BLOCK_S=SCORE_BLOCK, PAGE=PAGE, BLOCK_M=qs.shape[1],
            IEEE=ieee(kc.dtype, interpret))
    return best, count


def choose(best: torch.Tensor, count: torch.Tensor, tokens: Tokens, total: int, interpret: bool) -> torch.Tensor:
    """choose_kernel: best, count [rows, P] (page_scores) -> [rows, N_LIST] int32, each row's chosen pages
    (ops.rules.select_pages) ascending, -1 past its last; N_LIST = most_pages."""
    rows, n_pages = best.shape
    n_list = most_pages(tokens, total, n_pages)
    pages = torch.empty(rows, n_list, dtype=torch.int32, device=best.device)
    block = next_pow2(n_pages)
    kernel, _ = jit(choose_kernel, interpret)
    with triton_for(interpret):
        kernel[(rows,)](best, count, pages, n_pages, n_list, float(tokens.ratio), int(tokens.budget),
                        int(tokens.sink), int(tokens.window), BLOCK_P=block, PAGE=PAGE,
                        num_warps=max(4, min(16, block // 512)))
    return pages


def chosen_pages(qs, idx, g: int, kc, mask, total: int, softcap: float, tokens: Tokens,
                 interpret: bool, window: int = 0) -> torch.Tensor:
    """A decode step's chosen pages as their first slots [B * Hkv, N_LIST] int32 (page_scores, then choose), -1 past
    each row's last."""
    origin = page_origin(mask, total, window)
    best, count = page_scores(qs, idx, g, kc, mask, total, softcap, interpret, window, origin)
    pages = choose(best, count, tokens, total, interpret)
    hkv = kc.shape[1]
    first = origin.repeat_interleave(hkv) if mask.shape[0] > 1 else origin.expand(pages.shape[0])
    return torch.where(pages >= 0, first[:, None] + pages * PAGE, -1).to(torch.int32)
