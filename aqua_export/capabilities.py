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

from dataclasses import field, fields, make_dataclass

from . import settings
from .errors import ConfigError

RUNTIMES = ("aqua", "genai", "tensorrt")  # --runtime: what drives a folder
KERNELS = ("auto", "native", "function")  # --kernel: what runs the custom nodes under ONNX Runtime
# the table's columns; serve: `aqua-export serve`'s continuous batching (serving.engine), over the aqua runtime;
# standard: the --ops standard graph in any ONNX consumer
BACKENDS = ("native", "function", "genai", "tensorrt", "triton", "serve", "standard")


# the rows a build option or the graph contract adds (options.BuildOptions' fields turn them on); the mechanisms'
# rows come from their declarations (settings.Mechanism.features), before these
BUILD_ROWS = {
    "narrow_cache": "the cache in float16 or int8 under a float32 graph",
    "int8_cache": "int8 rows with their scales' codes (ops.spec)",
    "float16": "a float16 graph",
    "quantized": "int4 / int8 weights (MatMulNBits)",
}
_MODE_ROWS = {row: on for m in settings.MECHANISMS for row, on in m.features.items()}


class _Features:
    """What a folder (or a build's settings) asks of the code that runs it; each field is a row of the table: the
    mechanisms' (settings.Mechanism.features: h2o, tokens, prefill, prompt_bf16, shared_k, uneven_widths, ...),
    then BUILD_ROWS."""

    @classmethod
    def of_config(cls, config) -> Features:
        """What a build's AQUA settings (config.AquaConfig) ask, before any work; the build options' fields are
        theirs to add (options.BuildOptions.features)."""
        return cls(**{row: bool(on(config)) for row, on in _MODE_ROWS.items()})

    @staticmethod
    def _contract_rows(ct) -> dict:
        return dict(h2o=ct.h2o, shared_k=ct.prices is not None, uneven_widths=not ct.uniform,
                    narrow_cache=ct.narrow_cache, int8_cache=ct.scale_slots > 0, float16=ct.dtype == "float16")

    @classmethod
    def of_contract(cls, ct) -> Features:
        """What a graph contract (contract.Contract) holds: its buffers' kinds, widths and types."""
        return cls(**cls._contract_rows(ct))

    @classmethod
    def of_folder(cls, cfg) -> Features:
        """From a built folder's FolderConfig: the modes its AQUA settings run, what its contract holds (where the
        contract knows a row, it decides), and its weights."""
        return cls(**{row: bool(on(cfg.aqua)) for row, on in _MODE_ROWS.items()}
                   | cls._contract_rows(cfg.contract) | {"quantized": cfg.weights.quantized})


Features = make_dataclass("Features", [(row, bool, field(default=False)) for row in (*_MODE_ROWS, *BUILD_ROWS)],
                          bases=(_Features,), frozen=True)
Features.__module__, Features.__doc__ = __name__, _Features.__doc__

REFUSALS = {
    **{pair: line for m in settings.MECHANISMS for pair, line in m.refusals.items()},
    ("narrow_cache", "tensorrt"): "--cache-dtype float16 / int8 under a float32 graph is read by AquaAttention's ONNX "
                                  "Runtime kernels; TensorRT's separate nodes take one type: use --runtime aqua, or "
                                  "drop --cache-dtype",
    ("int8_cache", "triton"): "an int8 cache (--cache-dtype int8) is read by the ONNX Runtime kernels on a CPU; the "
                              "Triton kernels read the GPU's float caches: use --cache-dtype float16 there",
    ("quantized", "tensorrt"): "--weights int4 / int8 are ONNX Runtime's MatMulNBits with float32 activations: use "
                               "--runtime aqua or genai (float16 is TensorRT's format: drop --weights)",
    ("float16", "native"): "the native kernels run float32 graphs (a float16 kernel would round the scores to float16 "
                           "before the softmax): run this float16 folder with --kernel function (auto does)",
    ("quantized", "standard"): "--ops standard writes standard ONNX ops only, and int4 / int8 blocks are ONNX Runtime's "
                               "MatMulNBits: build it with --weights float, or drop --ops standard",
}
# pairs that run, but not as the setting says everywhere: the table's cell instead of "yes"
NOTES = {pair: cell for m in settings.MECHANISMS for pair, cell in m.notes.items()}
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
