"""Every setting x backend pair of capabilities.REFUSALS' table: it runs (a tiny model exported and run, or its
graph written for TensorRT) or it is refused with the table's one line, wherever a folder is opened or built."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import folder_cfg

from aqua_export import capabilities
from aqua_export.build import check_options
from aqua_export.capabilities import BACKENDS, REFUSALS, Features
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.export.exporter import export_onnx
from aqua_export.options import BuildOptions
from aqua_export.quantize import WeightFormat
from aqua_export.runtime.lm import OrtLM
from aqua_export.runtime.session import native_library, native_variant

# feature -> (the AQUA settings, the build's dtype / cache dtype / weights) that ask for it
ASKS = {"h2o": (dict(k_ratio=0.5, h2o_ratio=0.5), {}),
        "tokens": (dict(k_ratio=0.5, token_budget=32), {}),
        "prefill": (dict(k_ratio=0.5, prefill_threshold=0.9), {}),
        "prompt_bf16": (dict(k_ratio=0.5, prompt_precision="bfloat16"), {}),
        "shared_k": (dict(k_ratio=0.5, k_alloc="energy"), {}),
        "uneven_widths": (dict(slice_ratio=0.5, slice_alloc="energy"), {}),
        "narrow_cache": (dict(k_ratio=0.5), dict(cache_dtype="float16")),
        "int8_cache": (dict(k_ratio=0.5), dict(cache_dtype="int8")),
        "float16": (dict(k_ratio=0.5), dict(dtype="float16")),
        "quantized": (dict(k_ratio=0.5), dict(weights=WeightFormat(bits=4)))}
PAIRS = [(f.name, b) for f in dataclasses.fields(Features) for b in BACKENDS]


def test_every_feature_has_a_way_to_ask_for_it():
    assert set(ASKS) == {f.name for f in dataclasses.fields(Features)}
    assert all(line.count("\n") == 0 and "--" in line for line in REFUSALS.values())  # one line naming the fix


def _features(config, o):
    return BuildOptions(**o).features(config)


@pytest.mark.parametrize("feature", list(ASKS))
def test_the_build_refuses_what_its_runtime_cannot_run(feature):
    """--runtime genai / tensorrt: the table's line before any work (tensorrt's supported pairs then stop at TensorRT
    not being installed here, a line of its own)."""
    settings, o = ASKS[feature]
    config = AquaConfig(**settings)
    assert getattr(_features(config, o), feature)
    for runtime in ("aqua", "genai", "tensorrt"):
        line = REFUSALS.get((feature, runtime))
        opts = BuildOptions(runtime=runtime, **o)
        if line is None and runtime != "tensorrt":
            check_options(opts, config)
            continue
        with pytest.raises(ConfigError) as e:
            check_options(opts, config)
        assert str(e.value) == line if line else "TensorRT" in str(e.value), (feature, runtime, str(e.value))


@pytest.mark.parametrize("feature,backend", PAIRS)
def test_every_pair_runs_or_is_refused_in_one_line(tiny_llama, tmp_path, feature, backend):
    model, proj = tiny_llama
    settings, o = ASKS[feature]
    config = AquaConfig(**settings)
    line = capabilities.refusal(_features(config, o), backend)
    implied = ("narrow_cache",) if feature == "int8_cache" else ()  # an int8 cache is a narrow one too
    assert line == next((REFUSALS[f, backend] for f in (*implied, feature) if (f, backend) in REFUSALS), None)
    dtype = o.get("dtype", "float32")
    cfg = dataclasses.replace(folder_cfg(model, config, dtype, proj), weights=o.get("weights", WeightFormat()))
    cfg = dataclasses.replace(cfg, contract=dataclasses.replace(cfg.contract, cache_dtype=o.get("cache_dtype", dtype)))
    assert getattr(Features.of_folder(cfg), feature), "the folder's contract must say what the build asked"
    if backend == "triton":  # the Triton kernels serve the reference on a GPU: tests/test_ops.py holds them to float64
        assert (line is None) == (feature != "int8_cache")
        return
    if backend == "serve":
        return _serve_or_refuse(model, proj, config, cfg, o, line, tmp_path)
    if backend == "standard":
        return _standard_or_refuse(model, proj, config, cfg, o, line, tmp_path)
    if line is not None:
        with pytest.raises(ConfigError) as e:
            if backend == "genai":
                cfg.contract.genai_io()
            elif backend == "tensorrt":
                export_onnx(model, proj, config, tmp_path / "m.onnx", fused=False, **_export_args(o))
            else:
                OrtLM.open(tmp_path / "never-read.onnx", cfg, kernel=backend)
        assert str(e.value) == line
        return
    if backend == "genai":
        cfg.contract.genai_io()
        return
    if feature == "float16":
        pytest.skip("a float16 folder is built from a float16 model, which the tiny fixture is not: tests/test_build.py "
                    "builds and runs one with --kernel function")
    path = tmp_path / "m.onnx"
    export_onnx(model, proj, config, path, fused=backend != "tensorrt", **_export_args(o))
    if backend == "tensorrt":
        return  # the graph TensorRT parses; the engine needs TensorRT (tests/test_backends_tensorrt.py, on a GPU)
    if backend == "native" and (native_library() is None or not native_variant()):
        pytest.skip("the native kernels are not built here (make plugin)")
    lm = OrtLM.open(path, cfg, kernel=backend)
    ids = np.array([[5, 9, 17, 33, 2, 44, 8, 19]], np.int64)
    out = lm.generate(ids, np.ones_like(ids), _greedy(2))
    assert out.shape == (1, 2)


def _export_args(o):
    return {"cache_dtype": o.get("cache_dtype"), "weights": o.get("weights", WeightFormat()),
            "dtype": getattr(torch, o.get("dtype", "float32"))}


def _greedy(n):
    from aqua_export.runtime.sampling import SamplingConfig

    return SamplingConfig(max_new_tokens=n)


def _standard_or_refuse(model, proj, config, cfg, o, line, tmp_path):
    """--ops standard: refused before any work in the table's line, or the graph of standard ops beside the com.aqua
    nodes runs in ONNX's reference evaluator (their function bodies) with ONNX Runtime's logits, on the feed
    `aqua-export run`'s loop gives it (a prompt, then a decode step)."""
    import warnings

    import onnx
    from onnx.reference import ReferenceEvaluator

    if line is not None:
        with pytest.raises(ConfigError) as e:
            check_options(BuildOptions(ops="standard", **o), config)
        assert str(e.value) == line
        return
    if o.get("dtype") == "float16":
        pytest.skip("a float16 folder is built from a float16 model, which the tiny fixture is not")
    check_options(BuildOptions(ops="standard", **o), config)
    path = tmp_path / "m.onnx"
    export_onnx(model, proj, config, path, ops="standard", **_export_args(o))
    m = onnx.load(path)
    assert {n.domain for n in m.graph.node} == {"", "com.aqua"}
    lm = OrtLM.open(path, cfg, kernel="function", cache="concat")  # every input in the feed: the evaluator reruns it
    runs, run = [], lm.session.run
    lm.session.run = lambda names, feed, *a, **k: runs.append((feed, run(names, feed, *a, **k))) or runs[-1][1]
    ids = np.array([[5, 9, 17, 33, 2, 44, 8, 19]], np.int64)
    lm.generate(ids, np.ones_like(ids), _greedy(2))
    assert len(runs) >= 2, "the loop's forwards went past the recorder"
    evaluator = ReferenceEvaluator(m)
    for feed, got in runs:
        with warnings.catch_warnings():  # the bodies divide by a soft-cap of 0 on the branch Where drops
            warnings.simplefilter("ignore", RuntimeWarning)
            want = evaluator.run(None, feed)[0]
        assert np.isfinite(want[:, -1]).all() and np.abs(want[:, -1] - got[0][:, -1]).max() <= 1e-4


def _serve_or_refuse(model, proj, config, cfg, o, line, tmp_path):
    """`aqua-export serve`'s engine: refused in the table's line, or two sequences batched together give the tokens
    each gives alone (greedy, OrtLM.generate)."""
    from aqua_export.serving.engine import Engine, Sequence

    if o.get("dtype") == "float16":
        pytest.skip("a float16 folder is built from a float16 model, which the tiny fixture is not (and serving it on "
                    "a CPU is refused: runtime.session.check_serving)")
    path = tmp_path / "m.onnx"
    export_onnx(model, proj, config, path, **_export_args(o))
    lm = OrtLM.open(path, cfg)
    if line is not None:
        with pytest.raises(ConfigError) as e:
            Engine(lm, max_seqs=2, context=64)
        assert str(e.value) == line
        return
    prompts = [np.array([5, 9, 17, 33, 2, 44, 8, 19]), np.array([7, 3, 60, 21, 9])]
    engine = Engine(lm, max_seqs=2, context=64, chunk=4)
    seqs = [Sequence(p, _greedy(6), lambda t, f: None) for p in prompts]
    for s in seqs:
        engine.submit(s)
    while engine.busy():
        engine.turn()
    for p, s in zip(prompts, seqs):
        alone = lm.generate(p[None], np.ones((1, len(p)), np.int64), _greedy(6))[0]
        assert s.out == alone.tolist()


def test_a_standard_graph_runs_sparse_prefill_and_the_bfloat16_prompt_in_any_onnx_consumer(tiny_llama, tmp_path):
    """--ops standard with sparse prefill and --prompt-precision bfloat16 (they passed the up-front checks with nothing
    said; the capability table's standard column now says they run): a 448-token prompt, long enough for sparse query
    blocks, through ONNX's reference evaluator gives ONNX Runtime's function-body logits, and they differ from a dense
    prompt's (threshold 0.5: blocks were dropped); the bfloat16 attribute is the function body's float32
    (capabilities.NOTES)."""
    import warnings

    import onnx
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from aqua_export.runtime.session import make_session

    class GatherElements(OpRun):  # ONNX's own is numpy.choose, which takes at most 64 entries along the axis
        op_domain = ""

        def _run(self, data, indices, axis=None):
            return (np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis),)

    model, proj = tiny_llama
    outs = {}
    for name, extra in (("sparse", dict(prefill_threshold=0.5, prompt_precision="bfloat16")), ("dense", {})):
        config = AquaConfig(k_ratio=0.5, **extra)
        check_options(BuildOptions(ops="standard"), config)
        path = tmp_path / f"{name}.onnx"
        export_onnx(model, proj, config, path, ops="standard")
        m = onnx.load(path)
        ids = (np.arange(448)[None] * 7 % 120 + 3).astype(np.int64)  # the tiny vocabulary: 128
        dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input[2:]}
        empty = {n: np.zeros([1, d[1], 0, *d[3:]], np.float32) for n, d in dims.items()}  # batch 1, nothing cached
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), **empty}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            outs[name] = ReferenceEvaluator(m, new_ops=[GatherElements]).run(None, feed)[0][:, -1]
        got = make_session(path, kernel="function").run(None, feed)[0][:, -1]
        assert np.abs(outs[name] - got).max() <= 1e-4, name
    assert np.abs(outs["sparse"] - outs["dense"]).max() > 1e-4, "sparse prefill dropped no block"
