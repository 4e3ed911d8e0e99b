"""The parity harness's instruments: ReplayProbe in the PyTorch reference (reference.attention.Probe, passed to
``apply_aqua(probe=...)``) and RuntimeRecorder in ONNX Runtime's loop (runtime.lm.Probe, ``OrtLM(probe=...)``).

ReplayProbe replays the coordinate selections and H2O evictions that ONNX Runtime made, so both sides compute under one
choice, and records, for each choice, where the reference's own rule would have chosen otherwise and by how close
a margin. It also records every boundary value (the k-th largest selection score of each query row; the
accumulator of the last heavy hitter kept), so that the float32 reference's own rounding of those values can be
measured against its float64 run, which sets how close a margin counts as a float near-tie.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ops.rules import heavy_margin, page_margin, pages_wanted, pooled_margin, selection_margin, selection_score

NOISE_FACTOR = 10.0  # a bound is at least this many times the reference's float32 error (harness.py says why 10)


class RuntimeRecorder:
    """What ONNX Runtime's loop computed beyond the logits (runtime.lm.Probe): extra, per step() call the graph's
    outputs beyond the contract (a debug graph's TopK indices per layer); live (evictions=True), per token the live
    tokens [B, Hkv, seen] of each layer (AQUA-H2O; a prompt then runs one token at a time)."""

    def __init__(self, evictions: bool = False):
        self.evictions = evictions
        self.extra: list[list[np.ndarray]] = []
        self.live: list[list[np.ndarray]] = []

    def forward(self, extra: list[np.ndarray]) -> None:
        self.extra.append(extra)

    def evicted(self, live: list[np.ndarray]) -> None:
        self.live.append(live)


class ReplayProbe:
    """selections: per forward, per layer the indices [B, Hkv, g, T, k] another implementation kept, or None (the
    reference keeps its own); prompt: the prompt's length (decode step s is the row at position prompt + s). The
    recorded choices of the mechanisms that choose at run time, each under its Probe's gate (settings.base.Probe),
    or None: eviction, per token, per layer the live tokens [B, Hkv, seen] after its step (AQUA-H2O); pages, per
    forward (the prompt's, then each decode step's), per layer its ranked pages [B, Hkv, 1, T, P] (token selection);
    prefill_blocks, per forward, per layer the keys sparse prefill kept [B, Hkv, T, L] (rewrites.selection_outputs'
    pf_keep_rows: ORT's prompt calls, their rows' block choice). Each gate's reader is ``<gate>_summary``. Call
    next_forward() before each forward."""

    def __init__(self, selections: list | None = None, prompt: int = 0, *, eviction: list | None = None,
                 pages: list | None = None, prefill_blocks: list | None = None):
        self.selections, self.evictions, self.page_orders, self.prompt = selections, eviction, pages, prompt
        self.kept_blocks = prefill_blocks  # per forward, per layer sparse prefill's kept keys [B, Hkv, T, L], or None
        self.block_flips: list[tuple[int, int, float]] = []  # per call: sparse rows, rows keeping other keys, gap
        self.block_boundary: list[np.ndarray] = []  # per call: the mass at each sparse row's decision nearest X
        self.page_flips: list[tuple[int, int, float]] = []  # per call: rows, rows choosing other pages, gap
        self.page_reads: list[tuple[int, int]] = []  # per call: the decode rows' visible pages, those left out
        self.page_boundary: list[np.ndarray] = []  # per call: the last page chosen by score, each row
        self.forward = -1
        self.flips: list[tuple[int, int, float]] = []  # per call: rows, rows differing, largest gap among those
        self.evict_flips: list[tuple[int, int, float]] = []  # per token and layer: decisions, differing, gap
        self.boundary: list[np.ndarray] = []  # per call: the k-th largest selection score of each row
        self.heavy: list[np.ndarray] = []  # per token and layer: the last kept heavy hitter's accumulator

    def next_forward(self) -> None:
        self.forward += 1

    def select(self, st, qh: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """own: indices [B, Hkv, g, T, k], or a shared-k layer's keep mask [B, Hkv, g, T, r] (the graph's too)."""
        score = selection_score(qh, st.selection, st.key_rms)
        kth, gap = selection_margin(score, st.k) if st.prices is None else pooled_margin(score, st.k, st.prices)
        self.boundary.append(kth.double().numpy())
        if self.selections is None:
            return own
        forced = torch.from_numpy(self.selections[self.forward][st.index])
        if own.dtype == torch.bool:
            differ = (own != forced).any(-1)
        else:
            differ = (own.sort(-1).values != forced.sort(-1).values).any(-1)
        gap = gap.expand(differ.shape)
        self.flips.append((differ.numel(), int(differ.sum()), float(gap[differ].max()) if differ.any() else 0.0))
        return forced

    def evict(self, st, layer, token: int, visible, acc, budget, own, hidden, real) -> torch.Tensor:
        real_np = real.numpy()
        boundary, gap = heavy_margin(visible.numpy(), acc.numpy(), budget.numpy())
        self.heavy.append(np.where(real_np[:, None], boundary, np.nan))
        if self.evictions is None:
            return own
        live = torch.from_numpy(self.evictions[token][st.index])  # [B, Hkv, token + 1]
        slot_token = layer.pos.clamp_max(token)  # slots of later tokens in this chunk are hidden, kept anyway
        forced = torch.gather(live, 2, slot_token) | hidden
        differ = ((own != forced) & visible).any(-1).numpy() & real_np[:, None]
        self.evict_flips.append((int(real_np.sum()) * visible.shape[1], int(differ.sum()),
                                 float(gap[differ].max()) if differ.any() else 0.0))
        return forced

    def pages(self, st, positions, score, forced, attended, own) -> torch.Tensor:
        kth, gap = page_margin(score, forced, attended)
        self.page_boundary.append(kth.double().numpy())
        if self.page_orders is None:
            return own
        want = pages_wanted(forced, attended)  # [B, Hkv, R]
        chosen = torch.zeros_like(own)
        for j, p in enumerate(positions.tolist()):  # the decode step that computed row p
            order = torch.from_numpy(self.page_orders[p - self.prompt + 1][st.index])[:, :, 0, -1]  # [B, Hkv, P_s]
            rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
            chosen[:, :, j, :order.shape[-1]] = rank < want[:, :, j, None]
        chosen &= score > -torch.inf
        visible = score > -torch.inf
        self.page_reads.append((int(visible.sum()), int((visible & ~chosen).sum())))
        differ = (own != chosen).any(-1)
        self.page_flips.append((differ.numel(), int(differ.sum()), float(gap[differ].max()) if differ.any() else 0.0))
        return chosen

    def blocks(self, st, positions, visible, own, margin, before) -> torch.Tensor:
        """Sparse prefill: the keys ONNX Runtime's prompt call kept replace the rule's own on the rows it computed
        (the reference's one forward over prompt and fed tokens starts where that call did: positions from 0)."""
        sparse = torch.isfinite(before)  # [B, Hkv, R]: rows of sparse blocks
        self.block_boundary.append(before[sparse].numpy())
        if self.kept_blocks is None:
            return own
        keep = torch.from_numpy(self.kept_blocks[0][st.index])  # [B, Hkv, T, L]: the prompt's call
        t, length = keep.shape[2], keep.shape[3]
        if int(positions[0]) != 0 or t > own.shape[2]:
            raise ValueError("parity: sparse prefill's replay needs the reference's forward to start at the prompt")
        forced = own.clone()
        forced[:, :, :t, :length] = visible[:, :, :t, :length] & keep
        differ = (forced != own).any(-1) & sparse
        relative = margin / st.prefill[0]  # of the threshold X, as the bound is relative
        self.block_flips.append((int(sparse.sum()), int(differ.sum()),
                                 float(relative[differ].max()) if differ.any() else 0.0))
        return forced

    # ------------------------------------------------------------------ what parity reads back
    def selection_summary(self, exact: "ReplayProbe | None", floor: float | None) -> dict:
        """Rows whose own selection differs from the replayed one, and whether each is a float near-tie: its
        relative gap between the k-th and (k+1)-th selection score is <= max(floor, NOISE_FACTOR x the relative
        error of the k-th score in this (float32) run against ``exact``'s float64 run)."""
        return _summary(self.flips, "rows", _relative_error(self.boundary, exact.boundary if exact else None), floor)

    def pages_summary(self, exact: "ReplayProbe | None", floor: float | None) -> dict:
        """Decode rows whose own pages differ from the replayed ones, each a near-tie when the relative gap between
        the last page chosen by score and the next is within the bound (as selection_summary); and how many of the
        visible pages the decode rows left out: none means selection was never exercised, which does not pass."""
        out = _summary(self.page_flips, "rows", _relative_error(self.page_boundary,
                                                                 exact.page_boundary if exact else None), floor)
        out["pages_visible"] = sum(v for v, _ in self.page_reads)
        out["pages_dropped"] = sum(d for _, d in self.page_reads)
        if not out["pages_dropped"]:
            out["pass"] = False
        return out

    def prefill_blocks_summary(self, exact: "ReplayProbe | None", floor: float | None) -> dict:
        """Sparse rows whose own key blocks differ from ONNX Runtime's, each a near-tie when the mass kept before
        its nearest decision is within the bound of the threshold (the bound as selection_summary's, from that
        mass's float32 error); and how many rows were sparse at all: none means the choice was never exercised,
        which does not pass."""
        out = _summary(self.block_flips, "rows",
                       _relative_error(self.block_boundary, exact.block_boundary if exact else None), floor)
        if not out["rows"]:
            out["pass"] = False
        return out

    def eviction_summary(self, exact: "ReplayProbe | None", floor: float | None) -> dict:
        """Eviction decisions (sequence x head x token x layer) where the reference's own choice differs from the
        replayed one, gated as selection_summary on the last heavy hitter's accumulator."""
        return _summary(self.evict_flips, "decisions", _relative_error(self.heavy, exact.heavy if exact else None),
                        floor)


def _relative_error(ours: list, exact: list | None) -> float | None:
    """Largest |a - b| / |b| over the finite entries of two runs' records of the same values (None without one)."""
    if exact is None:
        return None
    worst = 0.0
    for a, b in zip(ours, exact, strict=True):
        ok = np.isfinite(a) & np.isfinite(b) & (b != 0)
        if ok.any():
            worst = max(worst, float((np.abs(a - b)[ok] / np.abs(b[ok])).max()))
    return worst


def _summary(flips: list, unit: str, noise: float | None, floor: float | None) -> dict:
    gap = max((f[2] for f in flips if f[1]), default=0.0)
    out = {unit: sum(f[0] for f in flips), f"{unit}_differing": sum(f[1] for f in flips), "max_gap_of_differing": gap}
    if floor is None:  # float16: its rounding reorders close scores; gated elsewhere (parity/gates.py)
        return {**out, "gated": False}
    bound = max(floor, NOISE_FACTOR * (noise or 0.0))
    return {**out, "near_tie": bound, "near_tie_floor": floor, "float32_relative_error": noise, "pass": gap <= bound}
