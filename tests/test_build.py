"""The one-command build on the embedded model (slow), and its bad-input paths (fast: they fail before work)."""

import json

import onnx
import pytest

from aqua_export.cli import main
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.parity.probe import NOISE_FACTOR
from aqua_export.runtime.folder import FolderConfig


@pytest.mark.parametrize("args,needle", [
    (["--k-ratio", "0"], "argument --k-ratio: 0 is out of range"),
    (["--k-ratio", "0.5", "--slice-ratio", "1"], "argument --slice-ratio: 1 is out of range"),
    (["--k-ratio", "0.5", "--projection", "/nonexistent/p.safetensors"], "projection file /nonexistent/p.safetensors does not exist"),
    (["--k-ratio", "0.5", "--runtime", "tensorrt"], "--runtime tensorrt: TensorRT is not installed here"),
    (["--k-ratio", "0.5", "--parity-prompt-tokens", "8"], "--parity-prompt-tokens 8: give a prompt of 16 or more"),
    (["--k-ratio", "0.5", "--parity-steps", "0"], "--parity-steps 0: give 1 or more steps"),
    (["--k-ratio", "0.5", "--cache-dtype", "float16", "--runtime", "tensorrt"], "TensorRT's separate nodes take one"),
    (["--k-ratio", "0.5", "--cache-dtype", "float16", "--h2o-ratio", "0.5"], "AQUA-H2O's slot buffers are kept"),
    (["--k-ratio", "0.5", "--dtype", "float16", "--cache-dtype", "float32"], "a float16 graph caches float16"),
])
def test_bad_build_input_is_one_line(args, needle, capsys, tmp_path):
    rc = main(["--model", "llama", "--out", str(tmp_path / "o")] + args)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert "None" not in err, err  # a flag that was not given is not named with a value
    assert list(tmp_path.iterdir()) == []


def test_unwritable_out(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["--model", "llama", "--k-ratio", "0.5", "--out", str(f / "sub" / "o")]) == 2
    assert f"{f} is a file, not a folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_corrupt_projection(tmp_path, capsys):
    p = tmp_path / "p.safetensors"
    p.write_bytes(b"not a safetensors file at all")
    assert main(["--model", "llama", "--k-ratio", "0.5", "--projection", str(p), "--out", str(tmp_path / "o")]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_build_run_parity_on_the_embedded_model(tmp_path, proj, capsys):
    """k 0.75 build reusing a projection, weights forced to external data (the path models over 2 GB take):
    folder contents, parity gate, one node per layer, run and parity commands, all opening the model by path."""
    import os

    out = tmp_path / "eng"
    assert main(["--model", "llama", "--k-ratio", "0.75", "--projection", str(proj), "--out", str(out),
                 "--parity-steps", "32", "--external-data"]) == 0
    names = sorted(p.name for p in out.iterdir())
    for must in ("model.onnx", "model.onnx.data", "projection.safetensors", "aqua_config.json", "parity.json",
                 "tokenizer.json", "genai_config.json", "config.json", "generation_config.json", "libaqua_ort.so"):
        assert must in names
    # the graph alone stays in model.onnx; the data file has the folder's usual file mode
    assert (out / "model.onnx").stat().st_size < 2_000_000 < (out / "model.onnx.data").stat().st_size
    assert os.stat(out / "model.onnx.data").st_mode == os.stat(out / "aqua_config.json").st_mode
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # parity's graph variants are gone
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    cfg = FolderConfig.from_folder(out)
    assert cfg.contract.widths == (64,) * 30 and cfg.contract.selected == (48,) * 30 and cfg.info["operators"]["AquaAttention"] == 30
    assert "dim-major" in cfg.info["layout"]["key"] and cfg.info["tools"]["onnxruntime"]
    par = json.loads((out / "parity.json").read_text())
    assert par["pass"] and par["prompt_tokens"] == 256 and par["decode_steps"] == 32
    fr = par["ort_vs_reference"]
    assert fr["reference"] == "float64" and fr["tolerance"] == max(1e-3, NOISE_FACTOR * fr["float32_error_prefill"],
                                                                    NOISE_FACTOR * fr["float32_error_decode"])
    assert max(fr["max_abs_logit_diff_prefill"], fr["max_abs_logit_diff_decode"]) <= fr["tolerance"]
    assert fr["top1_agreement_beyond_ties"] == 1.0
    assert par["selection"]["max_gap_of_differing"] <= par["selection"]["near_tie"]
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "AquaAttention" for n in m.graph.node) == 30
    assert "external" in cfg.info["weights"]
    capsys.readouterr()
    assert main(["run", str(out), "--prompt", "What is the GNU GPL?", "--chat", "--max-new-tokens", "12"]) == 0
    assert len(capsys.readouterr().out.strip()) > 0
    assert main(["run", str(out), "--prompt", "Hello", "--prompt", "The license says", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.count("--- ") == 2
    assert main(["parity", str(out), "--steps", "4", "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["pass"] and again["decode_steps"] == 4


@pytest.mark.slow
def test_dense_build_matches_hf(tmp_path, proj):
    out = tmp_path / "dense"
    assert main(["--model", "llama", "--k-ratio", "1", "--projection", str(proj), "--out", str(out),
                 "--parity-steps", "16"]) == 0
    par = json.loads((out / "parity.json").read_text())
    h = par["ort_k1_vs_hf"]
    # against HF's float64 forward, within max(1e-4, 5 x HF's own float32 error on the same forwards): the bound sits
    # above the noise it measures whatever kernels the CPU's instruction set selects
    assert h["reference"] == "float64" and h["graph"] == "the folder's graph" and h["pass"]
    assert 0 < h["float32_error_prefill"] < 1e-3
    assert h["tolerance"] == max(1e-4, NOISE_FACTOR * h["float32_error_prefill"],
                                  NOISE_FACTOR * h["float32_error_decode"])
    assert max(h["max_abs_logit_diff_prefill"], h["max_abs_logit_diff_decode"]) <= h["tolerance"]
    assert h["top1_agreement_beyond_ties"] == 1.0


@pytest.mark.slow
def test_k1_build_passes_parity(tmp_path, proj):
    """k = 1 of 64 (--k-ratio 0.015): one coordinate scores each query, and this model amplifies float32's rounding
    far beyond its dense error (the logits' float32 error here is several times the dense build's ~1e-4, above the
    old fixed 1e-3). Under ORT's selection every row selects as the reference does; the gate's bound is set from
    the error measured on the same forwards."""
    out = tmp_path / "k1"
    assert main(["--model", "llama", "--k-ratio", "0.015", "--projection", str(proj), "--out", str(out),
                 "--parity-steps", "8"]) == 0
    assert FolderConfig.from_folder(out).contract.selected == (1,) * 30
    par = json.loads((out / "parity.json").read_text())
    fr, sel = par["ort_vs_reference"], par["selection"]
    assert par["pass"] and fr["reference"] == "float64" and sel["rows_differing"] == 0
    assert max(fr["float32_error_prefill"], fr["float32_error_decode"]) > 5e-4  # far above the dense model's
    assert fr["tolerance"] == max(1e-3, NOISE_FACTOR * fr["float32_error_prefill"],
                                   NOISE_FACTOR * fr["float32_error_decode"])
    assert max(fr["max_abs_logit_diff_prefill"], fr["max_abs_logit_diff_decode"]) <= fr["tolerance"]


@pytest.mark.slow
def test_float16_build(tmp_path, proj):
    out = tmp_path / "fp16"
    assert main(["--model", "llama", "--k-ratio", "0.75", "--dtype", "float16", "--projection", str(proj),
                 "--out", str(out), "--parity-steps", "8", "--parity-prompt-tokens", "128", "--external-data"]) == 0
    par = json.loads((out / "parity.json").read_text())
    assert par["dtype"] == "float16" and par["pass"]
    # external float16 weights: parity's sessions cast them per node instead of holding float32 copies
    assert "per node" in par["float16_weights"]
    assert par["ort_vs_reference"]["max_abs_logit_diff_prefill"] <= 0.5
    assert par["ort_vs_reference"]["top1_agreement_beyond_ties"] == 1.0
    # own selection and own kernel on the same tokens: float16 rounding may reorder close logits
    assert par["ort_vs_reference_unforced"]["top1_agreement"] >= 0.95
    if "native_vs_function_body" in par:
        assert par["native_vs_function_body"]["top1_agreement"] >= 0.95
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    key = next(i for i in m.graph.input if i.name == "past_key_values.0.key")
    assert key.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


@pytest.mark.slow
def test_memory_h2o_build(tmp_path, proj):
    """AQUA-Memory (energy-allocated: each layer's own width) and AQUA-H2O together on the embedded model: narrow
    caches of different widths, eviction in the graph, parity under ORT's selection and ORT's evictions
    replayed, native kernel against the function body."""
    out = tmp_path / "mh"
    assert main(["--model", "llama", "--k-ratio", "0.75", "--slice-ratio", "0.25", "--slice-alloc", "energy",
                 "--h2o-ratio", "0.5", "--projection", str(proj), "--out", str(out), "--parity-steps", "8",
                 "--parity-prompt-tokens", "96"]) == 0
    cfg = FolderConfig.from_folder(out)
    widths, value_widths = cfg.contract.widths, cfg.contract.value_widths
    assert sum(widths + value_widths) == 2 * 48 * 30 and len(set(widths + value_widths)) > 1
    assert cfg.contract.h2o and cfg.aqua.h2o_ratio == 0.5
    assert cfg.contract.selected == tuple(round(0.75 * w) for w in widths)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    dims = {i.name: i.type.tensor_type.shape.dim[3].dim_value for i in graph.input if i.name.endswith(("key", "value"))}
    assert [dims[f"past_key_values.{i}.key"] for i in range(30)] == list(widths)
    assert [dims[f"past_key_values.{i}.value"] for i in range(30)] == list(value_widths)
    assert "past_key_values.0.token" in cfg.contract.input_names() and "present.29.heavy" in cfg.contract.output_names()
    assert sum(1 for n in graph.node if n.op_type == "H2OAttention") == 30
    assert not (out / "genai_config.json").exists()  # genai cannot evict: the folder is for --runtime aqua
    assert (out / "config.json").exists()  # what lm-eval's folder backend reads
    par = json.loads((out / "parity.json").read_text())
    assert par["pass"]
    fr = par["ort_vs_reference"]
    assert max(fr["max_abs_logit_diff_prefill"], fr["max_abs_logit_diff_decode"]) <= fr["tolerance"] and fr["pass"]
    ev = par["eviction"]
    assert par["prompt_tokens"] == 96 and ev["decisions"] == (96 + 8) * 30 * 3
    assert ev["max_gap_of_differing"] <= ev["near_tie"] and ev["float32_relative_error"] > 0
    from aqua_export.runtime.session import native_library

    if native_library() is not None:
        assert par["kernel"] == "native" and par["native_vs_function_body"]["greedy_identical"]


def test_out_with_other_files_is_never_replaced(tmp_path, capsys):
    """A user's folder is refused whatever the flags, and so is one that only looks built (aqua_config.json = {}):
    checked before any work, nothing touched."""
    for name, files in (("mine", {"notes.txt": "precious"}), ("fake", {"aqua_config.json": "{}", "thesis.txt": "x"})):
        user = tmp_path / name
        user.mkdir()
        for f, text in files.items():
            (user / f).write_text(text)
        for extra in ([], ["--force"]):
            assert main(["--model", "llama", "--k-ratio", "0.5", "--out", str(user), *extra]) == 2
            assert "a folder with files this tool did not write" in capsys.readouterr().err
        assert {p.name: p.read_text() for p in user.iterdir()} == files


def test_force_replaces_only_what_a_build_wrote(tmp_path, capsys):
    """A finished build lists its files in aqua_config.json; --force replaces such a folder only while it holds
    nothing else (a user's file beside the build's is named, and everything is kept)."""
    from aqua_export.build import check_out_dir
    from aqua_export.contract import Contract
    from aqua_export.runtime.folder import FolderConfig, Geometry

    built = tmp_path / "built"
    built.mkdir()
    (built / "model.onnx").write_bytes(b"graph")
    FolderConfig(model="llama", aqua=AquaConfig(), geometry=Geometry(2, 4, 2, 16, 64),
                 contract=Contract(layers=2, kv_heads=2, widths=(16, 16), selected=(16, 16), value_widths=(16, 16),
                                   vocab=100)).seal(built)
    with pytest.raises(ConfigError, match="pass --force to replace it"):
        check_out_dir(built, force=False)
    check_out_dir(built, force=True)  # only the build's own files: replaceable
    (built / "my_results.md").write_text("mine")
    for force in (False, True):
        with pytest.raises(ConfigError, match=r"holds files this tool did not write \(my_results.md\)"):
            check_out_dir(built, force=force)
    assert main(["--model", "llama", "--k-ratio", "0.5", "--out", str(built), "--force"]) == 2
    assert "my_results.md" in capsys.readouterr().err and (built / "my_results.md").read_text() == "mine"


def test_default_names_differ_for_every_setting_that_changes_the_model():
    """Every setting of the table, at a value other than its default, gives its own default folder name: the AQUA
    settings, the build options that change the graph or engine, and where the projection comes from."""
    import dataclasses

    from aqua_export.build import calibration_tag, default_out
    from aqua_export.options import BuildOptions
    from aqua_export.quantize import WeightFormat

    base, tokens = AquaConfig(k_ratio=0.75), dict(token_budget=512)
    int4 = WeightFormat(bits=4)
    table = {  # setting -> (AQUA settings, build options, calibration) differing from the first row in that setting
        "default": (base, BuildOptions(), ""),
        "k_ratio": (AquaConfig(k_ratio=0.5), BuildOptions(), ""),
        "slice_ratio": (AquaConfig(k_ratio=0.75, slice_ratio=0.25), BuildOptions(), ""),
        "slice_alloc": (AquaConfig(k_ratio=0.75, slice_ratio=0.25, slice_alloc="energy"), BuildOptions(), ""),
        "h2o_ratio": (AquaConfig(k_ratio=0.75, h2o_ratio=0.5), BuildOptions(), ""),
        "selection": (AquaConfig(k_ratio=0.75, selection="weighted"), BuildOptions(), ""),
        "k_alloc": (AquaConfig(k_ratio=0.75, k_alloc="energy"), BuildOptions(), ""),
        "token_ratio": (AquaConfig(k_ratio=0.75, token_ratio=0.25), BuildOptions(), ""),
        "token_budget": (AquaConfig(k_ratio=0.75, **tokens), BuildOptions(), ""),
        "token_budget 256": (AquaConfig(k_ratio=0.75, token_budget=256), BuildOptions(), ""),
        "token_sink": (AquaConfig(k_ratio=0.75, token_sink=32, **tokens), BuildOptions(), ""),
        "token_window": (AquaConfig(k_ratio=0.75, token_window=128, **tokens), BuildOptions(), ""),
        "prefill_threshold": (AquaConfig(k_ratio=0.75, prefill_threshold=0.98), BuildOptions(), ""),
        "prefill_stride": (AquaConfig(k_ratio=0.75, prefill_threshold=0.98, prefill_stride=4), BuildOptions(), ""),
        "prefill_k_ratio": (AquaConfig(k_ratio=0.75, prefill_threshold=0.98, prefill_k_ratio=0.5), BuildOptions(), ""),
        "prompt_precision": (AquaConfig(k_ratio=0.75, prompt_precision="bfloat16"), BuildOptions(), ""),
        "dtype": (base, BuildOptions(dtype="float16"), ""),
        "weights": (base, BuildOptions(weights=int4), ""),
        "weights int8": (base, BuildOptions(weights=WeightFormat(bits=8)), ""),
        "weight_block": (base, BuildOptions(weights=dataclasses.replace(int4, block=64)), ""),
        "weight_zero_points": (base, BuildOptions(weights=dataclasses.replace(int4, symmetric=False)), ""),
        "accuracy_level": (base, BuildOptions(weights=dataclasses.replace(int4, accuracy_level=0)), ""),
        "cache_dtype": (base, BuildOptions(cache_dtype="float16"), ""),
        "ops": (base, BuildOptions(ops="standard"), ""),
        "runtime": (base, BuildOptions(runtime="tensorrt"), ""),
        "trt_limits": (base, BuildOptions(runtime="tensorrt", trt_limits=(4, 8192, 1024)), ""),
        "calibration": (base, BuildOptions(), calibration_tag(None, ["builtin:gpl-3"], 16384)),
        "calib_tokens": (base, BuildOptions(), calibration_tag(None, None, 4096)),
    }
    names = {k: default_out("llama", c, o, cal).name for k, (c, o, cal) in table.items()}
    assert names["default"] == "llama-k0.75"
    assert len(set(names.values())) == len(names), names
    assert names["dtype"] == "llama-k0.75-float16" and names["h2o_ratio"] == "llama-k0.75-h0.5"
    assert names["cache_dtype"] == "llama-k0.75-kv-float16" and names["token_budget"] == "llama-k0.75-tb512"
    assert names["prompt_precision"] == "llama-k0.75-bf16"
    # a float32 cache is the float32 graph's own: the same build, the same name
    assert default_out("llama", base, BuildOptions(cache_dtype="float32")).name == names["default"]
    # every setting, and every build option that names its folder, has a row (a new one must show its name part)
    from aqua_export import settings
    from aqua_export.options import NAME_ORDER

    asked = set(settings.SETTINGS) | {o.name for o in NAME_ORDER}
    assert asked <= set(table), sorted(asked - set(table))
