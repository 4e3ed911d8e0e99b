"""Budgets spread where they cost least: AQUA-Memory's widths over the layers and over K^ and V, and the selection
width k over the layers and their heads.

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

The selection width k is spread in two steps (config.k_alloc; k_ratio fixes the average):

  over layers (``layer_selected``): the layers' budgets k_l sum to uniform's sum of round(k_ratio r_l), spread by
    ``water_fill`` on each layer's cost curve (each k_l in [floor, r_l], floor d / 8 or uniform's smallest k);
  over a layer's heads, per decode step (``head_prices``): the layer's Hkv g k_l coordinates are shared by its
    heads, each head's selection scores times its price (ops.rules, pooled), so a step spends them where the
    query's large coordinates are, at the rate a head's dropped scores cost. Not for the static rule (it does not
    read the query) nor AQUA-H2O (its node takes one k per row): those keep k_l per row.

    energy    layers: cost(k) = the share of the q/k stack's calibrated energy beyond the k leading coordinates,
              summed over heads; heads: one price (the pooled selection ranks the scores as they are)
    measured  from the artifact's costs (slice_costs.measure_select_costs, for the rule "select_rule"). Heads first:
              cost_h(k) = the mean KL of the next-token distribution when only KV head h of layer l selects k,
              E_h(k) = the squared selection score its rows drop at k; price_h = sqrt(geometric mean over the
              measured k of cost_h(k) / E_h(k)) (``prices_of``), so the pooled selection keeps the coordinates whose
              dropping would cost most (price^2 score^2 ~ KL). Then layers: cost(k) = the KL when only layer l
              selects k, its heads pooling at those prices (what a step of it then costs), linear in between.

The union u of a step's rows of K^ stays measured (evaluate.union_fraction): under the group rules u is the group's
count, so a step reads exactly uniform's rows in all.
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
    costs = select_energy_costs(projection) if config.k_alloc == "energy" else \
        select_measured_costs(projection, config)
    floor = min(min(uniform), max(1, d // 8))
    return water_fill(costs, sum(uniform), floor, caps=widths)


def head_prices(config: AquaConfig, projection) -> tuple | None:
    """Per layer the KV heads' prices ([Hkv] floats) under which a step's heads share the layer's k (ops.rules,
    pooled), or None where each row selects its own k (uniform allocation, k_ratio 1, the static rule, H2O)."""
    if not config.shares_k:
        return None
    if config.k_alloc == "energy":
        return tuple((1.0,) * p.shape[0] for p in projection.P)
    check_select_costs(projection, config)
    return prices_of(projection.select_head_cost, projection.select_head_energy)


def prices_of(head_cost, head_energy) -> tuple:
    """Per layer [Hkv] prices from each head's measured costs and dropped selection scores ([Hkv, m] per layer,
    at the same widths): sqrt of the geometric mean over the widths of KL per squared score dropped."""
    out = []
    for cost, energy in zip(head_cost, head_energy):
        ratio = cost.double().clamp_min(1e-12) / energy.double().clamp_min(1e-30)  # [Hkv, m]
        out.append(tuple(float(x) for x in ratio.log().mean(-1).exp().sqrt()))
    return tuple(out)


def select_energy_costs(projection) -> torch.Tensor:
    """[L, d + 1]: cost[l, k] = the share of layer l's q/k energy beyond its k leading coordinates, over heads."""
    return energy_costs(projection)[:, 0]


def check_select_costs(projection, config: AquaConfig) -> None:
    if not projection.has_select_costs(config.selection):
        raise ConfigError(f"--k-alloc measured needs selection costs for --selection {config.selection} in the "
                          f"projection: calibrate with `aqua-export calibrate --select-costs {config.selection}` "
                          "(or let the build calibrate)")


def select_measured_costs(projection, config: AquaConfig) -> torch.Tensor:
    """[L, d + 1] from the artifact's measured layer costs (measured with config's rule, the heads pooling),
    linear between the measured widths (0 at d)."""
    check_select_costs(projection, config)
    d = projection.P[0].shape[-1]
    x = [int(w) for w in projection.metadata["select_widths"].split(",")]
    return torch.stack([measured_curve(x, c, d) for c in projection.select_cost])
