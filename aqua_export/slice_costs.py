"""Each layer's measured costs for allocate's "measured" allocations: runs the reference with one layer changed at a
time and measures how far the next-token distribution moves from dense.

    slice   AQUA-Memory: only layer i's K^ (row 0) or V (row 1) cut to w of its d coordinates
    select  the k allocation: only layer i selecting w of its d coordinates (one rule: the costs depend on it)

    python: add_costs(model, tok, projection, path, texts)        -> layers.{i}.slice_cost stored
            add_select_costs(model, tok, projection, path, texts, selection) -> layers.{i}.select_cost stored
"""

from __future__ import annotations

import torch

from . import corpus
from . import projection as projection_io
from .config import AquaConfig
from .models import attention_geometry
from .reference.attention import apply_aqua
from .reference.precision import float32_compute

SLICE_WIDTHS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)  # of d: where measure_costs cuts a layer
SELECT_WIDTHS = (0.125, 0.25, 0.375, 0.5, 0.75)  # of d: the k measure_select_costs gives a layer


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


def measure_select_costs(model, tok, projection, texts: list[str], selection: str, tokens: int = 512,
                         seq_len: int = 512, progress: bool = False) -> tuple[dict, str]:
    """Each layer's cost of a narrower selection, alone: the mean KL(dense || AQUA) when only that layer selects
    k of its d coordinates under ``selection``, for k in SELECT_WIDTHS * d (every other layer attends densely).
    Returns ({"layers.{i}.select_cost": [n] float32}, "k1,k2,..." for the metadata "select_widths"). Costs L n + 1
    forwards of ``tokens`` tokens."""
    from tqdm import tqdm

    geo = attention_geometry(model)
    n, d = geo["layers"], geo["head_dim"]
    ks = _widths(SELECT_WIDTHS, d)
    costs = Costs(model, tok, projection, texts, tokens, seq_len)
    config = AquaConfig(selection=selection)
    out = {}
    bar = tqdm(total=n * len(ks), desc="selection costs", unit="k", disable=not progress)
    for i in range(n):
        row = []
        for k in ks:
            row.append(costs.kl(config, selected=tuple(k if j == i else d for j in range(n))))
            bar.update(1)
        out[f"layers.{i}.select_cost"] = torch.tensor(row, dtype=torch.float32)
    bar.close()
    return out, ",".join(map(str, ks))


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
        costs, ks = measure_select_costs(model, tok, projection, texts, selection, progress=progress)
    projection_io.write(path, {**projection.tensors(), **costs},
                        {**projection.metadata, "select_widths": ks, "select_rule": selection})
    return projection_io.load_projection(path)
