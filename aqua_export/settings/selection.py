"""Which coordinates of q^ score each query: k_ratio of the retained width r, chosen by a rule (ops.rules defines
each rule's score; the node carries the rule's code, ops.spec.SELECTIONS)."""

from __future__ import annotations

from ..ops import spec
from .base import Mechanism, Setting

K_RATIO = Setting("k_ratio", float, 1.0, "share of the retained width r whose coordinates score each query, in (0, 1]; "
                  "1 = dense", interval=(0.0, 1.0, True, False))
RULE = Setting("selection", str, "magnitude",
               "how coordinates are chosen: magnitude (top-k |q^|, the paper), static (first k), weighted (top-k "
               "|q^_i| * rms(k^_i)), group / group-weighted (one top-k of the GQA group's summed scores for all its "
               "query heads: a step reads exactly k of K^'s rows); every rule is exported", choices=tuple(spec.SELECTIONS))


def shared(cfg) -> bool:
    """One index set per KV group (the group rules): a kernel reads exactly k of K^'s r rows per group."""
    return cfg.selection.startswith("group")


def weighted(cfg) -> bool:
    """|q^_i| * rms(k^_i): exported by folding rms into P (q^ * w, k^ / w: the same scores; an int8 cache holds
    k^ / w^s and the node divides it by its key_weights w^(1 - s); fold.selection_bases)."""
    return cfg.selection.endswith("weighted")


MECHANISM = Mechanism(
    "selection", "top-k coordinates of |q^| (or a variant rule) score each query", (K_RATIO, RULE),
    on=lambda cfg: cfg.k_ratio < 1.0,
    node_attrs=lambda cfg: {"rule": spec.SELECTIONS[cfg.selection][0]},
    name_parts=lambda cfg: [cfg.selection] if cfg.selection != RULE.default else [],  # k: the name's -k<R>
    aliases={"shared_selection": shared, "weighted_selection": weighted})
