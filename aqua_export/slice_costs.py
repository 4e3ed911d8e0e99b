"""Each layer's measured cost of AQUA-Memory's slicing (allocate's "measured" allocation): runs the reference with
one layer's K^ or V cut at a time and measures how far the next-token distribution moves.

    python: add_costs(model, tok, projection, path, texts) -> the projection with layers.{i}.slice_cost stored
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


def measure_costs(model, tok, projection, texts: list[str], tokens: int = 1024, seq_len: int = 512,
                  progress: bool = False) -> tuple[dict, str]:
    """Each layer's cost of slicing, alone: the mean KL(dense || sliced) of the next-token distributions over
    ``tokens`` tokens of ``texts`` (the calibration text) when only that layer's K^ (row 0) or V (row 1) keeps w
    of its d coordinates, for w in SLICE_WIDTHS * d. Returns ({"layers.{i}.slice_cost": [2, n] float32},
    "w1,w2,..." for the artifact's metadata "slice_widths"). Costs 2 L n + 1 forwards of ``tokens`` tokens."""
    from tqdm import tqdm

    geo = attention_geometry(model)
    n, d = geo["layers"], geo["head_dim"]
    widths = sorted({max(1, round(f * d)) for f in SLICE_WIDTHS} - {d})
    windows = corpus.windows(corpus.tokenize(tok, corpus.read_texts(texts), tokens), seq_len)
    config = AquaConfig()

    def log_probs(key_widths, value_widths):
        """Each window's next-token log-probabilities [T, V] (float64), one window at a time."""
        with torch.no_grad(), apply_aqua(model, projection, config, widths=key_widths, value_widths=value_widths):
            for w in windows:
                yield torch.log_softmax(model(input_ids=w[None], use_cache=False).logits[0].double(), -1)

    full = (d,) * n
    base = list(log_probs(full, full))  # kept: every cut is compared with it
    count = sum(b.shape[0] for b in base)
    out = {}
    bar = tqdm(total=2 * n * len(widths), desc="slice costs", unit="cut", disable=not progress)
    for i in range(n):
        cost = [[], []]
        for side in (0, 1):
            for w in widths:
                cut_widths = tuple(w if j == i else d for j in range(n))
                cut = log_probs(*((cut_widths, full) if side == 0 else (full, cut_widths)))
                # strict: the cut's generator runs to its end, leaving apply_aqua before the next cut enters it
                kl = sum(float((b.exp() * (b - c)).sum()) for b, c in zip(base, cut, strict=True))
                cost[side].append(kl / count)
                bar.update(1)
        out[f"layers.{i}.slice_cost"] = torch.tensor(cost, dtype=torch.float32)
    bar.close()
    return out, ",".join(map(str, widths))


def add_costs(model, tok, projection, path, texts: list[str], progress: bool = True):
    """The projection with measured slice costs (measure_costs on ``texts``), written to ``path`` (atomically)
    and loaded back."""
    with float32_compute(model):
        costs, widths = measure_costs(model, tok, projection, texts, progress=progress)
    projection_io.write(path, {**projection.tensors(), **costs}, {**projection.metadata, "slice_widths": widths})
    return projection_io.load_projection(path)
