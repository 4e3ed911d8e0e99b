"""AQUA-H2O: the cache keeps a share of the tokens, evicting by accumulated attention (ops.rules.h2o_keep)."""

from __future__ import annotations

from .base import LIVE, Mechanism, Probe, Setting

RATIO = Setting("h2o_ratio", float, 1.0, "AQUA-H2O: share of tokens kept in the cache, in (0, 1]; 1 = no eviction",
                interval=(0.0, 1.0, True, False))


def keeps_a_share(ratio: float) -> bool:
    """Whether a cache keeping this share of the tokens (AquaConfig's h2o_ratio, a node's ratio) evicts."""
    return ratio < 1.0


def evicts(cfg) -> bool:
    return keeps_a_share(cfg.h2o_ratio)


MECHANISM = Mechanism("h2o", "AQUA-H2O: heavy-hitter eviction from the cache", (RATIO,), on=evicts,
                      node_attrs=lambda cfg: {"ratio": float(cfg.h2o_ratio)} if evicts(cfg) else {},
                      name_parts=lambda cfg: [f"h{cfg.h2o_ratio:g}"] if evicts(cfg) else [],
                      aliases={"evicts": evicts}, features={"h2o": evicts}, neutral={"ratio": 1.0},
                      probe=Probe("eviction", "H2O eviction near-ties", LIVE),
                      refusals={("h2o", "genai"): "AQUA-H2O folders evict between tokens, which onnxruntime-genai "
                                "cannot do: run them with --runtime aqua",
                                ("h2o", "tensorrt"): "AQUA-H2O's H2OAttention node has no TensorRT plugin: use "
                                "--runtime aqua for H2O folders",
                                ("h2o", "serve"): "AQUA-H2O folders evict tokens inside the graph, per row, which "
                                "continuous batching's row moves cannot follow: serve a folder built without "
                                "--h2o-ratio (or run it with `aqua-export run`)"})
