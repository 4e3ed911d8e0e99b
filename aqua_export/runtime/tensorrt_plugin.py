"""TensorRT's TopKGatherDot plugin (the engine build and runner: tensorrt.py).

The plugin uses TensorRT's Python plugin API (``tensorrt.plugin``) with an ahead-of-time compiled
Triton kernel (``aot_impl``): the kernel of ``kernels/triton/topk_gather_dot.py`` is compiled to PTX when the engine
is built and embedded in it, so the engine runs without Python. It matches the node the exporter
emits for a TensorRT build (separate attention nodes, export_onnx(fused=False)): op type TopKGatherDot,
plugin_namespace "aqua", plugin_version "1", fields ``k`` and ``rule`` (ops.spec rule codes). A plugin for the fused
AquaAttention node does not exist yet: TensorRT builds run scores, softmax and value product as three nodes.

    ONNX (com.aqua::TopKGatherDot, k, rule, plugin_namespace, plugin_version)
      --OnnxParser (plugin override on)--> plugin "aqua::TopKGatherDot"(k, rule)
          describe:  scores [B, Hkv, g, T, S] = query_hat's shape with the last dim of key_cache (the engine
                     runs the concat contract, present = exactly total_length slots, so S = total_length)
          aot_impl:  Triton -> PTX; grid (B*Hkv*g*T, ceil(S / BLOCK_S)); int32 args (S, g*T)
      --builder (strongly typed, two optimization profiles)--> model.engine

Everything here that needs no TensorRT (the node contract, shape and type inference, launch
parameters) is a plain function, tested on every machine. tensorrt is imported only inside the functions that
register the plugin or build and run an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from ..kernels.triton.select import group_block
from ..kernels.triton.topk_gather_dot import block_sizes, jit_kernel
from ..ops import topk_gather_dot
from ..ops.spec import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION

OP_TYPE = topk_gather_dot.OP.name  # the node the plugin implements
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
# The plugin's fields, as tensorrt.plugin.register declares them. The ONNX parser consumes
# plugin_namespace / plugin_version for the registry lookup and passes every other attribute.
PLUGIN_FIELDS = {"k": int, "rule": int}
RESERVED_ATTRIBUTES = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}
FLOAT_TYPES = ("float32", "float16", "bfloat16")
INSTALL_HINT = ("install TensorRT 10.8+ with its Python bindings on a machine with an NVIDIA GPU "
                "(pip install tensorrt, or NVIDIA's tar/deb packages), then rerun; --runtime aqua needs none of it")


def require_tensorrt():
    """The tensorrt module, or a one-line ConfigError saying how to get it."""
    try:
        import tensorrt
    except ImportError:
        raise ConfigError(f"--runtime tensorrt: TensorRT is not installed here: {INSTALL_HINT}") from None
    major = int(tensorrt.__version__.split(".")[0])
    if major < 10:
        raise ConfigError(f"--runtime tensorrt needs TensorRT >= 10.8 (found {tensorrt.__version__}): {INSTALL_HINT}")
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
                          "(aqua-export --runtime tensorrt does)")
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

    src = triton.compiler.ASTSource(fn=jit_kernel(), signature=plan.signature, constexprs=plan.constexprs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    return ck.metadata.name, ck.asm["ptx"], ck.metadata.num_warps, ck.metadata.shared


# --------------------------------------------------------------------------------------------
# With TensorRT: the plugin registered
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
