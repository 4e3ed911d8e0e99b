"""AQUA-Memory's width per layer: one budget, spread over the layers where slicing costs least.

slice_ratio fixes the cache's bytes: L * r with r = d - round(slice_ratio * d), as uniform slicing caches. An
allocation gives layer l a width r_l (K^ and V of that layer, every head) with sum r_l = L * r, so the cache
has the same bytes; each layer's cache is exactly as wide as its r_l (contract.Contract.widths).

    uniform   r_l = r (the paper)
    energy    cost_l(w) = the share of the calibrated energy a width w drops, keys (q/k stack) and values, summed
              over heads: water-filling on retained energy
    measured  cost_l(w) = the mean KL divergence of the next-token distribution when only layer l is cut to w
              (measured on calibration text by ``measure_costs``, stored in the projection artifact as
              layers.{i}.slice_cost at the widths of its metadata "slice_widths", linear in between)

Given the costs, ``water_fill`` starts every layer at the floor (d / 4) and hands out the remaining columns one
at a time to the layer whose cost drops most (exact for convex costs, which both are up to measurement noise).
"""

from __future__ import annotations

import heapq

import torch

from .config import AquaConfig, ConfigError


def layer_widths(config: AquaConfig, projection, layers: int, head_dim: int) -> tuple[int, ...]:
    """r_l per layer for ``config`` (projection: calibrate.Projection; None will do for uniform slicing)."""
    r = config.retained_width(head_dim)
    n = layers
    if config.slice_alloc == "uniform" or r == head_dim:
        return (r,) * n
    if projection is None:
        raise ConfigError(f"--slice-alloc {config.slice_alloc} needs a projection")
    costs = energy_costs(projection) if config.slice_alloc == "energy" else measured_costs(projection, head_dim)
    return water_fill(costs, n * r, floor=min(r, max(1, head_dim // 4)))


def energy_costs(projection) -> torch.Tensor:
    """[L, d + 1]: cost[l, w] = dropped share of the key-side and value-side energy at width w, summed over heads."""
    out = []
    for e_k, e_v in zip(projection.energy, projection.energy_v):
        share = e_k.double() / e_k.double().sum(1, keepdim=True) + e_v.double() / e_v.double().sum(1, keepdim=True)
        kept = torch.nn.functional.pad(share.sum(0).cumsum(0), (1, 0))  # [d + 1]: kept share at width w
        out.append(kept[-1] - kept)
    return torch.stack(out)


def measured_costs(projection, head_dim: int) -> torch.Tensor:
    """[L, d + 1] from the artifact's measured slice costs, linear between the measured widths (0 at d)."""
    if projection.slice_cost is None:
        raise ConfigError("--slice-alloc measured needs slice costs in the projection: calibrate with "
                          "`aqua-export calibrate --slice-costs` (or let the build calibrate)")
    widths = [int(w) for w in projection.metadata["slice_widths"].split(",")] + [head_dim]
    grid = torch.arange(head_dim + 1, dtype=torch.float64)
    out = []
    for cost in projection.slice_cost:
        y = torch.cat([cost.double().clamp_min(0), torch.zeros(1, dtype=torch.float64)])
        x = torch.tensor(widths, dtype=torch.float64)
        # below the narrowest measured width, extend its slope (costs only grow as columns go)
        slope = (y[0] - y[1]) / (x[1] - x[0])
        row = torch.empty(head_dim + 1, dtype=torch.float64)
        for w in range(head_dim + 1):
            j = int(torch.searchsorted(x, grid[w]))
            if j == 0:
                row[w] = y[0] + slope * (x[0] - w)
            else:
                t = (w - x[j - 1]) / (x[j] - x[j - 1])
                row[w] = y[j - 1] + t * (y[j] - y[j - 1])
        out.append(row)
    return torch.stack(out)


def water_fill(costs: torch.Tensor, total: int, floor: int) -> tuple[int, ...]:
    """costs [L, d + 1] (cost of width w, decreasing in w) -> widths, each in [floor, d], summing to ``total``."""
    n, d = costs.shape[0], costs.shape[1] - 1
    if not n * floor <= total <= n * d:
        raise ConfigError(f"a width budget of {total} cannot be spread over {n} layers of {floor}..{d}")
    widths = [floor] * n
    heap = [(-(float(costs[i, floor] - costs[i, floor + 1])), i) for i in range(n) if floor < d]
    heapq.heapify(heap)
    for _ in range(total - n * floor):
        _, i = heapq.heappop(heap)  # ties: the lower layer
        widths[i] += 1
        if widths[i] < d:
            w = widths[i]
            heapq.heappush(heap, (-(float(costs[i, w] - costs[i, w + 1])), i))
    return tuple(widths)


SLICE_WIDTHS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)  # of d: where measure_costs cuts a layer


def measure_costs(model, tok, projection, texts: list[str], tokens: int = 1024, seq_len: int = 512,
                  progress: bool = False) -> tuple[dict, str]:
    """Each layer's cost of slicing, alone: the mean KL(dense || sliced) of the next-token distributions over
    ``tokens`` tokens of ``texts`` (the calibration text) when only that layer caches w of its d coordinates,
    for w in SLICE_WIDTHS * d. Returns ({"layers.{i}.slice_cost": [n] float32}, "w1,w2,..." for the
    artifact's metadata "slice_widths"). Costs L * n + 1 forwards of ``tokens`` tokens."""
    from tqdm import tqdm

    from . import corpus
    from .attention import apply_aqua
    from .models import attention_geometry

    geo = attention_geometry(model)
    n, d = geo["layers"], geo["head_dim"]
    widths = sorted({max(1, round(f * d)) for f in SLICE_WIDTHS} - {d})
    windows = corpus.windows(corpus.tokenize(tok, corpus.read_texts(texts), tokens), seq_len)
    config = AquaConfig()

    def logp(layer_widths_):
        with torch.no_grad(), apply_aqua(model, projection, config, widths=layer_widths_):
            return [torch.log_softmax(model(input_ids=w[None], use_cache=False).logits[0].double(), -1)
                    for w in windows]

    base = logp((d,) * n)
    count = sum(b.shape[0] for b in base)
    out = {}
    bar = tqdm(total=n * len(widths), desc="slice costs", unit="cut", disable=not progress)
    for i in range(n):
        cost = []
        for w in widths:
            cut = logp(tuple(w if j == i else d for j in range(n)))
            cost.append(sum(float((b.exp() * (b - c)).sum()) for b, c in zip(base, cut)) / count)
            bar.update(1)
        out[f"layers.{i}.slice_cost"] = torch.tensor(cost, dtype=torch.float32)
    bar.close()
    return out, ",".join(map(str, widths))


def add_costs(model, tok, projection, path, texts: list[str], progress: bool = True):
    """The projection with measured slice costs (measure_costs on ``texts``), written to ``path`` (atomically)
    and loaded back."""
    from . import calibrate
    from .precision import float32_compute

    with float32_compute(model):
        costs, widths = measure_costs(model, tok, projection, texts, progress=progress)
    tensors = {f"layers.{i}.{k}": getattr(projection, k)[i] for i in range(len(projection.P))
               for k in ("P", "P_v", "energy", "energy_v", "key_rms")}
    calibrate.write(path, {**tensors, **costs}, {**projection.metadata, "slice_widths": widths})
    return calibrate.load_projection(path)
