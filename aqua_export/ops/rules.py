"""The rules every implementation mirrors, defined once: which coordinates a query keeps, which tokens AQUA-H2O keeps,
and how close two choices are (the near-tie margins parity measures). The PyTorch reference calls these; the ONNX
function bodies, the native CPU kernels (plugins/ort/aqua_ops.h) and the Triton kernels (kernels/triton/select.py)
each restate them in their own language, and the op catalogue's tests hold every one of them to these.

Selection (per query row of q^ [..., Hkv, g, T, r]):

    score   magnitude |q^_i|  |  group: sum over the GQA group's g rows of |q^_i|  |  static: r - i (the first k)
            (weighted rules: the score times rms(k^_i))
    keep    the k largest scores; ties go to the lower index
    pooled  (a node with head prices, allocate's k sharing; not the static rule) a layer's heads share one budget:
            per token, the Hkv g' k largest of score * price[kv head] over all (kv head, row, coordinate) of the
            layer (g' = g, or 1 for the group rules' one set per group), scores and products in float32; ties go
            to the lower flat index (kv head, row, coordinate). A row may keep anywhere from 0 to r coordinates.

Token selection (per sequence, KV head and decode step; L visible tokens, scores from the selected coordinates):

    page    PAGE consecutive slots counted from the first slot the step sees (its origin: so where a sequence
            starts in the buffer, after left padding or in a batch of others, cuts its tokens into the same pages);
            its score the largest approximate score of the GQA group's rows over its tokens
    keep    the pages holding the first `sink` and the last `window` visible tokens, then the best-scored others,
            until budget(ratio, L) tokens' worth of pages (or a fixed token budget; ties: the lower page)
    attend  exact scores (all r coordinates) and softmax over the kept pages' visible tokens

Sparse prefill (per sequence, KV head and query block: the call's rows at slots [64 b, 64 b + 64), all g heads):

    sparse  a query block wholly inside the call and before its last PREFILL_TAIL rows; every other row is dense
    sample  its rows at slots p with p mod stride = stride - 1 whose own token is real (attention_mask 1)
    mass    each sampled row's softmax over its visible keys of the estimate q^[I'] . K^[I', j] (I': the row's top
            k' = round(prefill_k_ratio r) of |q^|, soft-capped as the scores), summed per key block of 64 slots,
            averaged over the sampled rows and g heads
    keep    the diagonal block and the first block a sampled row sees, then the others by mass (ties: the lower
            block) while the mass kept before each is below threshold - 1e-6; a block nobody sampled keeps all
    attend  every row of the query block: exact attention over its visible keys in the kept blocks

Visibility (AquaAttention reads the attention mask [B, L], not a [T, L] tensor): a query at position p = L - T + t
sees key j when j <= p, attention_mask[b, j] is 1 and, under a sliding window w > 0, j > p - w.

H2O (per sequence and KV head, after each real token; n real tokens seen):

    budget  max(1, ceil(ratio n)) tokens kept
    keep    the floor(budget / 2) most recent live tokens, and the largest accumulated attention among the others
            (ties: the later token goes)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import counts
from .counts import slots_needed  # noqa: F401  (the H2O node sizes its slots by it)
from .spec import (GROUP, MAGNITUDE, PAGE, PREFILL_BLOCK, PREFILL_TAIL, RULE_NAMES, SCALE_CODES, SELECTIONS, STATIC,
                   int8_scales)

HIDDEN = float(torch.finfo(torch.float32).min)  # a score that softmax weighs 0: a hidden or free slot
MASKED = -1e37  # an attention mask entry at or below this hides its slot (the kernels read it so)


def _magnitude(qh: torch.Tensor) -> torch.Tensor:
    return qh.abs()


def _group(qh: torch.Tensor) -> torch.Tensor:
    return qh.abs().sum(-3, keepdim=True)  # [..., Hkv, 1, T, r]: one set for the g rows


def _static(qh: torch.Tensor) -> torch.Tensor:
    return torch.arange(qh.shape[-1], 0, -1, device=qh.device, dtype=qh.dtype).expand(qh.shape)


SCORES = {MAGNITUDE: _magnitude, GROUP: _group, STATIC: _static}  # rule code -> what the top k is taken of


def visible(attention_mask: torch.Tensor, t: int, window: int = 0) -> torch.Tensor:
    """attention_mask [B, L] (1 = a real token) -> [B, T, L] bool: which keys the T newest positions see (causal,
    padding hidden, within the sliding window when window > 0)."""
    length = attention_mask.shape[-1]
    j = torch.arange(length)
    pos = torch.arange(length - t, length)[:, None]
    ok = (j[None] <= pos) & (attention_mask.bool()[:, None, :])
    if window > 0:
        ok &= j[None] > pos - window
    return ok


def additive_mask(attention_mask: torch.Tensor, t: int, window: int = 0) -> torch.Tensor:
    """visible(...) as the float32 mask added to the scores: [B, 1, 1, T, L], 0 where seen, HIDDEN where not."""
    ok = visible(attention_mask, t, window)
    return torch.where(ok, 0.0, HIDDEN).to(torch.float32)[:, None, None]


def selection_score(qh: torch.Tensor, selection: str, key_rms: torch.Tensor | None = None) -> torch.Tensor:
    """qh [..., Hkv, g, T, r] -> what the top k is taken of: [..., Hkv, g, T, r], or [..., Hkv, 1, T, r] for the
    group rules. selection: a name of spec.SELECTIONS; key_rms [Hkv, r] for the weighted ones."""
    if selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}")
    code, weighted = SELECTIONS[selection]
    if weighted:
        qh = qh * key_rms[:, None, None, :].to(qh.dtype)  # |q^_i w_i| = |q^_i| w_i, w >= 0
    return SCORES[code](qh)


def select_indices(qh: torch.Tensor, k: int, selection: str, key_rms: torch.Tensor | None = None) -> torch.Tensor:
    """qh [..., Hkv, g, T, r] -> indices [..., Hkv, g, T, k] of the coordinates each query keeps (top k of
    selection_score; ties go to the lower index)."""
    assert 1 <= k <= qh.shape[-1]
    idx = torch.sort(selection_score(qh, selection, key_rms), dim=-1, descending=True, stable=True).indices[..., :k]
    return idx.expand(*qh.shape[:-1], k)


def pooled_scores(score: torch.Tensor, prices) -> torch.Tensor:
    """score [..., Hkv, g', T, r] (selection_score), prices [Hkv] -> the priced scores in float32 as [..., T, Hkv g' r]:
    each token's row in the pooled selection's flat index order (kv head, row, coordinate)."""
    *lead, hkv, g, t, r = score.shape
    priced = score.float() * torch.as_tensor(prices, dtype=torch.float32).reshape(hkv, 1, 1, 1)
    return priced.movedim(-2, -4).reshape(*lead, t, hkv * g * r)


def pooled_keep(score: torch.Tensor, k: int, prices) -> torch.Tensor:
    """score [..., Hkv, g', T, r] (selection_score), prices [Hkv] -> keep [..., Hkv, g', T, r] bool: per token the
    Hkv g' k largest priced scores of the layer (the module docstring's pooled selection)."""
    *lead, hkv, g, t, r = score.shape
    flat = pooled_scores(score, prices)
    idx = torch.sort(flat, dim=-1, descending=True, stable=True).indices[..., :hkv * g * k]
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
    return keep.reshape(*lead, t, hkv, g, r).movedim(-4, -2)


def pooled_margin(score: torch.Tensor, k: int, prices) -> tuple[torch.Tensor, torch.Tensor]:
    """selection_margin of the pooled selection: (the layer's K-th largest priced score, its relative margin over
    the (K+1)-th) per token, [..., 1, 1, T], K = Hkv g' k."""
    hkv, g = score.shape[-4:-2]
    kth, gap = selection_margin(pooled_scores(score, prices), hkv * g * k)
    return kth[..., None, None, :], gap[..., None, None, :]


def selection_keep(qh: torch.Tensor, k: int, selection: str, key_rms: torch.Tensor | None = None,
                   prices=None) -> torch.Tensor:
    """qh [..., Hkv, g, T, r] -> keep [..., Hkv, g, T, r] bool: the coordinates each query row keeps (top k per
    row, or pooled over the layer's heads when ``prices`` [Hkv] is given and the rule reads the query)."""
    if prices is None or SELECTIONS[selection][0] == STATIC:
        idx = select_indices(qh, k, selection, key_rms)
        return torch.zeros_like(qh, dtype=torch.bool).scatter_(-1, idx, True)
    return pooled_keep(selection_score(qh, selection, key_rms), k, prices).expand(qh.shape)


def keep_selected(query_hat: torch.Tensor, k: int, rule: int, prices=None) -> torch.Tensor:
    """query_hat [..., Hkv, g, T, r] with every coordinate the node's ``rule`` (a code; pooled under ``prices``)
    does not keep zeroed: the operand of the selected dot product (zeros add exact zeros, so this equals gathering
    the kept coordinates)."""
    if k >= query_hat.shape[-1]:
        return query_hat
    return query_hat * selection_keep(query_hat, k, RULE_NAMES[rule], prices=prices).to(query_hat.dtype)


def selection_margin(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """score [..., r] (selection_score) -> (the k-th largest score of each row, its relative margin over the
    (k+1)-th, (s_k - s_k+1) / s_k): a float near-tie has a margin near rounding error, and two correct
    implementations may keep different coordinates there."""
    top = score.sort(-1, descending=True).values
    kth, nxt = top[..., k - 1], top[..., k]
    return kth, (kth - nxt) / kth.clamp_min(1e-30)


# --------------------------------------------------------------------------------------------
# Token selection
# --------------------------------------------------------------------------------------------

def tokens_attended(visible: torch.Tensor, ratio: float, budget_tokens: int) -> torch.Tensor:
    """visible [..., L] bool -> the tokens a step attends [...] (int64): budget(ratio, L_visible), or the fixed
    budget, at most L_visible."""
    n = visible.sum(-1)
    want = torch.full_like(n, budget_tokens) if budget_tokens else budget(ratio, n)
    return torch.minimum(want, n)


def page_origin(visible: torch.Tensor) -> torch.Tensor:
    """visible [..., L] -> [...] int64: the first slot seen, where page 0 starts (0 when none is)."""
    return visible.to(torch.uint8).argmax(-1) if visible.shape[-1] else visible.sum(-1)


def from_origin(x: torch.Tensor, visible: torch.Tensor, fill) -> torch.Tensor:
    """x [..., L] (broadcast with visible [..., L]) -> [..., P * PAGE]: slot origin + j at j, ``fill`` past the end,
    so that the last axis reshapes into pages."""
    x, visible = torch.broadcast_tensors(x, visible)
    length = x.shape[-1]
    at = torch.arange(length + (-length % PAGE), device=x.device) + page_origin(visible)[..., None]
    got = x.gather(-1, at.clamp_max(max(length - 1, 0))) if length else x
    return torch.where(at < length, got, torch.full_like(got, fill))


def page_scores(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """scores [..., g, L] (the group's approximate scores of one step), visible [..., L] -> [..., P]: each page's
    largest score over its visible tokens and the g rows (-inf for a page with none), P = ceil(L / PAGE), pages
    counted from the origin (page_origin)."""
    s = scores.masked_fill(~visible[..., None, :], -math.inf).amax(-2)
    s = from_origin(s, visible, -math.inf)
    return s.reshape(*s.shape[:-1], -1, PAGE).amax(-1)


def forced_pages(visible: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """visible [..., L] -> [..., P] bool: the pages holding the first ``sink`` or the last ``window`` visible tokens."""
    count = visible.long().cumsum(-1)  # visible tokens up to and including each slot
    total = count[..., -1:] if count.shape[-1] else count.sum(-1, keepdim=True)
    keep = from_origin(visible & ((count <= sink) | (total - count < window)), visible, False)
    return keep.reshape(*keep.shape[:-1], -1, PAGE).any(-1)


def pages_wanted(forced: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """forced [..., P] (forced_pages), attended [...] (tokens_attended) -> the pages a step attends [...]:
    ceil(attended / PAGE), or the forced ones if more."""
    return torch.maximum((attended + PAGE - 1) // PAGE, forced.sum(-1))


def select_pages(score: torch.Tensor, forced: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """score [..., P] (page_scores), forced [..., P] (forced_pages), attended [...] (tokens_attended) -> [..., P]
    bool: the forced pages, then the best-scored others (ties: the lower page) until ceil(attended / PAGE) pages."""
    want = pages_wanted(forced, attended)
    key = torch.where(forced, torch.full_like(score, math.inf), score)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (rank < want[..., None]) & (key > -math.inf)


def page_margin(score: torch.Tensor, forced: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the score of the last page select_pages chose by score, its relative margin over the next one) [...]: where
    the two are within rounding, two correct implementations may keep different pages (nan / inf where no page
    competes: everything kept, or only forced pages)."""
    want = pages_wanted(forced, attended)
    free = forced.sum(-1)
    top = torch.where(forced, torch.full_like(score, -math.inf), score).sort(-1, descending=True).values
    top = torch.nn.functional.pad(top, (0, 2), value=-math.inf)
    at = (want - free - 1).clamp_min(0)[..., None]
    kth, nxt = top.gather(-1, at)[..., 0], top.gather(-1, at + 1)[..., 0]
    ok = (want > free) & torch.isfinite(kth) & torch.isfinite(nxt)
    gap = torch.where(ok, (kth - nxt) / kth.abs().clamp_min(1e-30), torch.full_like(kth, math.inf))
    return torch.where(ok, kth, torch.full_like(kth, math.nan)), gap


def attended_share(n: int, ratio: float, budget_tokens: int, sink: int, window: int) -> float:
    """The share of n visible tokens (no padding) whose slots a decode step reads whole: its pages' slots
    (select_pages' count, the forced pages included), over n. The bytes-read accounting of the tools."""
    visible = torch.ones(1, n, dtype=torch.bool)
    want = int(pages_wanted(forced_pages(visible, sink, window), tokens_attended(visible, ratio, budget_tokens)))
    return min(n, want * PAGE) / n


def pages_dropped(n: int, ratio: float, budget_tokens: int, sink: int, window: int) -> int:
    """Pages of n visible tokens (no padding) that a decode step does not read: what token selection leaves out."""
    visible = torch.ones(1, n, dtype=torch.bool)
    want = int(pages_wanted(forced_pages(visible, sink, window), tokens_attended(visible, ratio, budget_tokens)))
    return max(0, -(-n // PAGE) - want)


def page_tokens(pages: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """pages [..., P] bool (counted from visible's origin), visible [..., L] -> [..., L] bool: the chosen pages'
    slots."""
    length = visible.shape[-1]
    rel = pages.repeat_interleave(PAGE, -1)  # [..., P * PAGE]: by slot - origin
    origin = page_origin(visible).expand(pages.shape[:-1])[..., None]
    at = torch.arange(length, device=pages.device) - origin
    return torch.where(at >= 0, rel.gather(-1, at.clamp_min(0)), torch.zeros_like(at, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# Sparse prefill
# --------------------------------------------------------------------------------------------

def estimate_k(r: int, ratio: float) -> int:
    """The coordinates each estimating row scores with: round(ratio r), in [1, r] (ratio as the node's float32
    attribute holds it, so every implementation rounds the same number)."""
    return max(1, min(r, math.floor(float(np.float32(ratio)) * r + 0.5)))


def prefill_rows(positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """positions [T] (the call's rows' slots, in [start, end)) -> [T] bool: the rows of sparse query blocks."""
    first = positions // PREFILL_BLOCK * PREFILL_BLOCK
    return (first >= start) & (first + PREFILL_BLOCK <= end - PREFILL_TAIL)


def prefill_chosen(estimate: torch.Tensor, visible: torch.Tensor, real: torch.Tensor, positions: torch.Tensor,
                   start: int, end: int, threshold: float, stride: int) -> torch.Tensor:
    """Sparse prefill's choice (the module docstring). estimate [B, Hkv, g, T, L] (float64, soft-capped), visible
    [B, Hkv, T, L] bool, real [B, T] bool (each row's own token is not padding), positions [T] -> [B, Hkv, T, L]
    bool: visible, the rows of sparse blocks hiding the key blocks not kept."""
    return prefill_choice(estimate, visible, real, positions, start, end, threshold, stride)[0]


def prefill_choice(estimate: torch.Tensor, visible: torch.Tensor, real: torch.Tensor, positions: torch.Tensor,
                   start: int, end: int, threshold: float, stride: int) -> tuple:
    """prefill_chosen's answer and how close it came to another: (allowed [B, Hkv, T, L], margin [B, Hkv, T]
    float64, before [B, Hkv, T] float64). Per row, the margin of its query block: the smallest |m - (X - 1e-6)| over
    the masses m kept before each block not forced, in the order taken (a block is taken iff m < X - 1e-6, so a
    float near-tie has a margin near rounding error; inf where no block competes); before: that m (what parity
    compares between its float32 and float64 runs). Rows of dense blocks: inf and nan."""
    b, hkv, g, t, length = estimate.shape
    sparse = prefill_rows(positions, start, end)
    if not bool(sparse.any()):
        none = torch.full((b, hkv, t), math.inf, dtype=torch.float64)
        return visible, none, torch.full_like(none, math.nan)
    sampled = (sparse & (positions % stride == stride - 1))[None] & real  # [B, T]
    nb = -(-length // PREFILL_BLOCK)
    onehot = (positions[:, None] // PREFILL_BLOCK == torch.arange(nb)).to(torch.float64)  # [T, NB]
    p = torch.softmax(estimate.to(torch.float64).masked_fill(~visible[:, :, None], -math.inf), -1).nan_to_num(0.0)
    per_row = key_blocks(p.sum(2) * sampled[:, None, :, None], nb)  # [B, Hkv, T, NB]
    count = (sampled.to(torch.float64) @ onehot) * g  # [B, NBq]
    mass = torch.einsum("tq,bhtk->bhqk", onehot, per_row) / count.clamp_min(1.0)[:, None, :, None]
    seen = torch.einsum("tq,bhtk->bhqk", onehot, key_blocks((visible & sampled[:, None, :, None]).double(), nb)) > 0
    chosen, margin, near = prefill_blocks(mass, seen, count[:, None], threshold)
    rows = chosen[:, :, positions // PREFILL_BLOCK].repeat_interleave(PREFILL_BLOCK, -1)[..., :length]
    per_row = positions // PREFILL_BLOCK
    dense = ~sparse[None, None]
    return (visible & (rows | ~sparse[:, None]), margin[:, :, per_row].masked_fill(dense, math.inf),
            near[:, :, per_row].masked_fill(dense, math.nan))


def prefill_blocks(mass: torch.Tensor, seen: torch.Tensor, count: torch.Tensor, threshold: float,
                   first: int = 0) -> tuple:
    """The keep rule of sparse prefill (the module docstring) on its block statistics, in any float type and on any
    device: mass [..., NBq, NBk] (a query block's mean estimated mass per key block), seen [..., NBq, NBk] bool (a
    sampled row of the query block sees a key of the block), count [..., NBq] (its sampled rows times g); the query
    blocks are blocks first.. first + NBq - 1 of the keys' -> (chosen [..., NBq, NBk] bool, margin [..., NBq] and
    before [..., NBq] float64: prefill_choice's, per block)."""
    nb = mass.shape[-1]
    sink = seen.to(torch.uint8).argmax(-1, keepdim=True)  # the first block a sampled row sees
    blocks = torch.arange(nb, device=mass.device)
    forced = (blocks == blocks[first:first + mass.shape[-2], None]) | (blocks == sink)
    order = torch.sort(torch.where(forced, math.inf, mass), dim=-1, descending=True, stable=True).indices
    ranked = mass.gather(-1, order)
    before = ranked.cumsum(-1) - ranked  # the mass kept before each block, in the order taken
    take = forced.gather(-1, order) | (before < threshold - 1e-6)
    unsampled = (count == 0)[..., None]
    chosen = torch.zeros_like(forced).scatter(-1, order, take) | unsampled
    # the margins: blocks not forced, of query blocks with sampled rows (a key block past the rows' keys has mass 0
    # and competes like any other)
    gap = (before.double() - (threshold - 1e-6)).abs().masked_fill(forced.gather(-1, order) | unsampled, math.inf)
    margin, at = gap.min(-1)
    near = before.double().gather(-1, at[..., None])[..., 0].masked_fill(margin == math.inf, math.nan)
    return chosen, margin, near


def key_blocks(x: torch.Tensor, nb: int) -> torch.Tensor:
    """x [..., L] -> [..., nb]: summed per key block of PREFILL_BLOCK slots."""
    x = torch.nn.functional.pad(x, (0, nb * PREFILL_BLOCK - x.shape[-1]))
    return x.reshape(*x.shape[:-1], nb, PREFILL_BLOCK).sum(-1)


# --------------------------------------------------------------------------------------------
# AQUA-H2O
# --------------------------------------------------------------------------------------------

def budget(ratio: float, n):
    """Tokens kept after n real ones: max(1, ceil(ratio n)). The slack of 1e-6 n below the ceiling makes the ratio
    rounded to float32 (the node's attribute: 0.3 -> 0.30000001) keep what the double it came from keeps (3 of 10,
    not 4); it moves no budget of a two-decimal ratio below 10,000 tokens. n: a torch tensor (-> int64 tensor on its
    device) or anything numpy takes (-> int64 array, counts.budget: the same expression)."""
    if not isinstance(n, torch.Tensor):
        return counts.budget(ratio, n)
    x = n.to(torch.float64)
    return torch.ceil(ratio * x - 1e-6 * x - 1e-9).to(torch.int64).clamp_min(1)


def _scale_table(device) -> torch.Tensor:
    """spec.int8_scales() [256] float32 on ``device``: the scale of each int8 row code, lowest code first."""
    return torch.from_numpy(int8_scales()).to(device)


def _scale_at(amax: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The table index (code - SCALE_CODES[0]) of an int8 row's scale: the smallest table[at] >= amax / 127 (amax /
    127 rounded to float32 once; a row of zeros: the lowest; past the table: the top, its values then saturate);
    amax float32 [...] -> int64 [...]. Counting the table's entries below is exact, so every implementation (the
    QuantizeRows' body's Less / ReduceSum, its native kernel's search) stores the same bytes."""
    at = torch.searchsorted(table, (amax.to(torch.float32) / 127.0).contiguous())
    return at.clamp(max=table.numel() - 1)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., w] float -> [..., w + 1] int8: round(x / s) (half to even, clipped to +-127) and, last, the code c of
    s (_scale_at each row's largest |x|): what an int8 cache stores for a token's K^ column or V row."""
    table = _scale_table(x.device)
    at = _scale_at(x.float().abs().amax(-1), table)
    q = torch.round(x.float() / table[at][..., None]).clamp(-127, 127)
    return torch.cat([q, (at + SCALE_CODES[0])[..., None].float()], -1).to(torch.int8)


def int8_groups(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's activations as int8 per block of the weights' (MatMulQ4A8): x [..., K] -> (q [..., K] float64 of
    the int8 values, s [..., K / block] float64 of float32 scales): s = max |x| / 127 over each block, q = round(x /
    s) (half to even) clipped to +-127, 0 where s is 0; in float32 arithmetic (x's float32 values), so every
    implementation rounds alike."""
    x32 = x.to(torch.float32)
    blocks = x32.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = blocks.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(s == 0, 0.0, torch.round(blocks / torch.where(s == 0, 1.0, s)).clamp(-127, 127))
    return q.reshape(x.shape).double(), s[..., 0].double()


def int8_values(rows: torch.Tensor) -> torch.Tensor:
    """int8_rows' [..., w + 1] -> the float32 values [..., w] they stand for: q s (s = int8_scales()[c])."""
    return rows[..., :-1].float() * _scale_table(rows.device)[rows[..., -1:].long() - SCALE_CODES[0]]


def h2o_keep(visible: torch.Tensor, acc: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Which visible slots survive eviction. visible [B, Hkv, S] bool (slots in token order), acc [B, Hkv, S]
    accumulated attention, budget [B] tokens to keep -> [B, Hkv, S] bool: the floor(half) most recent visible
    slots, and the largest acc among the others (ties -> the lower slot, i.e. the later token goes)."""
    n_recent = (budget // 2)[:, None, None]
    n_heavy = (budget - budget // 2)[:, None, None]
    vis = visible.to(torch.int64)
    from_end = vis.flip(-1).cumsum(-1).flip(-1) - 1  # 0 for the most recent visible slot
    recent = visible & (from_end < n_recent)
    cand = visible & ~recent
    key = torch.where(cand, acc, torch.full_like(acc, -math.inf))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    heavy = cand & (rank < n_heavy)
    return recent | heavy


def heavy_margin(visible, acc, budget) -> tuple[np.ndarray, np.ndarray]:
    """(boundary, gap), each [B, Hkv]: the accumulator of the last heavy hitter the keep rule keeps (the n_heavy-th
    largest among the visible slots outside the floor(budget / 2) most recent), and its relative margin over the
    next one, (a_n - a_n+1) / |a_n|; a float near-tie has a margin near rounding error. Where no slot competes
    for the last place (nothing to evict, or no heavy hitter kept) boundary is nan and gap inf. visible [B, Hkv, S]
    bool, acc [B, Hkv, S], budget [B]."""
    visible, acc = np.asarray(visible, bool), np.asarray(acc, np.float64)
    budget = np.asarray(budget, np.int64)
    n_recent, n_heavy = (budget // 2)[:, None, None], (budget - budget // 2)[:, None]
    from_end = np.cumsum(visible[..., ::-1], -1)[..., ::-1] - 1
    cand = visible & ~(from_end < n_recent)
    vals = -np.sort(np.where(cand, -acc, np.inf), -1)  # descending, -inf past the candidates
    s = vals.shape[-1]
    vals = np.concatenate([vals, np.full(vals.shape[:-1] + (2,), -np.inf)], -1)
    at = np.broadcast_to(np.clip(n_heavy - 1, 0, s)[..., None], vals.shape[:-1] + (1,))
    kth = np.take_along_axis(vals, at, -1)[..., 0]
    nxt = np.take_along_axis(vals, at + 1, -1)[..., 0]
    ok = (n_heavy > 0) & np.isfinite(kth) & np.isfinite(nxt)
    gap = np.where(ok, (kth - np.where(ok, nxt, 0.0)) / np.maximum(np.abs(np.where(ok, kth, 1.0)), 1e-30), np.inf)
    return np.where(ok, kth, np.nan), gap
