"""Where a folder runs: one table of what each runtime cannot take, and the one line that says so.

The vocabulary on every command line: ``--runtime`` names what drives a folder (``aqua``: this project's ONNX Runtime
loop, ``genai``: onnxruntime-genai, ``tensorrt``: the folder's model.engine) and ``--kernel`` what runs the custom
nodes inside ONNX Runtime (``native``: the C++ kernels, ``function``: the nodes' ONNX function bodies, ``auto``).
The Triton kernels serve the PyTorch reference on a GPU and TensorRT's plugin; ``standard`` is a folder built with
``--ops standard`` in any ONNX consumer (ONNX's own reference evaluator: the com.aqua nodes' function bodies). A pair
absent from REFUSALS runs (NOTES say how, where it differs);
the build, `run`, `bench`, `eval --folder` and lm-eval all ask ``check`` (tests/test_capabilities.py walks every pair).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .errors import ConfigError

RUNTIMES = ("aqua", "genai", "tensorrt")  # --runtime: what drives a folder
KERNELS = ("auto", "native", "function")  # --kernel: what runs the custom nodes under ONNX Runtime
# the table's columns; serve: `aqua-export serve`'s continuous batching (serving.engine), over the aqua runtime;
# standard: the --ops standard graph in any ONNX consumer
BACKENDS = ("native", "function", "genai", "tensorrt", "triton", "serve", "standard")


@dataclass(frozen=True)
class Features:
    """What a folder (or a build's settings) asks of the code that runs it; each field is a row of the table."""

    h2o: bool = False  # AQUA-H2O: H2OAttention evicts between tokens
    tokens: bool = False  # token selection: a mode of the fused AquaAttention node
    prefill: bool = False  # sparse prefill: a mode of the fused AquaAttention node's prompt
    prompt_bf16: bool = False  # the prompt's attention products in bfloat16: the same node's (settings/precision.py)
    shared_k: bool = False  # a layer's heads share its k per token (head_prices)
    uneven_widths: bool = False  # K^ and V cached at several widths (an allocated AQUA-Memory)
    narrow_cache: bool = False  # the cache in float16 or int8 under a float32 graph
    int8_cache: bool = False  # int8 rows with their scales' codes (ops.spec)
    float16: bool = False  # a float16 graph
    quantized: bool = False  # int4 / int8 weights (MatMulNBits)

    @classmethod
    def of_config(cls, config) -> Features:
        """What a build's AQUA settings (config.AquaConfig) ask, before any work; the build options' fields are
        theirs to add (options.BuildOptions.features)."""
        return cls(h2o=config.evicts, tokens=config.selects_tokens, prefill=config.sparse_prefill,
                   prompt_bf16=config.prompt_bf16, shared_k=config.shares_k,
                   uneven_widths=config.slice_ratio > 0 and config.slice_alloc != "uniform")

    @classmethod
    def of_contract(cls, ct) -> Features:
        """What a graph contract (contract.Contract) holds: its buffers' kinds, widths and types."""
        return cls(h2o=ct.h2o, shared_k=ct.prices is not None, uneven_widths=not ct.uniform,
                   narrow_cache=ct.narrow_cache, int8_cache=ct.scale_slots > 0, float16=ct.dtype == "float16")

    @classmethod
    def of_folder(cls, cfg) -> Features:
        """From a built folder's FolderConfig: its contract's, and the modes and weights the graph runs."""
        return replace(cls.of_contract(cfg.contract), tokens=cfg.aqua.selects_tokens, prefill=cfg.aqua.sparse_prefill,
                       prompt_bf16=cfg.aqua.prompt_bf16, quantized=cfg.weights.quantized)


REFUSALS = {
    ("h2o", "genai"): "AQUA-H2O folders evict between tokens, which onnxruntime-genai cannot do: run them with "
                      "--runtime aqua",
    ("uneven_widths", "genai"): "this folder caches K^ and V at several widths (--slice-alloc), and onnxruntime-genai "
                                "takes one head_size for all: run it with --runtime aqua",
    ("h2o", "tensorrt"): "AQUA-H2O's H2OAttention node has no TensorRT plugin: use --runtime aqua for H2O folders",
    ("tokens", "tensorrt"): "token selection is a mode of the fused AquaAttention node, which has no TensorRT plugin: "
                            "use --runtime aqua",
    ("prefill", "tensorrt"): "sparse prefill (--prefill-threshold) is a mode of the fused AquaAttention node, which has "
                             "no TensorRT plugin: use --runtime aqua or genai",
    ("prompt_bf16", "tensorrt"): "--prompt-precision bfloat16 is a mode of the fused AquaAttention node's prompt, "
                                 "which has no TensorRT plugin (TensorRT picks its own precisions): drop it there",
    ("shared_k", "tensorrt"): "--k-alloc energy / measured shares each layer's k among its heads per token, a mode of "
                              "the fused AquaAttention node; TensorRT's TopKGatherDot plugin takes one k per row: use "
                              "--runtime aqua, or --k-alloc uniform or --selection static",
    ("narrow_cache", "tensorrt"): "--cache-dtype float16 / int8 under a float32 graph is read by AquaAttention's ONNX "
                                  "Runtime kernels; TensorRT's separate nodes take one type: use --runtime aqua, or "
                                  "drop --cache-dtype",
    ("int8_cache", "triton"): "an int8 cache (--cache-dtype int8) is read by the ONNX Runtime kernels on a CPU; the "
                              "Triton kernels read the GPU's float caches: use --cache-dtype float16 there",
    ("quantized", "tensorrt"): "--weights int4 / int8 are ONNX Runtime's MatMulNBits with float32 activations: use "
                               "--runtime aqua or genai (float16 is TensorRT's format: drop --weights)",
    ("h2o", "serve"): "AQUA-H2O folders evict tokens inside the graph, per row, which continuous batching's row moves "
                      "cannot follow: serve a folder built without --h2o-ratio (or run it with `aqua-export run`)",
    ("float16", "native"): "the native kernels run float32 graphs (a float16 kernel would round the scores to float16 "
                           "before the softmax): run this float16 folder with --kernel function (auto does)",
    ("quantized", "standard"): "--ops standard writes standard ONNX ops only, and int4 / int8 blocks are ONNX Runtime's "
                               "MatMulNBits: build it with --weights float, or drop --ops standard",
}
# pairs that run, but not as the setting says everywhere: the table's cell instead of "yes"
NOTES = {
    ("prompt_bf16", "function"): "yes, in float32 (the function body ignores prompt_bf16)",
    ("prompt_bf16", "standard"): "yes, in float32 (the function body ignores prompt_bf16)",
    ("prompt_bf16", "native"): "yes, in bfloat16 where the CPU has AVX512_BF16, else float32",
}
assert all(f in {x.name for x in fields(Features)} and b in BACKENDS for f, b in (*REFUSALS, *NOTES)), \
    "a row or column is unknown"
assert not set(REFUSALS) & set(NOTES), "a pair is refused or runs, not both"


def refusal(features: Features, backend: str) -> str | None:
    """The line refusing ``features`` on ``backend``, or None when it runs there."""
    if backend == "aqua":  # this project's loop: the native kernels, or the function bodies where they refuse
        lines = [refusal(features, k) for k in ("native", "function")]
        return None if None in lines else lines[0]
    if backend not in BACKENDS:
        raise ConfigError(f"unknown runtime {backend!r}: use one of {', '.join(BACKENDS)}")
    return next((REFUSALS[f.name, backend] for f in fields(features)
                 if getattr(features, f.name) and (f.name, backend) in REFUSALS), None)


def check(features: Features, backend: str) -> None:
    """One ConfigError line when ``backend`` cannot run ``features``."""
    line = refusal(features, backend)
    if line is not None:
        raise ConfigError(line)


def table() -> str:
    """docs/cli.md's capability table (markdown): one row per feature, one column per backend."""
    head = ["| needs | " + " | ".join(BACKENDS) + " |", "|---|" + "---|" * len(BACKENDS)]
    return "\n".join(head + [f"| {f.name} | " + " | ".join("refused" if (f.name, b) in REFUSALS else
                                                           NOTES.get((f.name, b), "yes") for b in BACKENDS) + " |"
                              for f in fields(Features)])
