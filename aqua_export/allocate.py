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

The selection width k is spread the same way (``layer_selected``, config.k_alloc): k_ratio fixes the average, the
layers' k sum to uniform's sum of round(k_ratio r_l), so under the group rules a step reads exactly the rows of K^
uniform reads (per-head rules: the union of the group's selections, measured). Per layer, not per KV head: the
kernels take k as a node attribute (one per layer), and a per-head k would split every kernel's tile of the
group's rows.

    energy    cost(k) = the share of the q/k stack's calibrated energy beyond the k leading coordinates, summed
              over heads (what a static selection of k drops; the query-aware rules drop less, alike in every layer)
    measured  cost(k) = the mean KL of the next-token distribution when only that layer selects k (its rule, the
              artifact's layers.{i}.select_cost [n] at metadata "select_widths", for the rule "select_rule")
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
    x = [int(w) for w in projection.metadata["slice_widths"].split(",")]
    out = [measured_curve(x, cost, head_dim) for layer in projection.slice_cost for cost in layer]
    return torch.stack(out).reshape(len(projection.slice_cost), 2, head_dim + 1)


def measured_curve(widths: list, cost: torch.Tensor, d: int) -> torch.Tensor:
    """[d + 1] float64: measured costs at ``widths`` (and 0 at d), linear in between; below the narrowest width its
    slope goes on (costs only grow as columns go)."""
    x = np.array(widths + [d], np.float64)
    y = np.append(cost.double().clamp_min(0).numpy(), 0.0)
    grid = np.arange(d + 1, dtype=np.float64)
    row = np.interp(grid, x, y)
    below = grid < x[0]
    row[below] = y[0] + (y[0] - y[1]) / (x[1] - x[0]) * (x[0] - grid[below])
    return torch.from_numpy(row)


def water_fill(costs: torch.Tensor, total: int, floor: int, caps: tuple | None = None) -> tuple[int, ...]:
    """costs [N, d + 1] (cost of width w, decreasing in w) -> N widths, each in [floor, caps[i]] (default d),
    summing to ``total``."""
    n, d = costs.shape[0], costs.shape[1] - 1
    caps = (d,) * n if caps is None else tuple(caps)
    if not (n * floor <= total <= sum(caps) and all(floor <= c <= d for c in caps)):
        raise ConfigError(f"a width budget of {total} cannot be spread over {n} buffers of {floor}..{max(caps)}")
    widths = [floor] * n
    heap = [(-(float(costs[i, floor] - costs[i, floor + 1])), i) for i in range(n) if floor < caps[i]]
    heapq.heapify(heap)
    for _ in range(total - n * floor):
        _, i = heapq.heappop(heap)  # ties: the lower layer
        widths[i] += 1
        if widths[i] < caps[i]:
            w = widths[i]
            heapq.heappush(heap, (-(float(costs[i, w] - costs[i, w + 1])), i))
    return tuple(widths)


def layer_selected(config: AquaConfig, projection, widths: tuple) -> tuple[int, ...]:
    """k per layer for ``config`` over the layers' K^ widths ``widths``: uniform's round(k_ratio r_l), or the same
    total spread by ``water_fill`` on config.k_alloc's cost curves (each k in [floor, r_l], floor d / 8 or uniform's
    smallest k if below)."""
    uniform = tuple(config.selected_of(r) for r in widths)
    if not config.allocates_k or uniform == tuple(widths):
        return uniform
    if projection is None:
        raise ConfigError(f"--k-alloc {config.k_alloc} needs a projection")
    d = projection.P[0].shape[-1]
    costs = select_energy_costs(projection) if config.k_alloc == "energy" else select_measured_costs(projection,
                                                                                                     config)
    floor = min(min(uniform), max(1, d // 8))
    return water_fill(costs, sum(uniform), floor, caps=widths)


def select_energy_costs(projection) -> torch.Tensor:
    """[L, d + 1]: cost[l, k] = the share of layer l's q/k energy beyond its k leading coordinates, over heads."""
    return energy_costs(projection)[:, 0]


def select_measured_costs(projection, config: AquaConfig) -> torch.Tensor:
    """[L, d + 1] from the artifact's measured selection costs (measured with config's rule), linear between the
    measured widths (0 at d)."""
    d = projection.P[0].shape[-1]
    if not projection.has_select_costs(config.selection):
        raise ConfigError(f"--k-alloc measured needs selection costs for --selection {config.selection} in the "
                          f"projection: calibrate with `aqua-export calibrate --select-costs {config.selection}` "
                          "(or let the build calibrate)")
    x = [int(w) for w in projection.metadata["select_widths"].split(",")]
    return torch.stack([measured_curve(x, c, d) for c in projection.select_cost])
