"""AQUA-H2O: the cache keeps a share of the tokens, evicting by accumulated attention (ops.rules.h2o_keep)."""

from __future__ import annotations

from .base import Mechanism, Setting

RATIO = Setting("h2o_ratio", float, 1.0, "AQUA-H2O: share of tokens kept in the cache, in (0, 1]; 1 = no eviction",
                interval=(0.0, 1.0, True, False))


def evicts(cfg) -> bool:
    return cfg.h2o_ratio < 1.0


MECHANISM = Mechanism("h2o", "AQUA-H2O: heavy-hitter eviction from the cache", (RATIO,), on=evicts,
                      node_attrs=lambda cfg: {"ratio": float(cfg.h2o_ratio)} if evicts(cfg) else {},
                      name_parts=lambda cfg: [f"h{cfg.h2o_ratio:g}"] if evicts(cfg) else [])
