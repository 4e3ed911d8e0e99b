"""AQUA-Memory's widths: one budget, spread over the layers, and over K^ and V, where slicing costs least.

slice_ratio fixes the cache's bytes: 2 L r columns per KV head (K^ and V of L layers) with r = d - round(slice_ratio
* d), as uniform slicing caches. An allocation gives layer l a K^ width r_l and a V width rv_l with
sum r_l + sum rv_l = 2 L r, so the cache has the same bytes; each buffer is exactly as wide as its width
(contract.Contract.widths / value_widths).

    uniform   r_l = rv_l = r (the paper)
    energy    cost(w) = the share of the calibrated energy a width w drops, summed over heads: the q/k stack's
              for K^, the values' for V (water-filling on retained energy)
    measured  cost(w) = the mean KL divergence of the next-token distribution when only that layer's K^ (or V)
              is cut to w (measured on calibration text by ``measure_costs``, stored in the projection artifact
              as layers.{i}.slice_cost [2, n] at the widths of its metadata "slice_widths", linear in between)

Given the 2 L cost curves, ``water_fill`` starts every one at the floor (d / 4) and hands out the remaining
columns one at a time to the curve whose cost drops most (exact for convex costs, which both are up to
measurement noise).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from .config import AquaConfig, ConfigError


def layer_widths(config: AquaConfig, projection, layers: int, head_dim: int) -> tuple[tuple, tuple]:
    """(K^ widths, V widths) per layer for ``config`` (projection: projection.Projection; None will do for uniform
    slicing)."""
    r = config.retained_width(head_dim)
    if config.slice_alloc == "uniform" or r == head_dim:
        return (r,) * layers, (r,) * layers
    if projection is None:
        raise ConfigError(f"--slice-alloc {config.slice_alloc} needs a projection")
    costs = energy_costs(projection) if config.slice_alloc == "energy" else measured_costs(projection, head_dim)
    widths = water_fill(costs.reshape(2 * layers, head_dim + 1), 2 * layers * r, floor=min(r, max(1, head_dim // 4)))
    return widths[0::2], widths[1::2]


def energy_costs(projection) -> torch.Tensor:
    """[L, 2, d + 1]: cost[l, side, w] = the share of that side's energy (0: the q/k stack, K^; 1: the values)
    beyond width w, summed over heads."""
    out = []
    for sides in zip(projection.energy, projection.energy_v):
        row = []
        for e in sides:
            share = (e.double() / e.double().sum(1, keepdim=True)).sum(0)
            kept = torch.nn.functional.pad(share.cumsum(0), (1, 0))  # [d + 1]: kept share at width w
            row.append(kept[-1] - kept)
        out.append(torch.stack(row))
    return torch.stack(out)


def measured_costs(projection, head_dim: int) -> torch.Tensor:
    """[L, 2, d + 1] from the artifact's measured slice costs, linear between the measured widths (0 at d)."""
    if projection.slice_cost is None:
        raise ConfigError("--slice-alloc measured needs slice costs in the projection: calibrate with "
                          "`aqua-export calibrate --slice-costs` (or let the build calibrate)")
    x = np.array([int(w) for w in projection.metadata["slice_widths"].split(",")] + [head_dim], np.float64)
    grid = np.arange(head_dim + 1, dtype=np.float64)
    out = []
    for cost in (side for layer in projection.slice_cost for side in layer):
        y = np.append(cost.double().clamp_min(0).numpy(), 0.0)
        row = np.interp(grid, x, y)
        # below the narrowest measured width, extend its slope (costs only grow as columns go)
        below = grid < x[0]
        row[below] = y[0] + (y[0] - y[1]) / (x[1] - x[0]) * (x[0] - grid[below])
        out.append(row)
    return torch.from_numpy(np.stack(out)).reshape(len(projection.slice_cost), 2, head_dim + 1)


def water_fill(costs: torch.Tensor, total: int, floor: int) -> tuple[int, ...]:
    """costs [N, d + 1] (cost of width w, decreasing in w) -> N widths, each in [floor, d], summing to ``total``."""
    n, d = costs.shape[0], costs.shape[1] - 1
    if not n * floor <= total <= n * d:
        raise ConfigError(f"a width budget of {total} cannot be spread over {n} buffers of {floor}..{d}")
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
