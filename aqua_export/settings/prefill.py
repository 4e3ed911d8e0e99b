"""Sparse prefill: a prompt's query blocks attend exactly only the key blocks an estimate from AQUA's own quantities
picks (ops.rules.prefill_chosen): every stride-th row's top-k |q^| coordinates score the keys, and blocks are taken
by estimated softmax mass until the threshold; decode steps and a call's last rows are untouched."""

from __future__ import annotations

from ..errors import ConfigError
from ..ops import spec
from .base import Mechanism, Probe, Setting

THRESHOLD = Setting("prefill_threshold", float, 1.0, "sparse prefill: share of each prompt block's estimated softmax "
                    "mass its chosen key blocks keep, in (0, 1]; 1 = dense prompt", interval=(0.0, 1.0, True, False))
# every 8th row on all r coordinates (the study's rows s=8 k=64): the kernel scores the rows as one matrix product, so
# the estimate costs its rows whatever k'; at 0.98 it keeps 42.6% of an 8k prompt's blocks for +0.52% perplexity
# (quality.md) where every 4th row on 16 of 64 kept 49.8% for +0.01%; the 8k bfloat16 node 2.13 s against 3.00
STRIDE = Setting("prefill_stride", int, 8, "sparse prefill: every this many prompt rows estimate their block's "
                 "attention (at most the 64 rows of a block)", whole=(1, 64))
K_RATIO = Setting("prefill_k_ratio", float, 1.0, "sparse prefill: share of the retained width r whose top |q^| "
                  "coordinates score the estimate, in (0, 1] (below 1 narrows it, at the same cost)",
                  interval=(0.0, 1.0, True, False))


# what configs of versions 4-5 (config.CONFIG_VERSION) wrote for these two fields whatever the threshold
_OLD_DEFAULTS = {"prefill_stride": 4, "prefill_k_ratio": 0.25}


def upgrade(data: dict) -> dict:
    """A config dict written before version 6 -> the same config now: a dense prompt's estimate fields at their old
    defaults mean nothing and are dropped (a sparse one keeps the estimate it was built with)."""
    if data.get("prefill_threshold", THRESHOLD.default) != 1.0:  # sparse, or a value its check refuses
        return data
    return {n: v for n, v in data.items() if not (n in _OLD_DEFAULTS and v == _OLD_DEFAULTS[n])}


def sparse(cfg) -> bool:
    """A prompt's attention reads the chosen key blocks, not all of them."""
    return cfg.prefill_threshold < 1.0


def _check(cfg) -> None:
    given = [s for s in (STRIDE, K_RATIO) if getattr(cfg, s.name) != s.default]
    if not sparse(cfg) and given:  # named as given, one or both
        named = " and ".join(f"{s.flag} {getattr(cfg, s.name):g}" for s in given)
        raise ConfigError(f"{named} {'is' if len(given) == 1 else 'are'} sparse prefill's: give --prefill-threshold "
                          f"below 1 too, or drop {'it' if len(given) == 1 else 'them'}")
    if sparse(cfg) and cfg.h2o_ratio < 1.0:
        raise ConfigError("sparse prefill chooses key blocks of a cache that keeps every token, and AQUA-H2O evicts "
                          "tokens from it: use --prefill-threshold or --h2o-ratio, not both")


def _attrs(cfg) -> dict:
    if not sparse(cfg):
        return {}
    return {"prefill_threshold": float(cfg.prefill_threshold), "prefill_stride": cfg.prefill_stride,
            "prefill_k_ratio": float(cfg.prefill_k_ratio)}


def _parity_prompt(cfg, n: int, limit: int) -> int:
    """Parity's prompt at least long enough (within limit) for a query block to choose between key blocks: the third
    block, its two predecessors forced, before the call's dense last rows (else its gate fails as not exercised)."""
    return max(n, min(3 * spec.PREFILL_BLOCK + spec.PREFILL_TAIL, limit))


def _name(cfg) -> list:
    if not sparse(cfg):
        return []
    return [f"p{cfg.prefill_threshold:g}"] + ([f"ps{cfg.prefill_stride}"] if cfg.prefill_stride != STRIDE.default
                                              else []) + \
        ([f"pk{cfg.prefill_k_ratio:g}"] if cfg.prefill_k_ratio != K_RATIO.default else [])


MECHANISM = Mechanism("prefill", "sparse prefill: a prompt block attends the key blocks its estimate picks",
                      (THRESHOLD, STRIDE, K_RATIO), on=sparse, check=_check, node_attrs=_attrs, name_parts=_name,
                      aliases={"sparse_prefill": sparse}, features={"prefill": sparse},
                      neutral={"prefill_threshold": 1.0},
                      probe=Probe("prefill_blocks", "sparse prefill block near-ties", "pf_keep_rows",
                                  prompt=_parity_prompt),
                      refusals={("prefill", "tensorrt"): "sparse prefill (--prefill-threshold) is a mode of the fused "
                                "AquaAttention node, which has no TensorRT plugin: use --runtime aqua or genai"})
