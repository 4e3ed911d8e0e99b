"""Token selection: a decode step scores pages of tokens with the k selected coordinates and attends the chosen
pages exactly (all r coordinates); nothing is evicted, and a prompt's rows attend every token (ops.rules)."""

from __future__ import annotations

from ..errors import ConfigError
from ..ops import spec
from .base import Mechanism, Setting

RATIO = Setting("token_ratio", float, 1.0, "token selection: share of the visible tokens a decode step attends, in "
                "(0, 1]; the k selected coordinates score pages of 16 tokens, the chosen ones get exact attention, "
                "nothing is evicted; 1 = all", interval=(0.0, 1.0, True, False))
BUDGET = Setting("token_budget", int, 0, "token selection with a fixed number of tokens per decode step instead (0 = "
                 "by --token-ratio)")
# one page: the attention-sink tokens models keep looking at (StreamingLLM keeps 4)
SINK = Setting("token_sink", int, 16, "token selection: the first tokens every step keeps (attention sinks)")
# four pages of the most recent tokens: the local context the next one leans on
WINDOW = Setting("token_window", int, 64, "token selection: the most recent tokens every step keeps")


def selects(cfg) -> bool:
    """A decode step reads the chosen pages of the cache, not all of it."""
    return spec.reads_a_share(cfg.token_ratio, cfg.token_budget)


def _check(cfg) -> None:
    if not selects(cfg) and (cfg.token_sink, cfg.token_window) != (SINK.default, WINDOW.default):
        raise ConfigError("token_sink / token_window are token selection's: give --token-budget or --token-ratio "
                          "too, or drop them")
    if cfg.token_budget and cfg.token_ratio < 1:
        raise ConfigError("--token-ratio and --token-budget both choose how many tokens a step reads: give one")
    if selects(cfg) and cfg.h2o_ratio < 1.0:
        raise ConfigError("token selection reads a share of a cache that keeps every token, and AQUA-H2O evicts "
                          "tokens from it: use --token-ratio / --token-budget or --h2o-ratio, not both")


def _attrs(cfg) -> dict:
    if not selects(cfg):
        return {}
    return {"token_ratio": float(cfg.token_ratio), "token_budget": cfg.token_budget, "token_sink": cfg.token_sink,
            "token_window": cfg.token_window}


def _name(cfg) -> list:
    if not selects(cfg):
        return []
    return [f"tb{cfg.token_budget}" if cfg.token_budget else f"t{cfg.token_ratio:g}"] + \
        ([f"sink{cfg.token_sink}"] if cfg.token_sink != SINK.default else []) + \
        ([f"win{cfg.token_window}"] if cfg.token_window != WINDOW.default else [])


MECHANISM = Mechanism("tokens", "token selection: a decode step attends the best-scored pages of tokens",
                      (RATIO, BUDGET, SINK, WINDOW), on=selects, check=_check, node_attrs=_attrs, name_parts=_name,
                      aliases={"selects_tokens": selects}, features={"tokens": selects},
                      neutral={"token_ratio": 1.0, "token_budget": 0},
                      refusals={("tokens", "tensorrt"): "token selection is a mode of the fused AquaAttention node, "
                                "which has no TensorRT plugin: use --runtime aqua"})
