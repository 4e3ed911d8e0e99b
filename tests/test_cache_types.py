"""The cache's type under a float32 graph: float16 and int8 builds of the embedded model, gated, run in both runtimes
(a module of their own, so that pytest-xdist runs them beside test_build.py's builds)."""

import dataclasses
import json

import onnx
import pytest

from aqua_export.cli import main
from aqua_export.runtime.folder import FolderConfig


@pytest.mark.slow
def test_float16_cache_build(tmp_path, proj, capsys):
    """A float32 graph caching float16 (--cache-dtype float16): the gates run on the same graph caching float32
    and pass as a float32 build's do; the folder's own run agrees with it on top-1 (the rounding's logit differences
    reported); the cache inputs and outputs are float16, everything else float32; it runs."""
    out = tmp_path / "kv16"
    assert main(["--model", "llama", "--k-ratio", "0.75", "--cache-dtype", "float16", "--projection", str(proj),
                 "--out", str(out), "--parity-steps", "8", "--parity-prompt-tokens", "128"]) == 0
    par = json.loads((out / "parity.json").read_text())
    assert par["pass"] and par["dtype"] == "float32" and par["ort_vs_reference"]["reference"] == "float64"
    fr, c = par["ort_vs_reference"], par["cache_rounding"]
    assert max(fr["max_abs_logit_diff_prefill"], fr["max_abs_logit_diff_decode"]) <= fr["tolerance"] <= 2e-3
    assert c["pass"] and c["cache_dtype"] == "float16" and c["top1_agreement"] >= 0.95
    # the rounding shows (float16 K^ and V are not float32's), far above the float32 gate's bound
    assert c["max_abs_logit_diff_decode"] > fr["tolerance"]
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.input) + list(m.graph.output)}
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert types["past_key_values.3.key"] == types["present.29.value"] == f16 and types["logits"] == f32
    assert sum(n.name.endswith("/CastCache") for n in m.graph.node) == 2 * 30
    cfg = FolderConfig.from_folder(out)
    assert cfg.contract.cache_dtype == "float16" and "float16" in cfg.info["layout"]["key"]
    assert cfg.contract.cache_bytes(1, 100) * 2 == dataclasses.replace(cfg.contract, cache_dtype="float32").cache_bytes(1, 100)
    capsys.readouterr()
    assert main(["run", str(out), "--prompt", "The license says", "--max-new-tokens", "8"]) == 0
    assert len(capsys.readouterr().out.strip()) > 0


@pytest.mark.slow
def test_int8_cache_build(tmp_path, proj, capsys):
    """A float32 graph caching int8 rows (--cache-dtype int8) under token selection: the gates run on the same graph
    caching float32 (rewrites.float32_cache) and pass as a float32 build's do; the folder's own run agrees with it
    at gates.cache_gate's bar; the buffers are int8 and one exponent wider, a quarter of float32's bytes, holding k^ / w^s
    with the rest of the weighted rule's w on the nodes; it runs in both runtimes, the same tokens."""
    out = tmp_path / "kv8"
    assert main(["--model", "llama", "--k-ratio", "0.5", "--selection", "group-weighted", "--token-budget", "64",
                 "--cache-dtype", "int8", "--projection", str(proj), "--out", str(out), "--parity-steps", "8",
                 "--parity-prompt-tokens", "128"]) == 0
    par = json.loads((out / "parity.json").read_text())
    fr, c = par["ort_vs_reference"], par["cache_rounding"]
    assert par["pass"] and max(fr["max_abs_logit_diff_prefill"], fr["max_abs_logit_diff_decode"]) <= fr["tolerance"]
    assert c["pass"] and c["cache_dtype"] == "int8" and c["max_abs_logit_diff_decode"] > fr["tolerance"]
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ins = {v.name: v.type.tensor_type for v in m.graph.input}
    assert ins["past_key_values.3.key"].elem_type == onnx.TensorProto.INT8
    assert ins["past_key_values.3.key"].shape.dim[-1].dim_value == 65
    # a weighted rule's int8 rows hold k^ / w^s, each node dividing by w^(1 - s) (fold.selection_bases)
    nodes = [n for n in m.graph.node if n.op_type == "AquaAttention"]
    weights = [next(a.floats for a in n.attribute if a.name == "key_weights") for n in nodes]
    assert len(nodes) == 30 and all(len(w) == 3 * 64 and min(w) > 0 and max(w) > 2 * min(w) for w in weights)
    assert "key_weights" in next(f for f in m.functions if f.name == "AquaAttention").attribute
    cfg = FolderConfig.from_folder(out)
    f32 = dataclasses.replace(cfg.contract, cache_dtype="float32")
    assert cfg.contract.cache_bytes(1, 100) == f32.cache_bytes(1, 100) // 4 + 2 * 30 * 3 * 100
    assert json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["head_size"] == 65
    said = []
    for runtime in ("aqua", "genai"):
        capsys.readouterr()
        assert main(["run", str(out), "--prompt", "The license says", "--max-new-tokens", "8", "--runtime", runtime]) == 0
        said.append(capsys.readouterr().out)
    assert said[0] == said[1] and said[0].strip()
