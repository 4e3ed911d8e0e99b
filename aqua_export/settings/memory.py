"""AQUA-Memory: P's trailing columns dropped before K^ and V are cached, spread over the layers by an allocation
(allocate.py)."""

from __future__ import annotations

from .base import Mechanism, Setting

RATIO = Setting("slice_ratio", float, 0.0, "AQUA-Memory: share of P's trailing columns dropped before K and V are "
                "cached, in [0, 1)", interval=(0.0, 1.0, False, True))
ALLOC = Setting("slice_alloc", str, "uniform",
                "how AQUA-Memory spends its width budget over the layers' K^ and V (the same cache bytes as uniform "
                "slicing): uniform (every K^ and V drops --slice-ratio), energy (water-filling on the calibrated "
                "spectra), measured (on measured costs of slicing: the projection's slice costs, measured by the "
                "build or `calibrate --slice-costs`)", choices=("uniform", "energy", "measured"))

def _name(cfg) -> list:
    if not cfg.slice_ratio:
        return []
    return [f"s{cfg.slice_ratio:g}"] + ([cfg.slice_alloc] if cfg.slice_alloc != ALLOC.default else [])


def uneven(cfg) -> bool:
    """K^ and V cached at several widths (an allocated AQUA-Memory)."""
    return cfg.slice_ratio > 0 and cfg.slice_alloc != "uniform"


MECHANISM = Mechanism("memory", "AQUA-Memory: a narrower K^ and V in the cache", (RATIO, ALLOC),
                      on=lambda cfg: cfg.slice_ratio > 0.0, name_parts=_name, features={"uneven_widths": uneven},
                      refusals={("uneven_widths", "genai"): "this folder caches K^ and V at several widths "
                                "(--slice-alloc), and onnxruntime-genai takes one head_size for all: run it with "
                                "--runtime aqua"})
