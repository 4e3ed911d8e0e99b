"""Sparse prefill: a prompt's query blocks attend exactly only the key blocks an estimate from AQUA's own quantities
picks (ops.rules.prefill_chosen): every stride-th row's top-k |q^| coordinates score the keys, and blocks are taken
by estimated softmax mass until the threshold; decode steps and a call's last rows are untouched."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Mechanism, Setting

THRESHOLD = Setting("prefill_threshold", float, 1.0, "sparse prefill: share of each prompt block's estimated softmax "
                    "mass its chosen key blocks keep, in (0, 1]; 1 = dense prompt", interval=(0.0, 1.0, True, False))
# every 4th row at 16 of 64 coordinates: +0.25% perplexity at 8k where every 8th cost +1.1% (sparse_prefill_study)
STRIDE = Setting("prefill_stride", int, 4, "sparse prefill: every this many prompt rows estimate their block's "
                 "attention (1 to 64)")
K_RATIO = Setting("prefill_k_ratio", float, 0.25, "sparse prefill: share of the retained width r whose top |q^| "
                  "coordinates score the estimate, in (0, 1]", interval=(0.0, 1.0, True, False))


def sparse(cfg) -> bool:
    """A prompt's attention reads the chosen key blocks, not all of them."""
    return cfg.prefill_threshold < 1.0


def _check(cfg) -> None:
    if not sparse(cfg) and (cfg.prefill_stride, cfg.prefill_k_ratio) != (STRIDE.default, K_RATIO.default):
        raise ConfigError("prefill_stride / prefill_k_ratio are sparse prefill's: give --prefill-threshold below 1 "
                          "too, or drop them")
    if not 1 <= cfg.prefill_stride <= 64:
        raise ConfigError(f"prefill_stride={cfg.prefill_stride} is out of range: use a whole number in [1, 64] (the "
                          "rows of a 64-token block that estimate)")
    if sparse(cfg) and cfg.h2o_ratio < 1.0:
        raise ConfigError("sparse prefill chooses key blocks of a cache that keeps every token, and AQUA-H2O evicts "
                          "tokens from it: use --prefill-threshold or --h2o-ratio, not both")


def _attrs(cfg) -> dict:
    if not sparse(cfg):
        return {}
    return {"prefill_threshold": float(cfg.prefill_threshold), "prefill_stride": cfg.prefill_stride,
            "prefill_k_ratio": float(cfg.prefill_k_ratio)}


def _name(cfg) -> list:
    if not sparse(cfg):
        return []
    return [f"p{cfg.prefill_threshold:g}"] + ([f"ps{cfg.prefill_stride}"] if cfg.prefill_stride != STRIDE.default
                                              else []) + \
        ([f"pk{cfg.prefill_k_ratio:g}"] if cfg.prefill_k_ratio != K_RATIO.default else [])


MECHANISM = Mechanism("prefill", "sparse prefill: a prompt block attends the key blocks its estimate picks",
                      (THRESHOLD, STRIDE, K_RATIO), on=sparse, check=_check, node_attrs=_attrs, name_parts=_name)
