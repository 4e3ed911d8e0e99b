"""TensorRT engines of a built folder: the optimization profiles, the engine build (with the plugin of
tensorrt_plugin.py) and the engine runner behind runtime.lm.OrtLM's loop.

    python -m aqua_export.runtime.tensorrt polygraphy run MODEL --onnxrt --trt ...   (Polygraphy, plugin registered)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from .folder import FolderConfig
from .lm import OrtLM
from .tensorrt_plugin import node_contract, register_plugin, require_tensorrt

ENGINE_FILE = "model.engine"


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
            raise ConfigError(f"{folder} has no {ENGINE_FILE}: build it with `aqua-export ... --runtime tensorrt`")
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
    return OrtLM(TrtSession(folder), FolderConfig.from_folder(folder), cache="concat")



def _polygraphy_main(argv: list[str]) -> int:
    """`python -m aqua_export.runtime.tensorrt polygraphy ARGS...`: Polygraphy with the plugin registered
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
        print("usage: python -m aqua_export.runtime.tensorrt polygraphy run MODEL --onnxrt --trt ...", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(_polygraphy_main(sys.argv[2:]))
    except ConfigError as e:
        print(f"aqua-export: error: {e}", file=sys.stderr)
        sys.exit(2)
