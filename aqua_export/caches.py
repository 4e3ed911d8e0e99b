"""The KV caches the ONNX Runtime loop keeps between forwards, each owning its layout and update.

    SharedCache   one buffer per layer and kind, bound as both past and present (written in place by the
                  graph); the capacity grows in steps, the graph reads only the filled slots
    H2OCache      AQUA-H2O: per-head validity, heavy-hitter statistics, eviction and compaction between tokens
    (concat)      a plain list [key_0, value_0, ...] of exactly the filled slots, replaced by each present

The layouts are contract.Contract's: buffers declared [B, Hkv, slots, r], a key buffer's memory K^ dim-major.
"""

from __future__ import annotations

import numpy as np

from .contract import Contract


class SharedCache:
    """KV buffers shared by a graph's past and present, as OrtValues (contract.Contract, The KV contract).

    keys / values per layer: [B, Hkv, C, r] as declared; a key buffer's memory is K^ dim-major
    [B, Hkv, r, C] (Contract.key_rows). C is the capacity, of which the first ``length`` slots hold
    tokens; it grows in steps of GROW slots (one copy each time), and the graph reads only the filled
    slots, so a larger C costs memory, not time.
    """

    GROW = 256

    def __init__(self, batch: int, contract: Contract, dtype):
        self.batch, self.contract, self.dtype = batch, contract, dtype
        self.capacity = self.length = 0
        self.keys: list = []  # OrtValues over the arrays below (no copy: ORT writes into these arrays)
        self.values: list = []
        self.key_arrays: list[np.ndarray] = []
        self.value_arrays: list[np.ndarray] = []

    def reserve(self, needed: int) -> None:
        import onnxruntime as ort

        if needed <= self.capacity:
            return
        cap = -(-needed // self.GROW) * self.GROW
        ct, n = self.contract, self.length
        ka, va = [], []
        for i in range(ct.layers):
            k = np.zeros(ct.cache_shape(self.batch, cap), self.dtype)
            v = np.zeros(ct.cache_shape(self.batch, cap), self.dtype)
            if n:
                ct.key_rows(k)[..., :n] = ct.key_rows(self.key_arrays[i])[..., :n]
                v[:, :, :n] = self.value_arrays[i][:, :, :n]
            ka.append(k)
            va.append(v)
        self.key_arrays, self.value_arrays, self.capacity = ka, va, cap
        self.keys = [ort.OrtValue.ortvalue_from_numpy(a) for a in ka]
        self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in va]

    def tensors(self) -> list[np.ndarray]:
        """[key_0, value_0, ...] as a concat present of ``length`` slots (copies; for inspection and tests)."""
        ct, out = self.contract, []
        for k, v in zip(self.key_arrays, self.value_arrays):
            out += [ct.key_buffer(ct.key_rows(k)[..., : self.length]), v[:, :, : self.length].copy()]
        return out


class H2OCache:
    """The KV cache of an AQUA-H2O model, evicted between tokens (docs/design.md, AQUA-H2O).

    kv     [key_0, value_0, ...]: buffers [B, Hkv, P, r] (a key's memory is K^ dim-major, Contract.key_rows)
    valid  per layer [B, Hkv, P] bool: the slot holds a real token that was not evicted
    acc    per layer [B, Hkv, P] float32: attention received, summed over the group's query heads
    pos    per layer [B, Hkv, P] int64: which token (0-based, padding counted) a slot holds
    n_real [B]: real (non-padding) tokens each sequence has seen; each sequence keeps ceil(ratio * n_real)
    All layers share one length P (the graph ties them); invalid slots are masked out in the graph.

    Parity harness: ``log`` (a list) receives, per token, each layer's live tokens [B, Hkv, seen] after
    eviction; ``force`` replays such a log instead of deciding (eviction is discontinuous in the
    accumulators, so two implementations are compared under a shared eviction, as for selection).
    """

    def __init__(self, kv: list[np.ndarray], kv_heads: int, ratio: float, log: list | None = None,
                 force: list | None = None):
        b = kv[0].shape[0]
        self.kv, self.ratio = kv, ratio
        n = len(kv) // 2
        self.valid = [np.zeros((b, kv_heads, 0), bool) for _ in range(n)]
        self.acc = [np.zeros((b, kv_heads, 0), np.float32) for _ in range(n)]
        self.pos = [np.zeros((b, kv_heads, 0), np.int64) for _ in range(n)]
        self.n_real = np.zeros(b, np.int64)
        self.seen = 0
        self.log, self.force = log, force
        self.flips: list[tuple[int, int, float]] = []  # under force: (decisions, own differs, largest gap)

    @property
    def length(self) -> int:
        return self.kv[0].shape[2]

    def append_and_evict(self, present: list[np.ndarray], weights: list[np.ndarray], real: np.ndarray) -> None:
        """present: the graph's present.{i}.key/.value (one token appended); weights [B, Hkv, 1, P+1]; real [B]."""
        self.n_real = self.n_real + real
        budget = h2o_budget(self.ratio, self.n_real)
        r3 = real[:, None, None]
        entry = []
        for i in range(len(self.valid)):
            b, h = self.valid[i].shape[:2]
            valid = np.concatenate([self.valid[i], np.broadcast_to(r3, (b, h, 1))], axis=-1)
            acc = np.concatenate([self.acc[i], np.zeros((b, h, 1), np.float32)], axis=-1)
            acc = acc + weights[i][:, :, 0].astype(np.float32) * r3
            self.pos[i] = np.concatenate([self.pos[i], np.full((b, h, 1), self.seen, np.int64)], axis=-1)
            kept = h2o_keep(valid, acc, budget) | ~valid
            if self.force is not None:
                forced = np.take_along_axis(self.force[self.seen][i], self.pos[i], axis=-1) | ~valid
                self.flips.append(eviction_flips(valid, acc, budget, kept, forced, real))
                kept = forced
            self.valid[i] = np.where(r3, valid & kept, valid)
            self.acc[i] = acc
            if self.log is not None:
                live = np.zeros((b, h, self.seen + 1), bool)
                np.put_along_axis(live, self.pos[i], self.valid[i], axis=-1)
                entry.append(live)
        if self.log is not None:
            self.log.append(entry)
        self.seen += 1
        self.kv = list(present)
        self._compact()

    def _compact(self) -> None:
        """Drop slots that no (batch, head) of any layer still uses; the order of live slots is kept."""
        keep = max(int(v.sum(-1).max()) for v in self.valid)
        if keep == self.length:
            return
        for i, v in enumerate(self.valid):
            order = np.argsort(~v, axis=-1, kind="stable")[..., :keep]  # live slots first, in order
            k, val = self.kv[2 * i], self.kv[2 * i + 1]
            rows = np.take_along_axis(Contract.key_rows(k), order[:, :, None, :], axis=-1)
            self.kv[2 * i] = Contract.key_buffer(rows)
            self.kv[2 * i + 1] = np.take_along_axis(val, order[..., None], axis=2)
            for name in ("valid", "acc", "pos"):
                getattr(self, name)[i] = np.take_along_axis(getattr(self, name)[i], order, axis=-1)


def eviction_flips(visible, acc, budget, own, forced, real) -> tuple[int, int, float]:
    """(decisions, decisions where ``own`` differs from ``forced``, largest relative gap at the heavy-hitter
    boundary among those): a float near-tie of two accumulators has a gap near rounding error."""
    visible, acc, own, forced = (np.asarray(x) for x in (visible, acc, own, forced))
    real = np.asarray(real, bool)
    differ = ((own != forced) & visible).any(-1) & real[:, None]
    gap = 0.0
    if differ.any():
        n_recent = np.asarray(budget) // 2
        for b, h in zip(*np.nonzero(differ)):
            from_end = np.cumsum(visible[b, h][::-1])[::-1] - 1
            cand = visible[b, h] & ~(from_end < n_recent[b])
            vals = np.sort(acc[b, h][cand].astype(np.float64))[::-1]
            n_heavy = int(budget[b] - n_recent[b])
            if 0 < n_heavy < len(vals):
                gap = max(gap, float((vals[n_heavy - 1] - vals[n_heavy]) / max(abs(vals[n_heavy - 1]), 1e-30)))
            else:
                gap = float("inf")  # not a boundary question: a real disagreement
    return int(real.sum()) * visible.shape[1], int(differ.sum()), gap


def h2o_budget(ratio: float, n_real: np.ndarray) -> np.ndarray:
    """Tokens each sequence keeps: ceil(ratio * n), at least 1 (as attention.h2o_budget)."""
    return np.maximum(np.ceil(ratio * n_real.astype(np.float64) - 1e-9).astype(np.int64), 1)


def h2o_keep(visible: np.ndarray, acc: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """NumPy twin of attention.h2o_keep: visible [B, H, S] bool, acc [B, H, S], budget [B] -> kept [B, H, S].

    floor(budget / 2) most recent visible slots, then the largest acc among the rest (ties -> lower slot).
    """
    n_recent = (budget // 2)[:, None, None]
    n_heavy = (budget - budget // 2)[:, None, None]
    from_end = np.flip(np.cumsum(np.flip(visible.astype(np.int64), -1), -1), -1) - 1
    recent = visible & (from_end < n_recent)
    cand = visible & ~recent
    key = np.where(cand, acc.astype(np.float64), -np.inf)
    order = np.argsort(-key, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(order.shape[-1]), order.shape), axis=-1)
    return recent | (cand & (rank < n_heavy))
