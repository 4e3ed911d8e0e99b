"""Quantized weights (--weights int4 | int8): the block format against ONNX Runtime's own quantizer, the export
(MatMulNBits, QMoE, GatherBlockQuantized) against the reference on the same dequantized weights for every family,
a built int4 folder (parity, both runtimes), a tiny OLMoE running only its chosen experts, serving refusals, and
the perplexity of built folders (ours and onnxruntime-genai's builder's).

Tolerances: exported graph (float32 activations) vs the reference on the folder's weights 1e-4 (tiny models' float32
noise is ~1e-6); the quantization itself must move the logits by more than 1e-3 (else the test could not fail)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import folder_cfg, left_padded, saved_checkpoint, tiny_projection

from aqua_export import models
from aqua_export.cli import main
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.quantize import WeightFormat, quantize, roundtrip


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block", [16, 32, 128])
def test_blocks_equal_onnx_runtimes_quantizer(bits, symmetric, block):
    """Byte for byte what ONNX Runtime's blockwise quantizer (the one onnxruntime-genai's builder calls) writes,
    zero blocks, exact halves and one-signed blocks included."""
    from onnxruntime.capi import _pybind_state as C

    rng = np.random.default_rng(0)
    n, k = 48, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :block], w[1, :block], w[2, :block] = 0, np.linspace(-1, 1, block), np.abs(w[2, :block])
    kb = k // block
    packed = np.zeros((n, kb, block * bits // 8), np.uint8)
    scales = np.zeros(n * kb, np.float32)
    zero = np.zeros(n * ((kb * bits + 7) // 8), np.uint8)
    (C.quantize_matmul_4bits if bits == 4 else C.quantize_matmul_8bits)(packed, np.ascontiguousarray(w.T), scales,
                                                                         zero, block, n, k, symmetric)
    p, s, z = quantize(torch.from_numpy(w), WeightFormat(bits=bits, block=block, symmetric=symmetric))
    assert np.array_equal(p.numpy(), packed) and np.array_equal(s.numpy().reshape(-1), scales)
    assert (z is None) == symmetric and (symmetric or np.array_equal(z.numpy().reshape(-1), zero))


def test_round_trip_is_row_by_row_and_on_its_grid():
    fmt = WeightFormat(bits=4)
    w = torch.randn(40, 64)
    full = roundtrip(w, fmt)
    assert torch.equal(roundtrip(w[7:19], fmt), full[7:19])  # the output layer and embedding go by rows
    assert torch.equal(roundtrip(full, fmt), full)  # dequantized values quantize back to themselves
    assert (full - w).abs().max() > 1e-3  # and they are not the weights


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, False)])
def test_slices_write_the_same_bytes(bits, symmetric, monkeypatch):
    """quantize goes SLICE_ELEMENTS weights at a time (an expert stack's float32 temporaries would otherwise be
    several copies of it); slices that cut an expert's rows anywhere give what one pass gives."""
    from aqua_export import quantize as q

    fmt = WeightFormat(bits=bits, block=32, symmetric=symmetric)
    w = torch.randn(3, 10, 96, dtype=torch.bfloat16)  # [E, N, K]
    whole = quantize(w, fmt)
    monkeypatch.setattr(q, "SLICE_ELEMENTS", 7 * 96)  # 7 rows a slice: slices straddle the experts
    sliced = quantize(w, fmt)
    assert [None if t is None else t.shape for t in whole] == [None if t is None else t.shape for t in sliced]
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(whole, sliced))
    assert whole[0].shape == (3, 10, 3, 32 * bits // 8)


@pytest.mark.parametrize("make,needle", [(lambda: WeightFormat(bits=3), "use --weights int4 or int8"),
                                         (lambda: WeightFormat(bits=4, block=24), "--weight-block 24"),
                                         (lambda: WeightFormat(bits=4, accuracy_level=2), "--accuracy-level 2")])
def test_bad_formats(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


def _ort_logits(path, m, cfg, ids, mask):
    import onnx

    from aqua_export.export.rewrites import all_logits, float_activations
    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.session import make_session

    model = all_logits(float_activations(onnx.load(str(path))))  # the export's arithmetic, without int8 activations
    lm = OrtLM(make_session(model.SerializeToString(), kernel="function"), folder_cfg(m, cfg), "concat", all_rows=True)
    return lm.step(ids.numpy(), mask.numpy(), lm.empty_past(2))[0]


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("olmoe", {"norm_topk_prob": False}),
                                        ("olmoe", {"norm_topk_prob": True}), ("gpt2", {}), ("qwen3", {}),
                                        ("phi3", {}), ("gemma2", {})])
@pytest.mark.parametrize("cfg,fmt", [(AquaConfig(), WeightFormat(bits=4)),
                                     (AquaConfig(k_ratio=0.5, slice_ratio=0.25, selection="weighted"),
                                      WeightFormat(bits=8, symmetric=False, block=16)),
                                     (AquaConfig(k_ratio=0.75, selection="group"),
                                      WeightFormat(bits=4, symmetric=False, block=16))],
                         ids=["dense-int4", "sliced-int8", "group-int4-zero-points"])
def test_quantized_export_equals_the_reference_on_its_weights(tmp_path, arch, extra, cfg, fmt):
    """Every family exported with quantized linear layers, experts (QMoE, both routing rules), output layer and
    embedding computes what the reference computes with the same dequantized weights (ExportedWeights)."""
    from aqua_export.export.exporter import contract_for, export_onnx
    from aqua_export.reference.attention import apply_aqua
    from aqua_export.reference.exported_weights import ExportedWeights
    from aqua_export.reference.precision import computing_in

    m = models.tiny_model(arch, head_dim=32, heads=4, **extra)
    proj = tiny_projection(m, tmp_path)
    if arch == "olmoe" and fmt.bits == 8:  # QMoE's 8-bit experts always take int8 activations
        with pytest.raises(ConfigError, match="--weights int8 with mixture-of-experts layers"):
            export_onnx(m, proj, cfg, tmp_path / "q.onnx", weights=fmt)
        return
    export_onnx(m, proj, cfg, tmp_path / "q.onnx", weights=fmt)
    ids, mask = left_padded(128, [9, 5])
    got = _ort_logits(tmp_path / "q.onnx", m, cfg, ids, mask)
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    weights = ExportedWeights(m, proj, cfg, contract_for(m, cfg, projection=proj), fmt)
    with torch.no_grad(), apply_aqua(m, proj, cfg):
        with computing_in(m, torch.float32, weights):
            ref = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits.numpy()
        unquantized = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits.numpy()
    real = mask.bool().numpy()
    assert np.abs(got - ref)[real].max() <= 1e-4
    assert np.abs(got - unquantized)[real].max() > 1e-3


def test_a_moe_layer_runs_its_chosen_experts_only(tmp_path):
    """OLMoE's experts are one MoE node per layer (QMoE quantized), no batched MatMul over every expert."""

    from aqua_export.export.exporter import export_onnx

    m = models.tiny_model("olmoe", num_experts=8, num_experts_per_tok=2)
    proj = tiny_projection(m, tmp_path)
    for fmt, op in ((WeightFormat(), "MoE"), (WeightFormat(bits=4), "QMoE")):
        g = export_onnx(m, proj, AquaConfig(k_ratio=0.75), tmp_path / f"{op}.onnx", weights=fmt).graph
        ops = [n.op_type for n in g.node]
        assert ops.count(op) == 2 and "MatMul" not in [n.op_type for n in g.node if "/mlp/experts" in n.name]
        k = next(a.i for n in g.node if n.op_type == op for a in n.attribute if a.name == "k")
        assert k == 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return saved_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position_embeddings=256)


BUILD = ["--calib-text", "builtin:gpl-3", "--calib-tokens", "256", "--parity-prompt-tokens", "32", "--parity-steps", "4"]


@pytest.fixture(scope="module")
def int4_folder(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "f"
    assert main(["--model", str(ckpt), "--k-ratio", "0.75", "--weights", "int4", *BUILD, "--out", str(out)]) == 0
    return out


def test_an_int4_build_passes_parity_and_runs_in_both_runtimes(int4_folder, capsys):
    from aqua_export.runtime.folder import FolderConfig

    cfg = FolderConfig.from_folder(int4_folder)
    par = json.loads((int4_folder / "parity.json").read_text())
    assert cfg.weights == WeightFormat(bits=4) and par["pass"] and "int4 blocks of 32" in cfg.info["weights"]
    assert par["ort_vs_reference"]["max_abs_logit_diff_prefill"] <= par["ort_vs_reference"]["tolerance"]
    # reported, not gated: the int8 activations differ from the float32 ones the gates ran (so they really ran those)
    assert par["activation_accuracy"]["max_abs_logit_diff_prefill"] > 0 and "activation_accuracy" not in par["failed"]
    assert par["vs_float_weights"]["max_abs_logit_diff_prefill"] > 1e-3
    outs = []
    for runtime in ("aqua", "genai"):
        assert main(["run", str(int4_folder), "--prompt", "The license", "--max-new-tokens", "8",
                     "--runtime", runtime]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_a_float16_folder_is_refused_on_cpu(ckpt, tmp_path, capsys):
    out = tmp_path / "f16"
    assert main(["--model", str(ckpt), "--k-ratio", "0.75", "--dtype", "float16", *BUILD, "--out", str(out)]) == 0
    capsys.readouterr()
    for cmd in (["run", str(out), "--prompt", "Hi", "--max-new-tokens", "2"],
                ["run", str(out), "--prompt", "Hi", "--max-new-tokens", "2", "--runtime", "genai"],
                ["bench", str(out), "--context", "16", "--steps", "1", "--rounds", "1"],
                ["eval", "--folder", str(out), "--text", "builtin:gpl-3", "--tokens", "64"]):
        assert main(cmd) == 2
        assert "serve a build with --weights int4" in capsys.readouterr().err
    assert main(["--model", str(ckpt), "--weights", "int4", "--dtype", "float16", "--out", str(tmp_path / "x")]) == 2
    assert "build it with --dtype float32" in capsys.readouterr().err


def test_a_request_that_cannot_fit_is_refused_before_loading(int4_folder, monkeypatch, capsys):
    from aqua_export.runtime import session

    monkeypatch.setattr(session, "available_memory", lambda: 2**20)
    assert main(["run", str(int4_folder), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "GiB of weights and" in err and "GiB of memory is available" in err


def test_serving_memory_is_bounded_by_the_folder(int4_folder, capsys):
    """bench's peak memory (a fresh process per folder: loading, context, decode) within 1.3 x the weights + the
    cache + 1 GiB."""
    from aqua_export.runtime.folder import FolderConfig

    assert main(["bench", str(int4_folder), "--context", "128", "--steps", "2", "--rounds", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = FolderConfig.from_folder(int4_folder)
    weights = sum(r["bytes"] for n, r in cfg.files.items() if n.startswith("model.onnx"))
    bound = 1.3 * weights + cfg.contract.cache_bytes(1, 140) + 2**30
    assert 0 < res["folders"][str(int4_folder)]["peak_rss_mb"] * 2**20 <= bound


@pytest.mark.slow
def test_folder_perplexity_equals_the_reference_and_genais_builder(ckpt, tmp_path, capsys):
    """eval --folder: a dense float32 folder's perplexity is the PyTorch model's, and the same checkpoint exported
    by onnxruntime-genai's model builder (fp32) gives it too, through its own graph."""
    from aqua_export import corpus, evaluate

    ours = tmp_path / "dense"
    assert main(["--model", str(ckpt), *BUILD, "--out", str(ours)]) == 0
    theirs = tmp_path / "builder"
    r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(theirs),
                        "-p", "fp32", "-e", "cpu", "-c", str(tmp_path / "cache")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    capsys.readouterr()
    got = []
    for folder in (ours, theirs):
        assert main(["eval", "--folder", str(folder), "--text", "builtin:gpl-3", "--tokens", "256", "--seq-len", "64",
                     "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    model, tok = models.load(str(ckpt))
    ref = evaluate.perplexity(model, tok, corpus.read_text("builtin:gpl-3"), tokens=256, seq_len=64)
    assert got[0]["runtime"] == "aqua" and got[1]["runtime"] == "genai graph"
    for g in got:
        assert g["predicted_tokens"] == ref["predicted_tokens"]
        assert abs(g["nll"] - ref["nll"]) <= 1e-4 * ref["nll"]


@pytest.mark.parametrize("kernel", ["function", "native"])
def test_level_4_int4_products_are_matmul_q4a8_at_every_row_count(tmp_path, kernel):
    """accuracy_level 4 (the default) with int4 weights: every quantized product is one MatMulQ4A8 (int8 activation
    blocks on the integer units, the faster at every row count: quantize.WeightFormat.int8_blocks), the gated MLP's
    gate and up one MatMulQ4A8Gated with its SiLU gate, no If. They round
    the activations, so every forward differs from the graph with float32 activations (rewrites.float_activations,
    which makes them MatMulNBits at level 0 again) by the rounding's size, a prompt's as a decode step's."""
    import onnx

    from aqua_export.export.exporter import export_onnx
    from aqua_export.export.rewrites import all_logits, float_activations
    from aqua_export.quantize import FLOAT_ACTIVATION_ROWS
    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.session import make_session, native_library

    if kernel == "native" and native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    m = models.tiny_model("llama", head_dim=32, heads=4)
    cfg = AquaConfig(k_ratio=0.75)
    proto = export_onnx(m, tiny_projection(m, tmp_path), cfg, tmp_path / "q.onnx", weights=WeightFormat(bits=4))
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMulQ4A8") == 2 * 3 + 1 and ops.count("MatMulQ4A8Gated") == 2  # q/k/v, o, down; the head
    assert "If" not in ops and "MatMulNBits" not in ops and "Sigmoid" not in ops
    floats_proto = float_activations(onnx.load(str(tmp_path / "q.onnx")))  # q/k/v, o, gate/up, down; the head
    back = [n for n in floats_proto.graph.node if n.op_type == "MatMulNBits"]
    assert len(back) == 2 * 4 + 1 and {a.i for x in back for a in x.attribute if a.name == "accuracy_level"} == {0}
    assert [n.op_type for n in floats_proto.graph.node].count("Sigmoid") == 2  # the gates, in standard ops

    def logits(model, lengths):
        lm = OrtLM(make_session(all_logits(model).SerializeToString(), kernel=kernel), folder_cfg(m, cfg), "concat",
                   all_rows=True)
        ids, mask = left_padded(128, lengths)
        return lm.step(ids.numpy(), mask.numpy(), lm.empty_past(len(lengths)))[0]

    t = FLOAT_ACTIVATION_ROWS
    for lengths in ([t, t - 3], [t - 2, t - 5], [t // 2] * 4):
        got, floats = (logits(g, lengths) for g in (onnx.load(str(tmp_path / "q.onnx")), floats_proto))
        diff = np.abs(got - floats).max() / np.abs(floats).max()
        assert 1e-6 < diff < 1e-1, (lengths, diff)  # rounded: 2.2e-2 to 3.4e-2 of the largest logit measured here


def test_level_4_int8_weights_take_int8_activations_for_few_rows_and_float32_for_a_prompt(tmp_path):
    """accuracy_level 4 with int8 weights: the quantized products sit in Ifs on the forward's new tokens a sequence
    (quantize.FLOAT_ACTIVATION_ROWS), one a run of float nodes (blocks.Blocks.rows_choose_activations: a layer's
    q/k/v, its o_proj and MLP with the next layer's q/k/v, the output layer), each branch over the same blocks. A
    forward of that many tokens computes exactly what the graph with float32 activations computes; fewer round them
    to int8, however many rows the batch makes (so batching never changes a sequence's arithmetic)."""
    import onnx

    from aqua_export.export.exporter import export_onnx
    from aqua_export.export.rewrites import all_logits, float_activations
    from aqua_export.quantize import FLOAT_ACTIVATION_ROWS
    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.session import make_session

    m = models.tiny_model("llama", head_dim=32, heads=4)
    cfg = AquaConfig(k_ratio=0.75)
    proto = export_onnx(m, tiny_projection(m, tmp_path), cfg, tmp_path / "q.onnx", weights=WeightFormat(bits=8))
    ifs = [n for n in proto.graph.node if n.op_type == "If"]
    assert "MatMulNBits" not in [n.op_type for n in proto.graph.node] and len(ifs) == 2 + 2  # 2 layers
    for branch, level in (("then_branch", 0), ("else_branch", 4)):
        products = [x for n in ifs for a in n.attribute if a.name == branch for x in a.g.node
                    if x.op_type == "MatMulNBits"]
        assert len(products) == 2 * 4 + 1  # per layer q/k/v, o, gate/up, down; the output layer
        assert {a.i for x in products for a in x.attribute if a.name == "accuracy_level"} == {level}

    def logits(model, lengths):
        lm = OrtLM(make_session(all_logits(model).SerializeToString(), kernel="function"), folder_cfg(m, cfg),
                   "concat", all_rows=True)
        ids, mask = left_padded(128, lengths)
        return lm.step(ids.numpy(), mask.numpy(), lm.empty_past(len(lengths)))[0]

    t = FLOAT_ACTIVATION_ROWS
    for lengths, same in (([t, t - 3], True), ([t - 2, t - 5], False), ([t // 2] * 4, False)):
        got, floats = (logits(g, lengths) for g in (onnx.load(str(tmp_path / "q.onnx")),
                                                    float_activations(onnx.load(str(tmp_path / "q.onnx")))))
        assert np.array_equal(got, floats) == same, lengths
