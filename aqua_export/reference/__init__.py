"""The PyTorch reference of AQUA: the operator run inside Hugging Face transformers, the calibrated model computed in
any precision, and a quantized folder's weights mapped back. It imports ops.rules and never ONNX.

    attention         the ``aqua`` attention function, apply_aqua (a context manager that undoes itself), Probe
    cache             AquaCache: projected, narrowed, evicting KV cache for generation
    precision         computing_in: a model run in float32 / float64 one layer at a time
    exported_weights  the dequantized weights a quantized folder computes with, in HF's layout
"""
