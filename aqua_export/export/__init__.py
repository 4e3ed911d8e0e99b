"""The export stage: a Hugging Face model and its calibration artifact -> an ONNX decoder graph.

    contract       the graph's I/O names, shapes, dtypes and cache layout (the one owner; runtimes derive from it)
    builder        GraphBuilder / TensorStore: nodes, initialisers, weights streamed to external data
    blocks         the building blocks of a layer: linear (float or MatMulNBits), norms, rotary, MLP, MoE
    decoder_graph  one decoder layer and the whole graph, from the weights (no tracing)
    exporter       the entry point: check_exportable, contract_for, export_onnx
    rewrites       variants of a built graph the parity harness runs beside it
"""
