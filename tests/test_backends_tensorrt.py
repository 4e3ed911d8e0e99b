"""The TensorRT path: every part that runs without TensorRT is tested here; the engine tests need TensorRT
and an NVIDIA GPU and say so when skipped."""

import onnx
import pytest
from helpers import folder_cfg, tiny_projection

from aqua_export import models
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.export.exporter import contract_for, export_onnx
from aqua_export.ops import topk_gather_dot
from aqua_export.runtime.tensorrt import optimization_profiles, pick_profile
from aqua_export.ops.spec import GROUP
from aqua_export.runtime.tensorrt_plugin import (PLUGIN_FIELDS, PLUGIN_ID, launch_plan, node_contract, output_dims,
                                                 output_type, require_tensorrt, tensorrt_available)


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("trt")
    m, proj = tiny_llama
    out = {}
    for name, cfg in {"k0.5": AquaConfig(k_ratio=0.5), "k0.75-group": AquaConfig(k_ratio=0.75, selection="group")}.items():
        out[name] = (cfg, export_onnx(m, proj, cfg, tmp / f"{name}.onnx", fused=False))
    return m, out



def test_plugin_id_and_fields_match_the_exported_nodes(tiny_exports):
    assert PLUGIN_ID == "aqua::TopKGatherDot" and PLUGIN_FIELDS == {"k": int, "rule": int}
    _, out = tiny_exports
    for name, (cfg, proto) in out.items():
        nodes = node_contract(proto)
        assert len(nodes) == 2 and {n["k"] for n in nodes} == {cfg.selected_width(16)}
        assert [n["name"] for n in nodes] == [f"/model/layers.{i}/attn/TopKGatherDot" for i in range(2)]


def _broken(mutate):
    m = topk_gather_dot.OP.model(k=4)
    mutate(m.graph.node[0])
    return m


@pytest.mark.parametrize("mutate,needle", [
    (lambda n: n.attribute.pop(0), "attributes"),                       # k missing
    (lambda n: setattr(n, "domain", "com.other"), "domain"),
    (lambda n: n.attribute[1].CopyFrom(onnx.helper.make_attribute("plugin_namespace", "trt")), "plugin_namespace"),
    (lambda n: n.attribute[2].CopyFrom(onnx.helper.make_attribute("plugin_version", "2")), "plugin_version"),
    (lambda n: n.attribute[0].CopyFrom(onnx.helper.make_attribute("k", 4.0)), "plugin field is int"),
    (lambda n: n.attribute.append(onnx.helper.make_attribute("extra", 1)), "attributes"),
    (lambda n: n.input.append("x"), "inputs"),
])
def test_node_contract_rejects_what_the_plugin_cannot_take(mutate, needle):
    with pytest.raises(ConfigError, match=needle):
        node_contract(_broken(mutate))


def test_node_contract_needs_a_node():
    m = topk_gather_dot.OP.model(k=4)
    del m.graph.node[:]
    with pytest.raises(ConfigError, match="no TopKGatherDot node"):
        node_contract(m)


class Sym:
    """A stand-in for a TensorRT shape expression: opaque, multipliable."""

    def __init__(self, name):
        self.name = name

    def __mul__(self, other):
        return Sym(f"({self.name}*{getattr(other, 'name', other)})")

    __rmul__ = __mul__


def test_shape_and_type_inference():
    assert output_dims([2, 3, 3, 1, 64], [2, 3, 64, 100], 32) == [2, 3, 3, 1, 100]
    b, s = Sym("B"), Sym("S")
    dims = output_dims([b, 3, 3, 1, 48], [b, 3, 48, s], 36)
    assert dims[0] is b and dims[4] is s and dims[1:4] == [3, 3, 1]
    with pytest.raises(ValueError, match="r = 64, key_cache 48"):
        output_dims([1, 1, 1, 1, 64], [1, 1, 48, 5], 8)
    with pytest.raises(ValueError, match="k = 65"):
        output_dims([1, 1, 1, 1, 64], [1, 1, 64, 5], 65)
    with pytest.raises(ValueError, match="5-D"):
        output_dims([1, 1, 1, 64], [1, 1, 64, 5], 8)
    assert output_type("float16", "float16") == "float16"
    with pytest.raises(ValueError, match="share one of"):
        output_type("float16", "float32")
    with pytest.raises(ValueError):
        output_type("int8", "int8")


def test_launch_plan_grid_and_scalar_arguments():
    plan = launch_plan(48, 36, "float16", rule=GROUP, g=3)
    assert (plan.block_r, plan.block_s) == (64, 128)
    assert plan.signature["q_ptr"] == "*fp16" and list(plan.signature)[:5] == ["q_ptr", "k_ptr", "S", "rows_per_kv", "out_ptr"]
    assert plan.constexprs == {"R": 48, "K": 36, "RULE": 1, "G": 3, "BLOCK_G": 4, "BLOCK_R": 64, "BLOCK_S": 128}
    assert plan.grid([2, 3, 3, 5, 48], [2, 3, 48, 1000]) == (90, 8)
    assert plan.scalar_args([2, 3, 3, 5, 48], [2, 3, 48, 1000]) == (1000, 15)
    with pytest.raises(ValueError):
        launch_plan(48, 49, "float32")


def test_kernel_compiles_ahead_of_time_for_hopper():
    """The aot_impl's compile step, without a GPU: Triton -> PTX for sm_90 with the plugin's argument order."""
    pytest.importorskip("triton", reason="triton is not installed")
    import json
    import os
    import subprocess
    import sys

    # a fresh process: this test session may run Triton's CPU interpreter (test_ops.py),
    # which replaces the language Triton compiles with
    code = ("import json; from aqua_export.runtime.tensorrt_plugin import compile_kernel, launch_plan; "
            "print(json.dumps(compile_kernel(launch_plan(64, 32, 'float32'), arch=90)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    name, ptx, num_warps, shared = json.loads(res.stdout.strip().splitlines()[-1])
    assert name == "topk_gather_dot_kernel" and ".target sm_90" in ptx and f".entry {name}" in ptx
    entry = ptx[ptx.index(f".entry {name}"):]
    params = entry[:entry.index(")")]
    assert params.count(".param .u64") >= 3 and params.count(".param .u32") >= 2  # 3 pointers, S and g*T
    assert num_warps >= 1 and shared >= 0


def test_optimization_profiles(tiny_exports):
    m, out = tiny_exports
    cfg, proto = out["k0.5"]
    profs = optimization_profiles(folder_cfg(m, cfg, fused=False), max_batch=8, max_context=512, max_prompt=128)
    assert len(profs) == 2
    names = [i.name for i in proto.graph.input]
    assert names == contract_for(m, cfg, fused=False).input_names()
    for prof in profs:
        assert list(prof) == names
        for name, (lo, opt, hi) in prof.items():
            rank = len(next(i for i in proto.graph.input if i.name == name).type.tensor_type.shape.dim)
            assert len(lo) == len(opt) == len(hi) == rank
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
    prefill, decode = profs
    assert prefill["past_key_values.0.key"][2][2] == 0 and prefill["input_ids"][2] == (8, 128)
    assert decode["input_ids"][2][1] == 1 and decode["attention_mask"][2] == (8, 512)
    assert decode["past_key_values.1.value"][2] == (8, 2, 511, 16)  # r = d = 16 (no slicing)
    assert pick_profile(profs, {n: s[1] for n, s in prefill.items()}) == 0
    shapes = {n: s[2] for n, s in decode.items()}
    assert pick_profile(profs, shapes) == 1
    shapes["attention_mask"] = (8, 600)
    with pytest.raises(ConfigError, match="outside the engine's optimization profiles"):
        pick_profile(profs, shapes)
    with pytest.raises(ConfigError, match="context > prompt"):
        optimization_profiles(folder_cfg(m, cfg), 8, 128, 128)
    # a request the profiles cannot take is refused before any forward
    from aqua_export.runtime.tensorrt import check_request

    check_request(profs, 8, 128, 384)
    with pytest.raises(ConfigError, match="batch 9 is larger.*--trt-max-batch"):
        check_request(profs, 9, 10, 10)
    with pytest.raises(ConfigError, match="--trt-max-prompt"):
        check_request(profs, 1, 129, 1)
    with pytest.raises(ConfigError, match="context <= 512"):
        check_request(profs, 1, 100, 413)


def test_h2o_has_no_engine_and_is_refused_before_any_work(tmp_path):
    """H2OAttention has no TensorRT plugin: the build says so in one line, before TensorRT is even looked for."""
    from aqua_export.build import build
    from aqua_export.options import BuildOptions

    with pytest.raises(ConfigError) as e:
        build("llama", AquaConfig(k_ratio=0.75, h2o_ratio=0.5), out=str(tmp_path / "x"),
              options=BuildOptions(runtime="tensorrt"))
    assert "--runtime aqua" in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "x").exists()


def test_missing_tensorrt_is_one_line():
    if tensorrt_available():
        pytest.skip("TensorRT is installed here: the missing-TensorRT message cannot be checked")
    with pytest.raises(ConfigError) as e:
        require_tensorrt()
    assert "TensorRT is not installed" in str(e.value) and "\n" not in str(e.value)


def test_engine_matches_onnx_runtime(tmp_path):
    """Build an engine from a tiny export and compare logits with ONNX Runtime (needs TensorRT + GPU)."""
    if not tensorrt_available():
        pytest.skip("TensorRT is not installed on this machine (no package reaches it here): engine build and run "
                    "not exercised")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT is installed but there is no CUDA GPU: engine build and run not exercised")
    import json

    import numpy as np

    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.session import make_session
    from aqua_export.runtime.tensorrt import build_engine, engine_lm

    m = models.tiny_model("llama")
    proj = tiny_projection(m, tmp_path)
    cfg = AquaConfig(k_ratio=0.5)
    export_onnx(m, proj, cfg, tmp_path / "model.onnx", fused=False)
    fcfg = folder_cfg(m, cfg, fused=False)
    (tmp_path / "aqua_config.json").write_text(json.dumps(fcfg))
    build_engine(tmp_path, max_batch=2, max_context=64, max_prompt=16)
    ids = np.arange(3, 15)[None].repeat(2, 0)
    mask = np.ones_like(ids)
    pos = np.arange(12)[None].repeat(2, 0)
    ort = OrtLM(make_session(tmp_path / "model.onnx", kernel="function"), fcfg)
    trt_lm = engine_lm(tmp_path)
    a, _ = ort.step(ids, mask, pos, ort.empty_past(2))
    b, _ = trt_lm.step(ids, mask, pos, trt_lm.empty_past(2))
    assert np.abs(a - b).max() <= 1e-3
