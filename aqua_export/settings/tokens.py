"""Token selection: a decode step scores pages of tokens with the k selected coordinates and attends the chosen
pages exactly (all r coordinates); nothing is evicted, and a prompt's rows attend every token (ops.rules)."""

from __future__ import annotations

from ..errors import ConfigError
from ..ops import spec
from .base import Mechanism, Probe, Setting

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


def _dropped(cfg, n: int) -> int:
    """Pages a decode step after an n-token prompt leaves out."""
    from ..ops.rules import pages_dropped  # torch: parity's stage, not the CLI's

    return pages_dropped(n + 1, cfg.token_ratio, cfg.token_budget, cfg.token_sink, cfg.token_window)


def _parity_prompt(cfg, n: int, limit: int) -> int:
    """Parity's prompt lengthened page by page (within limit) until its first decode step leaves a page out, so that
    parity tests the choice and not only the exact attention of every token (a budget of 512 and a 256-token prompt
    read every page)."""
    while n + spec.PAGE <= limit and not _dropped(cfg, n):
        n += spec.PAGE
    return n


def _unexercised(cfg, n: int, context) -> str | None:
    if _dropped(cfg, n):
        return None
    what = f"--token-budget {cfg.token_budget}" if cfg.token_budget else f"--token-ratio {cfg.token_ratio:g}"
    return (f"token selection ({what} plus the first {cfg.token_sink} and last {cfg.token_window} tokens) reads every "
            f"token of any prompt that fits this model's context of {context} tokens: nothing would ever be left out, "
            "and parity could not test it; lower the budget, --token-sink or --token-window")


# A narrow cache's parity bar under token selection (parity.gates.cache_gate). The rounding also moves which pages a
# step reads, whatever the cache's width, and a moved choice moves that forward's logits by up to ~1.3, so near-tie
# argmaxes flip at the rate choices move, not at the rounding's size: the int4 token folder (k 0.25 group-weighted,
# budget 512, 64 steps) differed in 3 and in 4 of 65 forwards at float16 on two builds of the kernels whose prompt
# attention rounds differently in the last bits, in 4 at int8. The int8 bar.
CACHE_TOP1 = 0.9
# ... and a forward whose argmax moved by at most CACHE_TIE logits there counts as a near-tie: with the MLP's gate in
# one node (ops/matmul_q4a8.py GATED: the same function up to float32 rounding) the same folder differed in 7 of 65
# forwards at a 512-token prompt (3 before), every one by a margin of 0.006 to 0.18, while a moved page choice moves a
# forward's logits by up to ~1.3. The count is a draw: at 512 / 640 / 768 / 896 / 1,024 / 1,152 prompt tokens the
# graph with the gate in one node differed in 7 / 2 / 5 / 1 / 0 / 2 forwards, the one before in 3 / 1 / 1 / 1 / 0 /
# 5. A cache that rounds wrongly moves argmaxes by more than near-ties.
CACHE_TIE = 0.25


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
                      probe=Probe("pages", "token pages near-ties", "page_order", prompt=_parity_prompt,
                                  unexercised=_unexercised, cache_top1=(CACHE_TOP1, CACHE_TIE)),
                      refusals={("tokens", "tensorrt"): "token selection is a mode of the fused AquaAttention node, "
                                "which has no TensorRT plugin: use --runtime aqua"})
