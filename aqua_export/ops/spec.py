"""Names and codes every implementation of the custom nodes agrees on (ONNX export, PyTorch reference, the native
CPU kernels in plugins/ort, the Triton kernels, the TensorRT plugin)."""

from __future__ import annotations

DOMAIN = "com.aqua"  # the custom nodes' ONNX domain
OPSET_VERSION = 1  # of DOMAIN
OPSET = 20  # standard-op opset of the exported graph and of the function bodies
PLUGIN_NAMESPACE = "aqua"  # TensorRT's plugin registry
PLUGIN_VERSION = "1"
PROJECTION = "projection"  # the attention nodes' optional last input: P [Hkv, d, r], input 0 then being q

# The selection rules, by the code the nodes' `rule` attribute carries. The weighted rules are magnitude rules on a
# rescaled basis (fold.selection_bases folds rms(k^) into P), so a node only knows these codes.
MAGNITUDE, GROUP, STATIC = 0, 1, 2
RULE_NAMES = {MAGNITUDE: "magnitude", GROUP: "group", STATIC: "static"}
RULE_DOC = "0: top-k |q^| per query row; 1: one top-k of the GQA group's summed |q^| for all its rows; 2: the first k"
# every selection a user names -> (the node's rule code, weighted by rms(k^))
SELECTIONS = {"magnitude": (MAGNITUDE, False), "static": (STATIC, False), "weighted": (MAGNITUDE, True),
              "group": (GROUP, False), "group-weighted": (GROUP, True)}

FREE = -1  # an H2O token buffer's entry for a free slot
# Token selection chooses whole pages of PAGE consecutive slots: K^ is dim-major, so a page is one 64-byte line of
# each coordinate row (float32) and a chosen page is read as r full lines; single tokens would each cost r lines
PAGE = 16
SLOT_EXTRA_BYTES = 4 + 8  # per H2O slot and KV head beyond K^ and V: heavy (float32) and token (int64)

# The float types a graph, a cache or a kernel runs in: their names are numpy's and torch's (np.dtype(name),
# getattr(torch, name)); ONNX numbers them
FLOAT_TYPES = ("float32", "float16")
ONNX = {"float32": 1, "float16": 10, "int8": 3}  # onnx.TensorProto.FLOAT / FLOAT16 / INT8
# The cache types a float32 graph may keep beside its own: float16 (rounded), or int8 rows that carry their scale:
# each token's K^ column / V row holds round(x / 2^e) in [-127, 127] and, one element further, the exponent e of its
# power-of-two scale (ops.rules.int8_rows defines e; K^'s exponents are one more dim-major row, V's one more column)
CACHE_TYPES = ("float32", "float16", "int8")
SCALE_SLOTS = {"int8": 1}  # the elements a token's K^ column / V row carries beyond its width, by cache type
EXPONENTS = (-126, 127)  # the exponent range of an int8 row's scale: float32's normal powers of two


def type_name(dtype) -> str:
    """A torch or numpy float dtype -> its name in FLOAT_TYPES."""
    text = str(dtype)
    if text.startswith("torch."):
        name = text.removeprefix("torch.")
    else:
        import numpy as np  # only for numpy's spelling of a dtype (this module imports nothing heavy)

        name = np.dtype(dtype).name
    if name not in FLOAT_TYPES:
        raise ValueError(f"{dtype} is not one of the float types {FLOAT_TYPES}")
    return name
