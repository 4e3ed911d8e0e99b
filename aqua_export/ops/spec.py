"""Names and codes every implementation of the custom nodes agrees on (ONNX export, PyTorch reference, the native
CPU kernels in plugins/ort, the Triton kernels, the TensorRT plugin)."""

from __future__ import annotations

from dataclasses import dataclass

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


def reads_a_share(token_ratio: float, token_budget: int) -> bool:
    """Whether a decode step with these token-selection attributes (a node's, or AquaConfig's) reads a share of the
    cache's pages rather than all of them."""
    return token_ratio < 1.0 or token_budget > 0

# Sparse prefill chooses blocks of PREFILL_BLOCK slots (the prompt kernel's key blocks are two of them) for query
# blocks of PREFILL_BLOCK positions; a call's last PREFILL_TAIL rows, those the first generated token reads, attend
# densely (OpenVINO keeps 100)
PREFILL_BLOCK = 64
PREFILL_TAIL = 128
SLOT_EXTRA_BYTES = 4 + 8  # per H2O slot and KV head beyond K^ and V: heavy (float32) and token (int64)

# The float types a graph, a cache or a kernel runs in: their names are numpy's and torch's (np.dtype(name),
# getattr(torch, name)); ONNX numbers them
FLOAT_TYPES = ("float32", "float16")
ONNX = {"float32": 1, "float16": 10, "int8": 3}  # onnx.TensorProto.FLOAT / FLOAT16 / INT8
# The cache types a float32 graph may keep beside its own: float16 (rounded), or int8 rows that carry their scale:
# each token's K^ column / V row holds round(x / s) in [-127, 127] and, one element further, the code c of its scale
# s = 2^(c / 4) (ops.rules.int8_rows defines c; K^'s codes are one more dim-major row, V's one more column). Quarter
# powers of two: the step is at most 2^(1/4) the ideal max |x| / 127 where whole powers cost up to 2x it (perplexity
# +0.06% against +0.54%, docs/reference.md)


@dataclass(frozen=True)
class CacheType:
    """A KV cache's element type: its ONNX number, the elements a token's K^ column / V row carries beyond its width
    (an int8 row's scale code), and what it refuses (``refusal``). A new cache type is one entry of CACHES, its
    rows' rule (ops.rules), the kernels that read it and its capability rows (docs/design.md, Adding a cache type)."""

    name: str
    onnx: int
    scale_slots: int = 0
    # parity: the share of forwards whose top-1 the folder's graph must keep against the same graph caching float32,
    # beyond logit ties (parity/gates.py says how the bars were measured)
    parity_top1: float = 1.0

    def narrow(self, dtype: str) -> bool:
        """Narrower than the graph's float type ``dtype`` (a float16 or int8 cache under a float32 graph)."""
        return self.name != dtype

    def refusal(self, dtype: str, h2o: bool) -> str | None:
        """The line refusing this cache under a ``dtype`` graph (h2o: AQUA-H2O's slot buffers), or None."""
        if self.narrow(dtype) and dtype != "float32":
            return f"a {dtype} graph caches {dtype}: --cache-dtype float16 / int8 is for float32 graphs"
        if self.narrow(dtype) and h2o:
            return ("AQUA-H2O's slot buffers are kept in the graph's dtype: drop --cache-dtype, or use --k-ratio / "
                    "--token-budget without --h2o-ratio")
        return None


CACHES = {c.name: c for c in (CacheType("float32", ONNX["float32"]),
                              CacheType("float16", ONNX["float16"], parity_top1=0.95),
                              CacheType("int8", ONNX["int8"], scale_slots=1, parity_top1=0.9))}
CACHE_TYPES = tuple(CACHES)  # widest first
SCALE_CODES = (-128, 127)  # an int8 row's scale codes: 2^-32 .. 2^31.75 (larger rows saturate at the top)
SCALE_STEPS = 4  # scale codes per power of two


def int8_scales():
    """float32 [256]: the scale of each int8 row code c in SCALE_CODES, 2^floor(c / 4) times 2^((c mod 4) / 4) (that
    root rounded from float64 to float32 once): a power of two times one of four constants is exact, so every
    implementation (this table, the graph's Gather, the kernels' int8_scale) has the same bits."""
    import numpy as np

    lo, hi = SCALE_CODES
    codes = np.arange(lo, hi + 1)
    roots = np.array([2.0 ** (j / SCALE_STEPS) for j in range(SCALE_STEPS)], np.float32)
    return (np.ldexp(np.float32(1), codes // SCALE_STEPS) * roots[codes % SCALE_STEPS]).astype(np.float32)


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
