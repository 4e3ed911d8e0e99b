"""Sparse prefill on the GPU (ops.rules' sparse prefill, settings/prefill.py): which key blocks each query block of a
prompt attends, as the lists prompt.prompt_kernel walks (one per sequence, KV head and query block; a dense prompt's
lists hold every block its rows can see).

    the sampled rows (every stride-th row of a sparse query block whose own token is real), in chunks small enough
    that no [B, Hkv, g, rows, L] tensor outgrows ESTIMATE_ELEMENTS:
        softcap(q^[top k' of |q^|] . K^[:, :L]) over the row's visible keys --softmax--> summed over the g heads
        and per key block --> mass [B, Hkv, NBq, NB], each query block's mean over its sampled rows and heads;
        seen (a sampled row sees a key of the block), count (sampled rows times g)
    rules.prefill_blocks (the keep rule, as the reference applies it) --> kept [B, Hkv, NBq, NB]; the call's
    dense query blocks (rules.prefill_rows: not wholly inside it, or among its last rows) keep every block
    --> lists [B * Hkv * NBq, N_LIST] int32: the first slots of the kept blocks up to the query block's own (no
        later key is visible to it), ascending, -1 past the last, and their counts

The estimate is PyTorch on the device, in float32 (the CPU kernel's precision); a prompt is not captured in a
CUDA graph, so its host reads N_LIST back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...ops import rules
from ...ops.spec import MAGNITUDE, PREFILL_BLOCK
from ...settings.prefill import K_RATIO, STRIDE, THRESHOLD

ESTIMATE_ELEMENTS = 1 << 25  # float32 estimate scores per chunk (128 MB; the softmax's temporaries about as much)


@dataclass(frozen=True)
class Prefill:
    """The node's sparse prefill attributes (ops/prefill.py ATTRS)."""

    threshold: float = THRESHOLD.default
    stride: int = STRIDE.default
    k_ratio: float = K_RATIO.default

    @property
    def on(self) -> bool:
        return self.threshold < 1.0


def _statistics(qhat, kc, mask, total: int, window: int, softcap: float, prefill: Prefill, rows):
    """The sampled rows' block statistics: qhat [B, Hkv, g, T, r] float32, kc [B, Hkv, r, C], mask [B|1, L] int32,
    rows [S] (the sampled rows' indices in the call) -> (mass summed [B, Hkv, NBq, NB], seen [B|1, NBq, NB] float,
    count [B|1, NBq]), NBq counted from the call's first query block."""
    b, hkv, g, t, r = qhat.shape
    start, nb = total - t, -(-total // PREFILL_BLOCK)
    first, nbq = start // PREFILL_BLOCK, (total - 1) // PREFILL_BLOCK - start // PREFILL_BLOCK + 1
    real = mask[:, :total] != 0  # [B|1, L]
    mass = torch.zeros(b, hkv, nbq, nb, dtype=torch.float32, device=qhat.device)
    seen = torch.zeros(real.shape[0], nbq, nb, dtype=torch.float32, device=qhat.device)
    count = torch.zeros(real.shape[0], nbq, dtype=torch.float32, device=qhat.device)
    keys = kc[..., :total].float()[:, :, None]  # [B, Hkv, 1, r, L]
    k = rules.estimate_k(r, prefill.k_ratio)
    j = torch.arange(total, device=qhat.device)
    step = max(1, ESTIMATE_ELEMENTS // max(1, b * hkv * g * total))
    for at in range(0, rows.numel(), step):
        chunk = rows[at:at + step]
        pos = start + chunk  # [S'] the rows' slots
        est = rules.keep_selected(qhat[:, :, :, chunk], k, MAGNITUDE) @ keys  # [B, Hkv, g, S', L]
        if softcap:
            est = torch.tanh(est / softcap) * softcap
        vis = real[:, None, :] & (j <= pos[:, None]) & real[:, pos, None]  # [B|1, S', L]: its own token real
        if window > 0:
            vis &= j > pos[:, None] - window
        p = torch.softmax(est.masked_fill(~vis[:, None, None], -math.inf), -1).nan_to_num(0.0).sum(2)
        qb = pos // PREFILL_BLOCK - first
        mass.index_add_(2, qb, rules.key_blocks(p, nb))
        seen.index_add_(1, qb, rules.key_blocks(vis.float(), nb))
        count.index_add_(1, qb, real[:, pos].float() * g)
    return mass, seen, count


def block_lists(qhat, kc, mask, total: int, window: int, softcap: float, prefill: Prefill | None):
    """Which key blocks each query block of a prompt call walks (the module docstring): qhat [B, Hkv, g, T, r] (q^
    of the call's rows, the last T of ``total`` positions; any float type; read only under sparse prefill), kc [B,
    Hkv, r, C], mask [B|1, L] int32 -> (lists [B * Hkv * NBq, N_LIST] int32: the kept blocks' first slots ascending,
    -1 past the last; counts [B * Hkv * NBq] int32; NBq). Without sparse prefill, or with no sparse row in the call,
    every block up to the query block's own that its rows' sliding window reaches."""
    b, hkv, g, t, r = qhat.shape
    start, nb = total - t, -(-total // PREFILL_BLOCK)
    first, dev = start // PREFILL_BLOCK, qhat.device
    nbq = (total - 1) // PREFILL_BLOCK - first + 1
    qb = first + torch.arange(nbq, device=dev)  # the call's query blocks
    kb = torch.arange(nb, device=dev)
    kept = (kb <= qb[:, None]).expand(b, hkv, nbq, nb)
    if window > 0:  # a block wholly before the window of the query block's first row in the call
        kept = kept & (kb[None] * PREFILL_BLOCK + PREFILL_BLOCK > torch.clamp(qb * PREFILL_BLOCK, min=start)[:, None]
                       - window + 1)
    positions = torch.arange(start, total, device=dev)
    sparse_rows = rules.prefill_rows(positions, start, total)
    if prefill is not None and prefill.on and bool(sparse_rows.any()):
        rows = torch.nonzero(sparse_rows & (positions % prefill.stride == prefill.stride - 1))[:, 0]
        mass, seen, count = _statistics(qhat.float(), kc, mask, total, window, softcap, prefill, rows)
        chosen, _, _ = rules.prefill_blocks(mass / count.clamp_min(1.0)[:, None, :, None],
                                            (seen > 0)[:, None].expand(b, hkv, nbq, nb), count[:, None],
                                            prefill.threshold, first)
        sparse = rules.prefill_rows(qb * PREFILL_BLOCK, start, total)  # the query blocks' first slots
        kept = kept & (chosen | ~sparse[:, None])
    counts = kept.sum(-1).reshape(-1).to(torch.int32)
    slot = (kb * PREFILL_BLOCK).to(torch.int32)
    far = torch.iinfo(torch.int32).max
    lists = torch.where(kept, slot, far).sort(-1).values[..., :int(counts.max())]  # kept blocks first, ascending
    return torch.where(lists == far, -1, lists).reshape(b * hkv * nbq, -1).contiguous(), counts, nbq
