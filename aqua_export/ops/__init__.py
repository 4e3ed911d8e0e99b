"""The operator catalogue: the custom ONNX nodes every stage builds, runs or mirrors, and the rules they share.

    spec        names and codes: the domain, opsets, plugin namespace, selection rule codes, float types
    rules       the semantics every implementation mirrors: selection (score, top-k, tie-break), the H2O
                budget, slots and keep rule, and the near-tie margins parity measures
    table       a node's signature as data: its ONNX schema and one-node test model come from it
    nodes       the ONNX node groups several function bodies share (selection, projection, attribute refs)
    one module per op: topk_gather_dot, aqua_attention, cache_update (KeyCacheUpdate, ValueCacheUpdate),
                value_product, h2o_attention; each holds its signature, function body and float64 reference
    catalogue   every op, in the order a graph carries their bodies

This package imports only torch, numpy and onnx (onnx inside the op modules only): every stage points down to it,
and the PyTorch reference imports ``rules`` without loading ONNX.
"""
