"""How the selection width k spreads over layers and heads (allocate.py): its average stays k_ratio of r."""

from __future__ import annotations

from .base import Mechanism, Setting

ALLOC = Setting("k_alloc", str, "uniform",
                "how the selection width spreads, --k-ratio its average (the same rows of K^ per step under the group "
                "rules): uniform (every query row selects --k-ratio of its width), energy (over the layers by "
                "water-filling on the calibrated spectra; a layer's heads share its k per token), measured (over the "
                "layers by their measured costs of a narrower selection under --selection, the heads sharing each "
                "layer's k at measured prices: measured by the build or `calibrate --select-costs`)",
                choices=("uniform", "energy", "measured"))


def allocates(cfg) -> bool:
    """The layers' k are spread by k_alloc rather than each round(k_ratio r_l) (k_ratio 1 leaves nothing to spread)."""
    return cfg.k_alloc != "uniform" and cfg.k_ratio < 1.0


def shares(cfg) -> bool:
    """A layer's heads share its k per token (allocate.head_prices): an allocation under a rule that reads the query,
    without H2O (the node then carries head_prices, from the contract)."""
    return allocates(cfg) and cfg.selection != "static" and cfg.h2o_ratio == 1.0


MECHANISM = Mechanism("k_alloc", "the selection width spread over layers and heads", (ALLOC,), on=allocates,
                      name_parts=lambda cfg: [f"kalloc-{cfg.k_alloc}"] if allocates(cfg) else [],
                      approximates=False,  # selection's k_ratio approximates; this only spreads it
                      aliases={"allocates_k": allocates, "shares_k": shares}, features={"shared_k": shares},
                      refusals={("shared_k", "tensorrt"): "--k-alloc energy / measured shares each layer's k among its "
                                "heads per token, a mode of the fused AquaAttention node; TensorRT's TopKGatherDot "
                                "plugin takes one k per row: use --runtime aqua, or --k-alloc uniform or --selection "
                                "static"})
