"""How a folder is built, beside the model and the AQUA settings: one declaration per build option (its flag, type,
choices, default and help, the part it adds to a default folder name, the capability-table fields it turns on), and
BuildOptions, the typed value the build takes. The CLI's build options, a folder's default name and the features the
capability table judges (capabilities.Features) are derived from OPTIONS; the KV cache's type is an ops.spec.CacheType,
which owns its element type, scale slots and refusals. No torch here: the CLI reads it before any stage loads.

The AQUA settings (what attention computes) are settings/'s; these say how the graph around them is stored and run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from . import capabilities
from .capabilities import RUNTIMES, Features
from .contract import Contract
from .errors import ConfigError
from .ops.spec import CACHE_TYPES, CACHES, FLOAT_TYPES, CacheType
from .quantize import ACCURACY_LEVELS, BITS, BLOCKS, WeightFormat

# --ops, what the graph's other nodes are: ONNX Runtime's contrib fusions (RotaryEmbedding,
# SkipSimplifiedLayerNormalization, MatMulNBits, MoE: fastest there), or standard ops only beside the com.aqua nodes and
# their bodies (any ONNX consumer: ONNX's reference evaluator, other runtimes, shape inference)
GRAPH_OPS = ("onnxruntime", "standard")
WEIGHTS = ("float",) + tuple(f"int{b}" for b in BITS)


@dataclass(frozen=True)
class BuildOption:
    """One build option: a command-line flag (--name with dashes) of kind str / int, or bool (a switch); ``part``:
    what it adds to a default folder name given the whole BuildOptions ("" for nothing); ``features``: the
    capabilities.Features fields it turns on, given the whole BuildOptions."""

    name: str
    kind: type
    default: object
    help: str
    choices: tuple = ()
    part: Callable[[BuildOptions], str] = lambda o: ""
    features: Callable[[BuildOptions], dict] = lambda o: {}

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser) -> None:
        if self.kind is bool:
            parser.add_argument(self.flag, action="store_true", help=self.help)
            return
        parser.add_argument(self.flag, type=None if self.kind is str else self.kind, default=self.default,
                            choices=list(self.choices) or None, help=self.help)


def _quantized(o: BuildOptions, text: str) -> str:
    return text if o.weights.quantized else ""


DTYPE = BuildOption("dtype", str, "float32", "weights, activations and KV cache of the export (default %(default)s)",
                    FLOAT_TYPES, part=lambda o: o.dtype if o.dtype != "float32" else "",
                    features=lambda o: {"float16": o.dtype == "float16"})
CACHE_DTYPE = BuildOption(
    "cache_dtype", str, None, "the KV cache's type (default: --dtype's). Under float32: float16 halves the bytes a CPU "
    "decode step reads at long context, as llama.cpp's default cache does; int8 quarters them (each token's K^ column "
    "and V row as int8 with its own scale, as llama.cpp's q8_0 and OpenVINO's u8 caches do). New tokens are rounded to "
    "it as they are written; parity gates the export on the same rounding and reports the distance", CACHE_TYPES,
    part=lambda o: f"kv-{o.cache.name}" if o.cache.narrow(o.dtype) else "",
    features=lambda o: {"narrow_cache": o.cache.narrow(o.dtype), "int8_cache": o.cache.scale_slots > 0})
WEIGHTS_OPTION = BuildOption(
    "weights", str, "float", "the linear layers, MoE experts, output layer and embedding: float (--dtype), or int4 / "
    "int8 blocks (ONNX Runtime's MatMulNBits, QMoE, GatherBlockQuantized; float32 activations), what CPU deployments "
    "serve (default %(default)s)", WEIGHTS, part=lambda o: _quantized(o, o.weights.name),
    features=lambda o: {"quantized": o.weights.quantized})
WEIGHT_BLOCK = BuildOption("weight_block", int, 32, "weights per quantization block along the inputs (default "
                           "%(default)s)", BLOCKS, part=lambda o: _quantized(o, f"b{o.weights.block}" if
                                                                                 o.weights.block != 32 else ""))
WEIGHT_ZERO_POINTS = BuildOption("weight_zero_points", bool, False, "quantize each block between its min and max with "
                                 "a zero point (default: symmetric, no zero points, as onnxruntime-genai's builder)",
                                 part=lambda o: _quantized(o, "zp" if not o.weights.symmetric else ""))
ACCURACY_LEVEL = BuildOption(
    "accuracy_level", int, 4, "the quantized products' activations: 4 rounds them to int8 per weight block (a decode "
    "step's in ONNX Runtime's MatMulNBits, as onnxruntime-genai's builder's default; a prompt's, 64 new tokens or "
    "more, in MatMulQ4A8 for int4 weights without zero points, on the CPU's integer units, and float32 for int8 "
    "weights); 0 / 1 keep them float32 (default %(default)s)", ACCURACY_LEVELS,
    part=lambda o: _quantized(o, f"acc{o.weights.accuracy_level}" if o.weights.accuracy_level != 4 else ""))
OPS = BuildOption(
    "ops", str, "onnxruntime", "the graph's nodes beside the com.aqua ones: onnxruntime (its contrib fusions "
    "RotaryEmbedding, SkipSimplifiedLayerNormalization, MatMulNBits, MoE: the fastest there) or standard (ai.onnx ops "
    "only, the com.aqua nodes keeping their ONNX function bodies: any ONNX consumer, ONNX's reference evaluator and "
    "shape inference read it; float weights, no routed experts) (default %(default)s)", GRAPH_OPS,
    part=lambda o: f"ops-{o.ops}" if o.ops != "onnxruntime" else "")
TRT_LIMITS = (8, 4096, 1024)  # the TensorRT profiles' largest batch, context and prompt unless asked
RUNTIME = BuildOption(
    "runtime", str, "aqua", "what must serve the folder: aqua (this project's loop; onnxruntime-genai too where it "
    "can), genai (refused before any work when onnxruntime-genai cannot run the settings), tensorrt (also builds "
    "model.engine: needs TensorRT and an NVIDIA GPU) (default %(default)s)", RUNTIMES,
    part=lambda o: "" if o.runtime != "tensorrt" else "-".join(
        ["tensorrt", *(["trt{}x{}x{}".format(*o.trt_limits)] if o.trt_limits != TRT_LIMITS else [])]))
TRT_MAX_BATCH = BuildOption("trt_max_batch", int, TRT_LIMITS[0], "TensorRT profiles: largest batch (default "
                                                                 "%(default)s)")
TRT_MAX_CONTEXT = BuildOption("trt_max_context", int, TRT_LIMITS[1], "TensorRT profiles: largest context in tokens "
                                                                     "(default %(default)s)")
TRT_MAX_PROMPT = BuildOption("trt_max_prompt", int, TRT_LIMITS[2], "TensorRT profiles: longest prompt in tokens "
                                                                   "(default %(default)s)")
EXTERNAL_DATA = BuildOption("external_data", bool, False, "write the weights to model.onnx.data beside model.onnx "
                            "whatever the model's size (above 512 MiB they go there anyway: past 2 GB protobuf cannot "
                            "hold them)")
PARITY_STEPS = BuildOption("parity_steps", int, None, "greedy decode steps of the parity check, >= 1 (default 64, "
                                                      "fewer for a model whose context is shorter)")
PARITY_PROMPT_TOKENS = BuildOption("parity_prompt_tokens", int, None, "real-text prompt length of the parity check, "
                                   ">= 16 (default 256, or what a shorter context leaves; token selection lengthens it "
                                   "until a decode step leaves pages out)")

# the command line's order (docs/cli.md)
OPTIONS = (DTYPE, CACHE_DTYPE, WEIGHTS_OPTION, WEIGHT_BLOCK, WEIGHT_ZERO_POINTS, ACCURACY_LEVEL, OPS, RUNTIME,
           TRT_MAX_BATCH, TRT_MAX_CONTEXT, TRT_MAX_PROMPT, EXTERNAL_DATA, PARITY_STEPS, PARITY_PROMPT_TOKENS)
# the order of a default folder name's parts, after the AQUA settings' (build.default_out)
NAME_ORDER = (DTYPE, WEIGHTS_OPTION, WEIGHT_BLOCK, WEIGHT_ZERO_POINTS, ACCURACY_LEVEL, CACHE_DTYPE, OPS, RUNTIME)


def add_arguments(parser) -> None:
    """Every build option as a command-line option of ``parser``."""
    for o in OPTIONS:
        o.add_to(parser)


@dataclass(frozen=True)
class BuildOptions:
    """How a folder is built (everything but the model and the AQUA settings), as the build takes it."""

    dtype: str = DTYPE.default
    runtime: str = RUNTIME.default  # what must serve the folder (capabilities.RUNTIMES): tensorrt also builds model.engine
    external_data: bool | None = None  # True: always model.onnx.data; None: when the weights are large
    parity_steps: int | None = None  # None: harness.PARITY_STEPS, fewer for a short context (parity_lengths)
    parity_prompt: int | None = None  # None: harness.PROMPT_TOKENS, or what a short context leaves
    trt_limits: tuple[int, int, int] = TRT_LIMITS
    force: bool = False  # replace an existing --out that this tool built
    weights: WeightFormat = WeightFormat()  # the linear layers' storage: float (dtype) or int4 / int8 blocks
    cache_dtype: str | None = None  # the KV cache's type (contract.Contract): None = dtype
    ops: str = OPS.default  # the nodes around the custom ones

    @classmethod
    def from_args(cls, a) -> BuildOptions:
        """From parsed command-line options (add_arguments', and the build's --force)."""
        weights = WeightFormat(bits=None if a.weights == "float" else int(a.weights[3:]), block=a.weight_block,
                               symmetric=not a.weight_zero_points, accuracy_level=a.accuracy_level)
        return cls(dtype=a.dtype, runtime=a.runtime, external_data=True if a.external_data else None,
                   parity_steps=a.parity_steps, parity_prompt=a.parity_prompt_tokens,
                   trt_limits=(a.trt_max_batch, a.trt_max_context, a.trt_max_prompt), force=a.force,
                   weights=weights, cache_dtype=a.cache_dtype, ops=a.ops)

    @property
    def cache(self) -> CacheType:
        """The KV cache's type: --cache-dtype's, or the graph's own."""
        return CACHES[self.cache_dtype or self.dtype]

    def name_parts(self) -> list[str]:
        """The parts a default folder name gets from these options: each that differs from its default."""
        return [p for o in NAME_ORDER for p in [o.part(self)] if p]

    def features(self, config) -> Features:
        """What a build of ``config`` (config.AquaConfig) with these options asks of the code that runs it."""
        fields = {k: v for o in OPTIONS for k, v in o.features(self).items()}
        return dataclasses.replace(Features.of_config(config), **fields)

    def check(self, config) -> None:
        """One ConfigError line for options that cannot be built together or run where asked, before any work."""
        if self.parity_prompt is not None and self.parity_prompt < 16:
            raise ConfigError(f"--parity-prompt-tokens {self.parity_prompt}: give a prompt of 16 or more tokens")
        if self.parity_steps is not None and self.parity_steps < 1:
            raise ConfigError(f"--parity-steps {self.parity_steps}: give 1 or more steps")
        asked = ((OPS, self.ops), (RUNTIME, self.runtime), (DTYPE, self.dtype), (CACHE_DTYPE, self.cache_dtype))
        for opt, value in asked:
            if value is not None and value not in opt.choices:
                raise ConfigError(f"unknown {opt.flag} {value!r}: use one of {', '.join(opt.choices)}")
        if self.weights.quantized and self.dtype != "float32":
            raise ConfigError(f"--weights {self.weights.name} is ONNX Runtime's MatMulNBits with float32 activations: "
                              "build it with --dtype float32 (float16 is the GPU format: drop --weights)")
        capabilities.check(self.features(config), self.runtime)
        if self.ops == "standard":  # a graph for any ONNX consumer: what its function bodies can run
            capabilities.check(self.features(config), "standard")
        if self.cache_dtype is not None:  # the contract's refusals of a cache type, before any work
            Contract.check_cache_dtype(self.dtype, self.cache_dtype, config.evicts)
