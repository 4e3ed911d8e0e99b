"""TensorRT: the TopKGatherDot plugin, the engine build and the engine runner.

The plugin uses TensorRT's Python plugin API (``tensorrt.plugin``) with an ahead-of-time compiled
Triton kernel (``aot_impl``): the kernel of ``triton_kernel.py`` is compiled to PTX when the engine
is built and embedded in it, so the engine runs without Python. It matches the node the exporter
emits for a TensorRT build (separate attention nodes, export_onnx(fused=False)): op type TopKGatherDot,
plugin_namespace "aqua", plugin_version "1", fields ``k`` and ``rule`` (export.RULES). A plugin for the fused
AquaAttention node does not exist yet: TensorRT builds run scores, softmax and value product as three nodes.

    ONNX (com.aqua::TopKGatherDot, k, rule, plugin_namespace, plugin_version)
      --OnnxParser (plugin override on)--> plugin "aqua::TopKGatherDot"(k, rule)
          describe:  scores [B, Hkv, g, T, S] = query_hat's shape with the last dim of key_cache (the engine
                     runs the concat contract, present = exactly total_length slots, so S = total_length)
          aot_impl:  Triton -> PTX; grid (B*Hkv*g*T, ceil(S / BLOCK_S)); int32 args (S, g*T)
      --builder (strongly typed, two optimization profiles)--> model.engine

Everything here that needs no TensorRT (the node contract, shape and type inference, launch
parameters, optimization profiles) is a plain function, tested on every machine. tensorrt is
imported only inside the functions that build or run an engine; nothing else in the project
imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..export import DOMAIN, OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
# The plugin's fields, as tensorrt.plugin.register declares them. The ONNX parser consumes
# plugin_namespace / plugin_version for the registry lookup and passes every other attribute.
PLUGIN_FIELDS = {"k": int, "rule": int}
RESERVED_ATTRIBUTES = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}
FLOAT_TYPES = ("float32", "float16", "bfloat16")
ENGINE_FILE = "model.engine"
INSTALL_HINT = ("install TensorRT 10.8+ with its Python bindings on a machine with an NVIDIA GPU "
                "(pip install tensorrt, or NVIDIA's tar/deb packages), then rerun; --backend onnx needs none of it")


def require_tensorrt():
    """The tensorrt module, or a one-line ConfigError saying how to get it."""
    try:
        import tensorrt
    except ImportError:
        raise ConfigError(f"--backend tensorrt: TensorRT is not installed here: {INSTALL_HINT}") from None
    major = int(tensorrt.__version__.split(".")[0])
    if major < 10:
        raise ConfigError(f"--backend tensorrt needs TensorRT >= 10.8 (found {tensorrt.__version__}): {INSTALL_HINT}")
    return tensorrt


def tensorrt_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt") is not None


# --------------------------------------------------------------------------------------------
# The node contract (what the plugin expects of every TopKGatherDot node)
# --------------------------------------------------------------------------------------------

def node_contract(model_proto) -> list[dict]:
    """Check every TopKGatherDot node against the plugin: domain, the k field with its type, the
    reserved lookup attributes, nothing else, three inputs (query_hat, key_cache, total_length) and one
    output. Returns [{name, k}]."""
    import onnx

    nodes = [n for n in model_proto.graph.node if n.op_type == OP_TYPE]
    if not nodes:
        raise ConfigError("the model has no TopKGatherDot node: export it with separate attention nodes "
                          "(aqua-export --backend tensorrt does)")
    out = []
    for n in nodes:
        where = n.name or OP_TYPE
        if n.domain != DOMAIN:
            raise ConfigError(f"{where}: domain {n.domain!r}, the plugin expects {DOMAIN!r}")
        if len(n.input) != 3 or len(n.output) != 1:
            raise ConfigError(f"{where}: {len(n.input)} inputs / {len(n.output)} outputs, the plugin takes 3 / 1")
        attrs = {a.name: a for a in n.attribute}
        expected = set(PLUGIN_FIELDS) | set(RESERVED_ATTRIBUTES)
        if set(attrs) != expected:
            raise ConfigError(f"{where}: attributes {sorted(attrs)}, the plugin expects {sorted(expected)}")
        for name, typ in PLUGIN_FIELDS.items():
            want = {int: onnx.AttributeProto.INT, float: onnx.AttributeProto.FLOAT,
                    str: onnx.AttributeProto.STRING}[typ]
            if attrs[name].type != want:
                raise ConfigError(f"{where}: attribute {name} has ONNX type {attrs[name].type}, the plugin field is {typ.__name__}")
        for name, value in RESERVED_ATTRIBUTES.items():
            if attrs[name].type != onnx.AttributeProto.STRING or attrs[name].s.decode() != value:
                raise ConfigError(f"{where}: {name} must be the string {value!r} (the plugin's registry key)")
        k, rule = attrs["k"].i, attrs["rule"].i
        if k < 1 or rule not in (0, 1, 2):
            raise ConfigError(f"{where}: k = {k}, rule = {rule}: k must be >= 1 and rule one of 0, 1, 2")
        out.append({"name": n.name, "k": k, "rule": rule})
    return out


# --------------------------------------------------------------------------------------------
# Shape / type inference and launch parameters (the plugin's logic, without TensorRT)
# --------------------------------------------------------------------------------------------

def output_dims(query_dims: list, key_dims: list, k: int) -> list:
    """scores dims from query_hat [B, Hkv, g, T, r] and key_cache [B, Hkv, r, S]. Dims may be ints or
    symbolic expressions (TensorRT's shape_expr entries); static ones are checked."""
    if len(query_dims) != 5 or len(key_dims) != 4:
        raise ValueError(f"TopKGatherDot: query_hat must be 5-D and key_cache 4-D, got {len(query_dims)}-D and {len(key_dims)}-D")
    r = query_dims[4]
    if isinstance(r, int):
        if isinstance(key_dims[2], int) and key_dims[2] != r:
            raise ValueError(f"TopKGatherDot: query_hat has r = {r}, key_cache {key_dims[2]}")
        if not 1 <= k <= r:
            raise ValueError(f"TopKGatherDot: k = {k} not in [1, r = {r}]")
    return [query_dims[0], query_dims[1], query_dims[2], query_dims[3], key_dims[3]]


def output_type(query_type: str, key_type: str) -> str:
    """The output dtype: that of the inputs, which must agree (strongly typed network)."""
    if query_type not in FLOAT_TYPES or key_type != query_type:
        raise ValueError(f"TopKGatherDot: inputs must share one of {FLOAT_TYPES}, got {query_type} and {key_type}")
    return query_type


@dataclass(frozen=True)
class LaunchPlan:
    """How the AOT kernel is compiled and launched for a given r, k, dtype (S stays dynamic)."""

    r: int
    k: int
    dtype: str
    block_r: int
    block_s: int
    rule: int = 0
    g: int = 1  # query heads per KV head (static in an engine): the group rule reads the group's rows

    @property
    def signature(self) -> dict:
        t = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        return {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "S": "i32", "rows_per_kv": "i32", "out_ptr": f"*{t}",
                "R": "constexpr", "K": "constexpr", "RULE": "constexpr", "G": "constexpr", "BLOCK_G": "constexpr",
                "BLOCK_R": "constexpr", "BLOCK_S": "constexpr"}

    @property
    def constexprs(self) -> dict:
        from ..triton_kernel import group_block

        return {"R": self.r, "K": self.k, "RULE": self.rule, "G": self.g, "BLOCK_G": group_block(self.g),
                "BLOCK_R": self.block_r, "BLOCK_S": self.block_s}

    def grid(self, query_dims: list, key_dims: list) -> tuple:
        """(rows, S blocks), for ints or symbolic dims (which support * and the cdiv given)."""
        rows = query_dims[0] * query_dims[1] * query_dims[2] * query_dims[3]
        s = key_dims[3]
        blocks = -(-s // self.block_s) if isinstance(s, int) else s  # symbolic: caller applies trtp.cdiv
        return rows, blocks

    def scalar_args(self, query_dims: list, key_dims: list) -> tuple:
        """The kernel's int32 arguments in order: S, rows per KV head (g * T)."""
        return key_dims[3], query_dims[2] * query_dims[3]


def launch_plan(r: int, k: int, dtype: str, rule: int = 0, g: int = 1) -> LaunchPlan:
    from ..triton_kernel import block_sizes

    output_type(dtype, dtype)
    if not 1 <= k <= r:
        raise ValueError(f"k = {k} not in [1, r = {r}]")
    # S is dynamic in an engine: size the S block for long caches (the kernel masks the tail)
    block_r, block_s = block_sizes(r, 1 << 20)
    return LaunchPlan(r=r, k=k, dtype=dtype, block_r=block_r, block_s=block_s, rule=rule, g=g)


def compile_kernel(plan: LaunchPlan, arch: int = 90):
    """Triton -> (kernel name, PTX, num_warps, shared memory bytes) for sm_<arch>; needs triton, no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..triton_kernel import jit_kernel

    src = triton.compiler.ASTSource(fn=jit_kernel(), signature=plan.signature, constexprs=plan.constexprs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    return ck.metadata.name, ck.asm["ptx"], ck.metadata.num_warps, ck.metadata.shared


# --------------------------------------------------------------------------------------------
# Optimization profiles
# --------------------------------------------------------------------------------------------

def optimization_profiles(cfg, max_batch: int, max_context: int, max_prompt: int) -> list[dict]:
    """Min / opt / max shapes of every graph input, one profile for prefill (no past, T up to
    max_prompt) and one for decode (T = 1, past up to max_context - 1). (H2O graphs have no engine: their
    H2OAttention node has no plugin.)

    Returns [{input name: (min, opt, max)}], shapes as tuples."""
    if max_batch < 1 or max_prompt < 1 or max_context <= max_prompt:
        raise ConfigError(f"TensorRT profiles need batch >= 1, prompt >= 1 and context > prompt "
                          f"(got batch {max_batch}, prompt {max_prompt}, context {max_context})")
    ct = cfg.contract
    opt_b = max(1, min(max_batch, 8)) if max_batch >= 8 else max_batch

    def shapes(b, t, p):
        return ct.feed_shapes(b, t, p)

    def profile(lo, opt, hi):
        a, o, z = shapes(*lo), shapes(*opt), shapes(*hi)
        return {name: (a[name], o[name], z[name]) for name in a}

    decode = profile((1, 1, 1), (opt_b, 1, max_context // 2), (max_batch, 1, max_context - 1))
    prefill = profile((1, 1, 0), (opt_b, max(1, max_prompt // 2), 0), (max_batch, max_prompt, 0))
    return [prefill, decode]


def check_request(profiles: list[dict], batch: int, prompt: int, new_tokens: int) -> None:
    """Refuse, before any forward, a batch or length the engine's profiles cannot take (one line)."""
    max_batch = max(p["input_ids"][2][0] for p in profiles)
    max_prompt = max(p["input_ids"][2][1] for p in profiles)
    max_total = max(p["attention_mask"][2][1] for p in profiles)
    if batch > max_batch:
        raise ConfigError(f"batch {batch} is larger than the engine's profiles allow ({max_batch}): send fewer prompts "
                          "or rebuild with a larger --trt-max-batch")
    if prompt > max_prompt or prompt + new_tokens > max_total:
        raise ConfigError(f"a {prompt}-token prompt plus {new_tokens} new tokens does not fit the engine's profiles "
                          f"(prompt <= {max_prompt}, context <= {max_total}): shorten it or rebuild with larger "
                          "--trt-max-prompt / --trt-max-context")


def pick_profile(profiles: list[dict], feed_shapes: dict) -> int:
    """Index of the first profile whose ranges contain every input shape."""
    for idx, prof in enumerate(profiles):
        if all(all(lo <= v <= hi for lo, v, hi in zip(prof[n][0], feed_shapes[n], prof[n][2])) for n in prof):
            return idx
    raise ConfigError("input shapes are outside the engine's optimization profiles: rebuild with a larger "
                      "--trt-max-context / --trt-max-batch / --trt-max-prompt")


# --------------------------------------------------------------------------------------------
# With TensorRT: plugin registration, engine build, engine runner
# --------------------------------------------------------------------------------------------

_REGISTERED = False


def register_plugin() -> None:
    """Register "aqua::TopKGatherDot" (describe + autotune + aot_impl) with TensorRT, once."""
    global _REGISTERED
    if _REGISTERED:
        return
    trt = require_tensorrt()
    import tensorrt.plugin as trtp

    dtypes = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}

    @trtp.register(PLUGIN_ID)
    def describe(query_hat: trtp.TensorDesc, key_cache: trtp.TensorDesc, total_length: trtp.TensorDesc,
                 k: int, rule: int) -> trtp.TensorDesc:
        out = query_hat.like()
        dims = output_dims(list(query_hat.shape_expr), list(key_cache.shape_expr), k)
        out.shape_expr[4] = dims[4]
        return out

    @trtp.autotune(PLUGIN_ID)
    def autotune(query_hat, key_cache, total_length, outputs):
        return [trtp.AutoTuneCombination("FP32|FP16|BF16, FP32|FP16|BF16, INT64, FP32|FP16|BF16", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def aot(query_hat: trtp.TensorDesc, key_cache: trtp.TensorDesc, total_length: trtp.TensorDesc, k: int, rule: int,
            outputs, tactic):
        qd, kd = list(query_hat.shape_expr), list(key_cache.shape_expr)
        r, g = qd[4], qd[2]
        if not r.is_constant or not g.is_constant:
            raise ValueError("TopKGatherDot: the retained width r and the group size g must be static in the engine")
        plan = launch_plan(r.constant_value, k, output_type(dtypes[query_hat.dtype], dtypes[key_cache.dtype]), rule,
                           g.constant_value)
        name, ptx, num_warps, shared = compile_kernel(plan, _device_arch())
        rows, s = plan.grid(qd, kd)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = rows
        launch.grid_y = trtp.cdiv(s, plan.block_s)
        launch.block_x = num_warps * 32
        launch.shared_mem = shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in plan.scalar_args(qd, kd)])
        return name.encode(), ptx.encode(), launch, extra

    _REGISTERED = True


def _device_arch() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def build_engine(folder: str | Path, max_batch: int = 8, max_context: int = 4096, max_prompt: int = 1024) -> Path:
    """Parse folder/model.onnx with the plugin, build a strongly typed engine, write model.engine atomically."""
    import json
    import os

    trt = require_tensorrt()
    register_plugin()
    folder = Path(folder)
    cfg = json.loads((folder / "aqua_config.json").read_text())
    import onnx

    node_contract(onnx.load(str(folder / "model.onnx"), load_external_data=False))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    # our plugin shares its name with the model's local function: prefer the plugin
    if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse_from_file(str(folder / "model.onnx")):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConfigError(f"TensorRT could not parse {folder / 'model.onnx'}: {errs}")
    config = builder.create_builder_config()
    profiles = optimization_profiles(cfg, max_batch, max_context, max_prompt)
    for prof in profiles:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise ConfigError("TensorRT failed to build the engine (see its log above)")
    out = folder / ENGINE_FILE
    tmp = folder / f".{ENGINE_FILE}.tmp-{os.getpid()}"
    tmp.write_bytes(bytes(blob))
    os.replace(tmp, out)
    (folder / "tensorrt_profiles.json").write_text(json.dumps(
        [{n: [list(s) for s in v] for n, v in p.items()} for p in profiles], indent=1))
    return out


class TrtSession:
    """An engine behind the slice of ONNX Runtime's session API that runtime.OrtLM uses (get_inputs,
    run), so the same generation loop and batching drive it."""

    @dataclass(frozen=True)
    class _Arg:
        name: str

    def __init__(self, folder: str | Path):
        import json

        import torch

        trt = require_tensorrt()
        register_plugin()
        folder = Path(folder)
        if not (folder / ENGINE_FILE).is_file():
            raise ConfigError(f"{folder} has no {ENGINE_FILE}: build it with `aqua-export ... --backend tensorrt`")
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine((folder / ENGINE_FILE).read_bytes())
        self.profiles = [{n: tuple(tuple(s) for s in v) for n, v in p.items()}
                         for p in json.loads((folder / "tensorrt_profiles.json").read_text())]
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for idx in range(len(self.profiles)):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(idx, self.stream.cuda_stream)
            self.contexts.append(ctx)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def get_inputs(self):
        return [self._Arg(n) for n in self.inputs]

    def run(self, output_names, feed: dict):
        import numpy as np
        import torch

        idx = pick_profile(self.profiles, {n: tuple(v.shape) for n, v in feed.items()})
        ctx = self.contexts[idx]
        keep = []
        for name in self.inputs:
            t = torch.from_numpy(np.ascontiguousarray(feed[name])).cuda()
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = _torch_dtype(self.engine.get_tensor_dtype(name))
            t = torch.empty(shape, dtype=dtype, device="cuda")
            ctx.set_tensor_address(name, t.data_ptr())
            outs.append(t)
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        return [t.cpu().numpy() for t in outs]


def _torch_dtype(trt_dtype):
    import tensorrt as trt
    import torch

    return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}[trt_dtype]


def engine_lm(folder: str | Path):
    """runtime.OrtLM driving the folder's TensorRT engine."""
    from ..folder import FolderConfig
    from ..runtime import OrtLM

    return OrtLM(TrtSession(folder), FolderConfig.from_folder(folder), cache="concat")



def _polygraphy_main(argv: list[str]) -> int:
    """`python -m aqua_export.backends.tensorrt polygraphy ARGS...`: Polygraphy with the plugin registered
    in its process (TensorRT Python plugins live in the process that builds the engine)."""
    import sys

    register_plugin()
    try:
        from polygraphy.tools._main import main as polygraphy
    except ImportError:
        raise ConfigError("Polygraphy is not installed: pip install polygraphy") from None
    sys.argv = ["polygraphy", *argv]
    return int(polygraphy() or 0)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2 or sys.argv[1] != "polygraphy":
        print("usage: python -m aqua_export.backends.tensorrt polygraphy run MODEL --onnxrt --trt ...", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(_polygraphy_main(sys.argv[2:]))
    except ConfigError as e:
        print(f"aqua-export: error: {e}", file=sys.stderr)
        sys.exit(2)
