"""Each layer's measured costs for allocate's "measured" allocations: runs the reference with one layer changed at a
time and measures how far the next-token distribution moves from dense.

    slice   AQUA-Memory: only layer i's K^ (row 0) or V (row 1) cut to w of its d coordinates
    select  the k allocation (one rule: the costs depend on it): only KV head h of layer i selecting w of its d
            coordinates, and the squared selection score its rows drop at w in a dense run (the head's price); then
            only layer i selecting w, its heads pooling at those prices

    python: add_costs(model, tok, projection, path, texts)        -> layers.{i}.slice_cost stored
            add_select_costs(model, tok, projection, path, texts, selection) -> layers.{i}.select_cost,
            select_head_cost and select_head_energy stored
"""

from __future__ import annotations

import torch

from . import corpus
from . import projection as projection_io
from .allocate import prices_of
from .config import AquaConfig
from .models import attention_geometry
from .ops.rules import selection_keep, selection_score
from .reference.attention import apply_aqua
from .reference.precision import float32_compute

SLICE_WIDTHS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)  # of d: where measure_costs cuts a layer
SELECT_HEAD_WIDTHS = (0.125, 0.25, 0.5)  # of d: the k measure_select_costs gives a head (its price)
SELECT_WIDTHS = (0.125, 0.25, 0.375, 0.5, 0.75)  # of d: the k it gives a layer, its heads pooling


class Costs:
    """KL(dense || changed) of the next-token distributions over ``tokens`` tokens of ``texts``, per change."""

    def __init__(self, model, tok, projection, texts: list[str], tokens: int, seq_len: int):
        self.model, self.projection = model, projection
        self.windows = corpus.windows(corpus.tokenize(tok, corpus.read_texts(texts), tokens), seq_len)
        self.base = list(self._log_probs(AquaConfig(), {}))  # kept: every change is compared with it
        self.count = sum(b.shape[0] for b in self.base)

    def _log_probs(self, config: AquaConfig, kwargs: dict):
        """Each window's next-token log-probabilities [T, V] (float64), one window at a time."""
        with torch.no_grad(), apply_aqua(self.model, self.projection, config, **kwargs):
            for w in self.windows:
                yield torch.log_softmax(self.model(input_ids=w[None], use_cache=False).logits[0].double(), -1)

    def kl(self, config: AquaConfig, **kwargs) -> float:
        """The mean KL with apply_aqua(config, **kwargs)."""
        # strict: the generator runs to its end, leaving apply_aqua before the next change enters it
        changed = self._log_probs(config, kwargs)
        return sum(float((b.exp() * (b - c)).sum()) for b, c in zip(self.base, changed, strict=True)) / self.count


def _widths(fractions, d: int) -> list[int]:
    return sorted({max(1, round(f * d)) for f in fractions} - {d})


def measure_costs(model, tok, projection, texts: list[str], tokens: int = 1024, seq_len: int = 512,
                  progress: bool = False) -> tuple[dict, str]:
    """Each layer's cost of slicing, alone: the mean KL(dense || sliced) of the next-token distributions over
    ``tokens`` tokens of ``texts`` (the calibration text) when only that layer's K^ (row 0) or V (row 1) keeps w
    of its d coordinates, for w in SLICE_WIDTHS * d. Returns ({"layers.{i}.slice_cost": [2, n] float32},
    "w1,w2,..." for the artifact's metadata "slice_widths"). Costs 2 L n + 1 forwards of ``tokens`` tokens."""
    from tqdm import tqdm

    geo = attention_geometry(model)
    n, d = geo["layers"], geo["head_dim"]
    widths = _widths(SLICE_WIDTHS, d)
    costs = Costs(model, tok, projection, texts, tokens, seq_len)
    full = (d,) * n
    out = {}
    bar = tqdm(total=2 * n * len(widths), desc="slice costs", unit="cut", disable=not progress)
    for i in range(n):
        cost = [[], []]
        for side in (0, 1):
            for w in widths:
                cut = tuple(w if j == i else d for j in range(n))
                cost[side].append(costs.kl(AquaConfig(), widths=cut if side == 0 else full,
                                           value_widths=full if side == 0 else cut))
                bar.update(1)
        out[f"layers.{i}.slice_cost"] = torch.tensor(cost, dtype=torch.float32)
    bar.close()
    return out, ",".join(map(str, widths))


class OneHead:
    """Probe (reference.attention.Probe): in layer ``layer`` only KV head ``head`` keeps its rule's ``k`` best
    coordinates (its g rows), every other head all r; other layers keep their own choice (the dense one)."""

    evictions = False

    def __init__(self, layer: int, head: int, k: int):
        self.layer, self.head, self.k = layer, head, k

    def select(self, st, qh, own):
        if st.index != self.layer:
            return own
        keep = torch.ones_like(qh, dtype=torch.bool)
        keep[:, self.head] = selection_keep(qh[:, self.head:self.head + 1], self.k, st.selection,
                                            st.key_rms[self.head:self.head + 1])[:, 0]
        return keep


class DroppedEnergy:
    """Probe: records, per layer, KV head and k in ``ks``, the mean over rows and tokens of the squared selection
    scores a row drops at k ([Hkv, n]); selects nothing (every coordinate kept)."""

    evictions = False

    def __init__(self, ks: list[int]):
        self.ks, self.sums, self.rows = ks, {}, {}

    def select(self, st, qh, own):
        s = selection_score(qh, st.selection, st.key_rms).double() ** 2  # [B, Hkv, g', T, r]
        tail = s.sort(-1, descending=True).values.flip(-1).cumsum(-1).flip(-1)  # tail[..., j] = sum of j-th on
        e = torch.stack([tail[..., k] for k in self.ks], -1).sum((0, 2, 3))  # [Hkv, n]
        self.sums[st.index] = self.sums.get(st.index, 0) + e
        self.rows[st.index] = self.rows.get(st.index, 0) + s.shape[0] * s.shape[2] * s.shape[3]
        return torch.ones_like(qh, dtype=torch.bool)

    def energy(self, layer: int) -> torch.Tensor:
        return (self.sums[layer] / self.rows[layer]).float()


def measure_select_costs(model, tok, projection, texts: list[str], selection: str, tokens: int = 512,
                         seq_len: int = 512, progress: bool = False) -> tuple[dict, dict]:
    """The costs --k-alloc measured spreads k by (allocate.py), under ``selection``, on ``tokens`` of ``texts``:
    each KV head's (head_select_costs), then each layer's with its heads pooling at the prices those give: the mean
    KL(dense || AQUA) when only layer i selects k of its d coordinates, k in SELECT_WIDTHS * d. Returns (tensors
    {"layers.{i}.select_cost" [n], "layers.{i}.select_head_cost" / "select_head_energy" [Hkv, m]} float32, the
    metadata {"select_widths", "select_head_widths"}). Costs L (Hkv m + n) + 2 forwards of ``tokens`` tokens."""
    from tqdm import tqdm

    geo = attention_geometry(model)
    n, d = geo["layers"], geo["head_dim"]
    costs = Costs(model, tok, projection, texts, tokens, seq_len)
    heads, head_ks = head_select_costs(costs, n, geo["kv_heads"], d, selection, progress)
    prices = prices_of([heads[f"layers.{i}.select_head_cost"] for i in range(n)],
                       [heads[f"layers.{i}.select_head_energy"] for i in range(n)])
    ks, config = _widths(SELECT_WIDTHS, d), AquaConfig(selection=selection)
    out = dict(heads)
    bar = tqdm(total=n * len(ks), desc="selection costs (layers)", unit="k", disable=not progress)
    for i in range(n):
        row = []
        for k in ks:
            row.append(costs.kl(config, selected=tuple(k if j == i else d for j in range(n)), prices=prices))
            bar.update(1)
        out[f"layers.{i}.select_cost"] = torch.tensor(row, dtype=torch.float32)
    bar.close()
    return out, {"select_widths": ",".join(map(str, ks)), "select_head_widths": ",".join(map(str, head_ks))}


def head_select_costs(costs: Costs, n: int, hkv: int, d: int, selection: str, progress: bool) -> tuple[dict, list]:
    """Each KV head's cost of a narrower selection, alone: the mean KL when only that head of one layer selects k
    (everything else dense), k in SELECT_HEAD_WIDTHS * d, and the squared selection score its rows drop at each k
    in a dense run -> ({"layers.{i}.select_head_cost" / "select_head_energy": [Hkv, m]}, the m widths)."""
    from tqdm import tqdm

    ks = _widths(SELECT_HEAD_WIDTHS, d)
    config, asks = AquaConfig(selection=selection), (d - 1,) * n  # k < d: every layer asks the probe
    dropped = DroppedEnergy(ks)
    costs.kl(config, selected=asks, probe=dropped)
    out = {}
    bar = tqdm(total=n * hkv * len(ks), desc="selection costs (heads)", unit="k", disable=not progress)
    for i in range(n):
        rows = []
        for h in range(hkv):
            rows.append([costs.kl(config, selected=asks, probe=OneHead(i, h, k)) for k in ks])
            bar.update(len(ks))
        out[f"layers.{i}.select_head_cost"] = torch.tensor(rows, dtype=torch.float32)
        out[f"layers.{i}.select_head_energy"] = dropped.energy(i)
    bar.close()
    return out, ks


def add_costs(model, tok, projection, path, texts: list[str], progress: bool = True):
    """The projection with measured slice costs (measure_costs on ``texts``), written to ``path`` (atomically)
    and loaded back."""
    with float32_compute(model):
        costs, widths = measure_costs(model, tok, projection, texts, progress=progress)
    projection_io.write(path, {**projection.tensors(), **costs}, {**projection.metadata, "slice_widths": widths})
    return projection_io.load_projection(path)


def add_select_costs(model, tok, projection, path, texts: list[str], selection: str, progress: bool = True):
    """The projection with measured selection costs for ``selection`` (measure_select_costs on ``texts``), written
    to ``path`` (atomically) and loaded back."""
    with float32_compute(model):
        costs, widths = measure_select_costs(model, tok, projection, texts, selection, progress=progress)
    projection_io.write(path, {**projection.tensors(), **costs},
                        {**projection.metadata, **widths, "select_rule": selection})
    return projection_io.load_projection(path)
