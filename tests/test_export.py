import dataclasses

import numpy as np
import onnx
import pytest
import torch
from helpers import folder_cfg, left_padded, tiny_projection

from aqua_export import models
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.contract import Contract
from aqua_export.export.exporter import check_exportable, contract_for, export_onnx
from aqua_export.ops.catalogue import BY_NAME, OPS
from aqua_export.ops.spec import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, SELECTIONS
from aqua_export.reference.attention import apply_aqua
from aqua_export.runtime.lm import OrtLM
from aqua_export.runtime.session import make_session

OP_TYPE, ATTENTION, H2O = "TopKGatherDot", "AquaAttention", "H2OAttention"
KEY_UPDATE, VALUE_UPDATE = "KeyCacheUpdate", "ValueCacheUpdate"
assert {OP_TYPE, ATTENTION, H2O, KEY_UPDATE, VALUE_UPDATE} <= set(BY_NAME)

# (AQUA settings, the runtime's cache: one buffer written in place, or a new present per step)
CONFIGS = [(AquaConfig(), "concat"), (AquaConfig(k_ratio=0.5), "concat"),
           (AquaConfig(k_ratio=0.75, slice_ratio=0.25), "concat"), (AquaConfig(k_ratio=0.75, h2o_ratio=0.5), "concat"),
           (AquaConfig(), "shared"), (AquaConfig(k_ratio=0.75, slice_ratio=0.25), "shared"),
           # every selection rule the reference offers (weighted ones fold rms(k^) into P)
           (AquaConfig(k_ratio=0.5, selection="group"), "shared"), (AquaConfig(k_ratio=0.5, selection="weighted"), "concat"),
           (AquaConfig(k_ratio=0.5, selection="group-weighted"), "shared"),
           (AquaConfig(k_ratio=0.5, selection="static"), "concat"),
           (AquaConfig(k_ratio=0.75, h2o_ratio=0.5, selection="group-weighted"), "shared")]
IDS = ["dense", "k0.5", "memory", "h2o", "dense-shared", "memory-shared", "group", "weighted", "group-weighted",
       "static", "h2o-group-weighted"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_llama):
    """One tiny llama exported at every setting of CONFIGS (export is the slow part)."""
    tmp = tmp_path_factory.mktemp("export")
    m, proj = tiny_llama
    out = {}
    for cfg, kv in CONFIGS:
        path = tmp / f"m-{cfg.k_ratio}-{cfg.slice_ratio}-{cfg.h2o_ratio}-{cfg.selection}-{kv}.onnx"
        proto = export_onnx(m, proj, cfg, path)
        out[cfg, kv] = (path, proto)
    return m, proj, out


@pytest.mark.parametrize("cfg,kv", CONFIGS, ids=IDS)
def test_graph_contract(exported, cfg, kv):
    m, _, out = exported
    path, proto = out[cfg, kv]
    # one attention node per layer: the fused one, or H2O's (cache updates and eviction inside)
    h2o = cfg.evicts
    op = H2O if h2o else ATTENTION
    nodes = [n for n in proto.graph.node if n.domain == DOMAIN and n.op_type in (OP_TYPE, ATTENTION, H2O)]
    assert [n.name for n in nodes] == [f"/model/layers.0/attn/{op}", f"/model/layers.1/attn/{op}"]
    r, k = cfg.retained_width(16), cfg.selected_width(16)
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs == {"k": k, "rule": SELECTIONS[cfg.selection][0], "plugin_namespace": PLUGIN_NAMESPACE.encode(),
                         "plugin_version": PLUGIN_VERSION.encode(), "softcap": 0.0,
                         **({"ratio": 0.5} if h2o else {"sliding_window": 0})}
    # the attention node takes P_q and projects q itself (no q MatMulP node); a dense graph has no P at all
    projected = not cfg.is_dense
    assert all(len(n.input) == (8 if h2o else 5) + projected for n in nodes)
    assert all(n.input[-1].endswith(".P_q") == projected for n in nodes)
    assert not [n.name for n in proto.graph.node if n.name.endswith("/q/MatMulP")]
    assert [(f.domain, f.name) for f in proto.functions] == [(DOMAIN, op.name) for op in OPS]
    used = ({H2O} if h2o else {KEY_UPDATE, VALUE_UPDATE, ATTENTION}) | {"LogitRows"}  # the head's rows
    assert {n.op_type for n in proto.graph.node if n.domain == DOMAIN} == used
    assert proto.ir_version <= 10
    ct = contract_for(m, cfg)
    assert [i.name for i in proto.graph.input] == ct.input_names()
    assert [o.name for o in proto.graph.output] == ct.output_names()
    # positions come from the mask, always (H2O's slots included)
    assert "position_ids" not in ct.input_names() and "cache_position" not in ct.input_names()
    # K and V of the same width r, declared [B, Hkv, past, r] (what onnxruntime-genai allocates)
    for name in ("past_key_values.0.key", "past_key_values.0.value", "present.1.key", "present.1.value"):
        dims = next(i for i in list(proto.graph.input) + list(proto.graph.output) if i.name == name).type.tensor_type.shape.dim
        assert dims[1].dim_value == 2 and dims[3].dim_value == r and dims[0].dim_param and dims[2].dim_param
    key = next(i for i in proto.graph.input if i.name == "past_key_values.0.key").type.tensor_type.shape.dim
    state = {i.name: i.type.tensor_type for i in proto.graph.input if i.name.endswith((".heavy", ".token"))}
    assert len(state) == (4 if h2o else 0)
    for name, t in state.items():  # H2O's slot state: [B, Hkv, past] with the key buffer's slots
        assert t.elem_type == (onnx.TensorProto.FLOAT if name.endswith("heavy") else onnx.TensorProto.INT64)
        assert t.shape.dim[1].dim_value == 2 and t.shape.dim[2].dim_param == key[2].dim_param
    onnx.checker.check_model(proto)


@pytest.mark.parametrize("kernel", ["function", "native"])
@pytest.mark.parametrize("cfg,kv", CONFIGS, ids=IDS)
def test_ort_equals_reference_prefill_and_decode_with_padding(exported, cfg, kv, kernel):
    """ORT (function body, or the native kernel) vs the PyTorch reference, batch 2 left-padded, 6 decode steps.

    H2O: budget ceil(0.5 n) per sequence, so eviction starts at the first token; the graph evicts inside its
    slots (the prompt in one forward), the reference with its own statistics: both keep the same tokens.
    """
    from aqua_export.runtime.session import native_library

    if kernel == "native" and native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    m, proj, out = exported
    path, _ = out[cfg, kv]
    lm = OrtLM.open(path, folder_cfg(m, cfg), kernel=kernel, cache=kv, all_logits=True)
    ids, mask = left_padded(128, [11, 6])
    pos = np.clip(mask.numpy().cumsum(-1) - 1, 0, None)
    logits, past = lm.step(ids.numpy(), mask.numpy(), lm.empty_past(2))
    r = cfg.retained_width(16)
    h2o = cfg.evicts
    if kv == "shared":
        # one buffer per layer and kind, written in place: capacity in steps of 256
        assert lm.shared and past.capacity == 256 and past.length == 11
        assert past.key_arrays[0].shape == (2, 2, 256, r) and past.value_arrays[0].shape == (2, 2, 256, r)
        buffers = [a.ctypes.data for kind in past.arrays.values() for a in kind]
    else:
        # 11 and 6 real tokens: H2O needs min(n, ceil(n / 2) + 1) = 7 slots
        assert past[0].shape == (2, 2, 7 if h2o else 11, r) and past[1].shape == past[0].shape
    if h2o:  # 6 and 3 tokens kept per head
        token = past.arrays["token"][0] if kv == "shared" else past[3]
        assert (token >= 0).sum(-1).tolist() == [[6, 6], [3, 3]]
    with torch.no_grad(), apply_aqua(m, proj, cfg) as aqua:
        cache = aqua.new_cache()
        ref = m(input_ids=ids, attention_mask=mask, position_ids=torch.from_numpy(pos), past_key_values=cache).logits
        real = mask.bool().numpy()
        assert np.abs(logits - ref.numpy())[real].max() <= 1e-4
        tmask, tpos = mask.numpy(), pos[:, -1:]
        for _ in range(6):
            nxt = logits[:, -1].argmax(-1)
            assert np.array_equal(nxt, ref[:, -1].argmax(-1).numpy())
            tmask = np.concatenate([tmask, np.ones((2, 1), np.int64)], 1)
            tpos = tpos + 1
            logits, past = lm.step(nxt[:, None], tmask, past)
            ref = m(input_ids=torch.from_numpy(nxt[:, None]), attention_mask=torch.from_numpy(tmask),
                    position_ids=torch.from_numpy(tpos), past_key_values=cache).logits
            assert np.abs(logits - ref.numpy()).max() <= 1e-4
    assert tuple(cache.layers[0].keys.shape[-1:]) == (r,)
    if kv == "shared":
        # the same buffers, updated in place
        assert [a.ctypes.data for kind in past.arrays.values() for a in kind] == buffers and past.length == 17
        # (the dense export uses the identity for P, the reference the calibrated P; a weighted rule's cache
        # holds k^ / rms(k^))
        if cfg.k_ratio < 1 and not cfg.weighted_selection and not h2o:
            ref_k = cache.layers[1].keys.transpose(-1, -2).numpy()
            real_slots = tmask.astype(bool)[:, None, None, :]  # padding slots hold whatever a masked row computes
            got_k = Contract.key_rows(past.tensors()[2])  # the buffer's memory is K^ dim-major
            assert np.abs(got_k - ref_k)[np.broadcast_to(real_slots, ref_k.shape)].max() <= 1e-5
    if h2o:  # both sides kept the same tokens, per layer, sequence and head
        for i, layer in enumerate(cache.layers):
            token = past.arrays["token"][i] if kv == "shared" else past[4 * i + 3]
            for b in range(2):
                for h in range(2):
                    ours = sorted(int(t) for t in token[b, h] if t >= 0)
                    assert ours == sorted(layer.pos[b, h][layer.valid[b, h]].tolist())


def test_dense_export_uses_identity_projection_and_matches_hf(exported):
    m, _, out = exported
    path, _ = out[AquaConfig(), "concat"]
    lm = OrtLM.open(path, folder_cfg(m, AquaConfig()), all_logits=True)
    ids, mask = left_padded(128, [9, 9])
    logits, _ = lm.step(ids.numpy(), mask.numpy(), lm.empty_past(2))
    with torch.no_grad():
        hf = m(input_ids=ids, attention_mask=mask).logits.numpy()
    assert np.abs(logits - hf).max() <= 1e-5


def test_export_refuses_what_it_cannot_do(tmp_path, tiny_llama):
    m, proj = tiny_llama
    with pytest.raises(ConfigError, match="another model"):
        check_exportable(models.tiny_model("llama", seed=3), proj, AquaConfig(k_ratio=0.5))


def test_ort_generate_equals_reference_generate(exported):
    from aqua_export.runtime.sampling import SamplingConfig

    m, proj, out = exported
    cfg = AquaConfig(k_ratio=0.75, slice_ratio=0.25)
    path, _ = out[cfg, "shared"]
    lm = OrtLM(make_session(path), folder_cfg(m, cfg), "shared")
    ids, mask = left_padded(128, [10, 4])
    streamed = []
    got = lm.generate(ids.numpy(), mask.numpy(), SamplingConfig(max_new_tokens=12),
                      on_token=lambda step, t: streamed.append(t.copy()))
    with torch.no_grad(), apply_aqua(m, proj, cfg) as aqua:
        ref = aqua.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
    assert np.array_equal(got, ref[:, ids.shape[1]:].numpy())
    assert np.array_equal(np.stack(streamed, 1), got)


def test_float16_export_refuses_weights_beyond_its_range_and_counts_subnormals(tmp_path):
    m = models.tiny_model("llama")
    proj = tiny_projection(m, tmp_path)

    def below_normal(path):
        meta = export_onnx(m, proj, AquaConfig(k_ratio=0.5), path, dtype=torch.float16).metadata_props
        return int(next(p.value for p in meta if p.key == "float16_cast").split()[0])

    before = below_normal(tmp_path / "a.onnx")
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[0, :3] = torch.tensor([1e-6, 2e-6, 0.0])  # (up_proj is not folded)
    # two nonzero values below 6.1e-5 (the zero is exact), replacing values of ~0.03
    assert below_normal(tmp_path / "a.onnx") - before == 2
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[0, 0] = 1e5
    with pytest.raises(ConfigError, match="beyond float16's range.*--dtype float32"):
        export_onnx(m, proj, AquaConfig(k_ratio=0.5), tmp_path / "b.onnx", dtype=torch.float16)


def test_external_data_is_page_aligned_and_loads_by_path(exported, tmp_path):
    """Forced external data: the graph file holds no weights, each weight's offset is page-aligned (so ONNX
    Runtime can map it), and the model runs from its path with the same logits as the inline export."""
    from aqua_export.export.builder import ALIGN, load_graph

    m, proj, out = exported
    cfg = AquaConfig(k_ratio=0.5)
    path = tmp_path / "model.onnx"
    export_onnx(m, proj, cfg, path, external_data=True)
    g = load_graph(path)
    ext = [t for t in g.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert ext and all(int(dict((e.key, e.value) for e in t.external_data)["offset"]) % ALIGN == 0 for t in ext)
    assert all(dict((e.key, e.value) for e in t.external_data)["location"] == "model.onnx.data" for t in ext)
    ids, mask = left_padded(128, [7, 5])
    logits = []
    for p in (path, out[cfg, "concat"][0]):  # external, inline
        lm = OrtLM.open(p, folder_cfg(m, cfg), all_logits=True)
        logits.append(lm.step(ids.numpy(), mask.numpy(), lm.empty_past(2))[0])
    assert np.array_equal(*logits)


# ---------------------------------------------------------------------------------------------
# The architecture catalogue: every adapter, end to end through export and parity
# ---------------------------------------------------------------------------------------------

from aqua_export.archs import ADAPTERS  # noqa: E402


def _arch_parity(arch, cfg, kv, tmp_path, **tiny):
    from conftest import CharTokenizer

    from aqua_export.parity.harness import run_parity

    m = models.tiny_model(arch, **tiny)
    proj = tiny_projection(m, tmp_path)
    path = tmp_path / f"{arch}.onnx"
    export_onnx(m, proj, cfg, path)
    # 40 prompt tokens + 6 steps: past the tiny Mistral's window of 8, so the window is exercised
    return run_parity(path, folder_cfg(m, cfg), CharTokenizer(), proj, cfg, m, prompt_tokens=40, steps=6)


@pytest.mark.parametrize("arch", sorted(ADAPTERS))
def test_every_architecture_exports_with_parity(arch, tmp_path):
    """ORT vs the reference at k 0.75 under a shared selection (<= 1e-3), the graph at k = r vs HF."""
    res = _arch_parity(arch, AquaConfig(k_ratio=0.75), "shared", tmp_path)
    assert res["pass"], res
    r = res["ort_vs_reference"]
    assert r["max_abs_logit_diff_prefill"] <= 1e-3 and r["max_abs_logit_diff_decode"] <= 1e-3 and r["greedy_identical"]
    assert res["ort_k1_vs_hf"]["pass"] and res["selection"]["rows"] > 0


def test_multi_head_olmoe_with_renormalised_routing(tmp_path):
    """OLMoE as released: multi-head attention (g = 1), and the routing variant that renormalises the top-k."""
    res = _arch_parity("olmoe", AquaConfig(k_ratio=0.75), "shared", tmp_path, kv_heads=4, norm_topk_prob=True)
    assert res["pass"] and res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmoe"])
@pytest.mark.parametrize("cfg,kv", [(AquaConfig(k_ratio=0.75, slice_ratio=0.25), "shared"),
                                    (AquaConfig(k_ratio=0.75, h2o_ratio=0.5), "concat")], ids=["memory", "h2o"])
def test_memory_and_h2o_per_architecture(arch, cfg, kv, tmp_path):
    res = _arch_parity(arch, cfg, kv, tmp_path)
    assert res["pass"], res
    assert res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-3
    if cfg.evicts:
        assert res["eviction"]["decisions"] > 0 and res["eviction"]["pass"]


def test_sliding_window_changes_the_graph_and_h2o_is_refused_with_it(tmp_path):
    m = models.tiny_model("mistral")
    assert m.config.sliding_window == 8
    proj = tiny_projection(m, tmp_path)
    g = export_onnx(m, proj, AquaConfig(k_ratio=0.75), tmp_path / "w.onnx")
    windows = {a.i for n in g.graph.node if n.op_type == "AquaAttention" for a in n.attribute if a.name == "sliding_window"}
    assert windows == {8} and not any(n.name.startswith("/model/attn_mask") for n in g.graph.node)  # no [T, L] mask
    with pytest.raises(ConfigError, match="sliding-window layers is not supported"):
        export_onnx(m, proj, AquaConfig(k_ratio=0.75, h2o_ratio=0.5), tmp_path / "h.onnx")


def test_non_rotary_family_folds_p_into_the_projections(tmp_path):
    """GPT-2 (learned positions): q^ and k^ come straight out of W_Q' / W_K' (r wide), no P MatMul, no RoPE."""
    m = models.tiny_model("gpt2")
    proj = tiny_projection(m, tmp_path)
    cfg = AquaConfig(k_ratio=0.5, slice_ratio=0.25)
    g = export_onnx(m, proj, cfg, tmp_path / "g.onnx")
    names = [n.name for n in g.graph.node]
    assert not [x for x in names if "MatMulP" in x or "rope" in x]
    q_w = next(t for t in g.graph.initializer if t.name == "/model/layers.0/attn/q_proj.weight")
    assert list(q_w.dims) == [64, 4 * cfg.retained_width(16)]  # [D, H * r]: the projection is in the weights
    res = _arch_parity("gpt2", cfg, "shared", tmp_path)
    assert res["pass"] and res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-3


@pytest.mark.parametrize("arch,rope", [("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
                                       ("qwen2", {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 64})], ids=["llama3", "yarn"])
def test_scaled_rotary_embeddings(arch, rope, tmp_path):
    """Llama-3.1's and YaRN's rotary scaling come with HF's inv_freq and attention scaling: exported as computed."""
    rp = {"rope_theta": 10000.0, **rope}
    res = _arch_parity(arch, AquaConfig(k_ratio=0.75), "shared", tmp_path, rope_parameters=rp)
    assert res["pass"] and res["ort_k1_vs_hf"]["pass"]


def test_run_time_rope_scaling_is_refused():
    cfg = models.tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is not supported"):
        models.architecture_of(cfg)


@pytest.mark.parametrize("cfg,kv", [(AquaConfig(k_ratio=0.5), "shared"), (AquaConfig(k_ratio=0.75, h2o_ratio=0.5), "concat")],
                         ids=["k0.5", "h2o"])
def test_padding_side_does_not_matter(exported, cfg, kv):
    """Positions come from the mask, so right padding (onnxruntime-genai's, `aqua-export run`'s) generates what
    left padding (HF's) does, and both what the reference generates, eviction included."""
    from aqua_export.runtime.sampling import SamplingConfig

    m, proj, out = exported
    path = next(p for (c, _), (p, _) in out.items() if c == cfg)  # one graph serves both cache modes
    lm = OrtLM(make_session(path, kernel="function"), folder_cfg(m, cfg), kv)
    ids, mask = left_padded(128, [9, 4])
    right, rmask = np.zeros_like(ids.numpy()), np.zeros_like(mask.numpy())
    for b in range(2):
        real = ids.numpy()[b][mask.numpy()[b] == 1]
        right[b, :len(real)], rmask[b, :len(real)] = real, 1
    left_out = lm.generate(ids.numpy(), mask.numpy(), SamplingConfig(max_new_tokens=8))
    right_out = lm.generate(right, rmask, SamplingConfig(max_new_tokens=8))
    with torch.no_grad(), apply_aqua(m, proj, cfg) as aqua:
        ref = aqua.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
    assert np.array_equal(left_out, right_out) and np.array_equal(left_out, ref[:, ids.shape[1]:].numpy())


@pytest.mark.parametrize("kernel", ["function", "native"])
@pytest.mark.parametrize("settings,queries", [(dict(), True), (dict(k_ratio=0.5), True),
                                              (dict(k_ratio=0.5, token_budget=32, selection="group"), False),
                                              (dict(k_ratio=0.75, h2o_ratio=0.5), False)],
                         ids=["dense", "aqua", "tokens", "h2o"])
def test_last_layer_computes_the_head_rows_alone(tiny_llama, tmp_path, settings, queries, kernel):
    """A last_logits graph's last layer runs its MLP (and, where a decode step of that row is exact, its attention)
    on each sequence's last real token alone: a prompt's logits equal the every-row graph's at that row, padded on
    either side; token selection and H2O keep every query row in the attention."""
    from aqua_export.runtime.sampling import SamplingConfig
    from aqua_export.runtime.session import native_library

    if kernel == "native" and native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    m, proj = tiny_llama
    cfg = AquaConfig(**settings)
    path = tmp_path / "m.onnx"
    proto = export_onnx(m, proj, cfg, path)
    last = f"/model/layers.{m.config.num_hidden_layers - 1}/"
    names = {n.name for n in proto.graph.node}
    assert last + "HeadRows/x/Gather" in names and (last + "attn/HeadRows/q/Gather" in names) == queries
    assert (last + "HeadRows/attn/Gather" in names) != queries
    assert not any("HeadRows" in n for n in names if not n.startswith(last))
    rows = OrtLM.open(path, folder_cfg(m, cfg), kernel=kernel, cache="concat")
    every = OrtLM.open(path, folder_cfg(m, cfg), kernel=kernel, cache="concat", all_logits=True)
    ids, mask = left_padded(128, [40, 23])  # 40 new tokens: the native prompt kernel for every row
    right, rmask = np.zeros_like(ids.numpy()), np.zeros_like(mask.numpy())
    for b in range(2):
        real = ids.numpy()[b][mask.numpy()[b] == 1]
        right[b, :len(real)], rmask[b, :len(real)] = real, 1
    for x, xm in ((ids.numpy(), mask.numpy()), (right, rmask)):
        got, _ = rows.step(x, xm, rows.empty_past(2))
        want, _ = every.step(x, xm, every.empty_past(2))
        at = [np.flatnonzero(xm[b])[-1] for b in range(2)]
        assert got.shape == (2, 1, m.config.vocab_size)
        assert np.abs(got[:, 0] - want[[0, 1], at]).max() <= 1e-5
        # the every-row graph told to compute the last rows alone (a prompt generated from: lm-eval's generate_until)
        alone, _ = every.step(x, xm, every.empty_past(2), last_row=True)
        assert every.row_switch and np.abs(alone[[0, 1], at] - want[[0, 1], at]).max() <= 1e-5
        if kernel == "function":  # its body writes zeros where the native kernel leaves rows unwritten
            others = np.ones(alone.shape[:2], bool)
            others[[0, 1], at] = False
            assert not alone[others].any() and want[others].any()
    new_rows = rows.generate(ids.numpy(), mask.numpy(), SamplingConfig(max_new_tokens=6), eos_token_id=None)
    assert np.array_equal(every.generate(ids.numpy(), mask.numpy(), SamplingConfig(max_new_tokens=6),
                                         eos_token_id=None), new_rows)


@pytest.mark.parametrize("settings", [dict(k_ratio=0.5), dict(k_ratio=0.5, token_budget=32, selection="group"),
                                      dict(k_ratio=0.5, k_alloc="energy")], ids=["aqua", "tokens", "shared-k"])
def test_int8_cache_graph_and_its_float_twin(tiny_llama, tmp_path, settings):
    """An int8-cache export writes int8 rows with QuantizeRows (its function body here: the bytes rules.int8_rows
    makes; the op catalogue holds every implementation to them) and rewrites.float32_cache turns it back into the
    float32-cache export exactly, which parity gates."""
    from aqua_export.export.rewrites import all_logits, float32_cache, graph_variant
    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.sampling import SamplingConfig
    from aqua_export.runtime.session import make_session

    m, proj = tiny_llama
    cfg = AquaConfig(**settings)
    wide = folder_cfg(m, cfg, projection=proj)
    narrow = dataclasses.replace(wide, contract=dataclasses.replace(wide.contract, cache_dtype="int8"))
    ids = np.random.default_rng(0).integers(3, 120, (2, 30)).astype(np.int64)
    logits = {}
    for name, cd, transforms, fc in (("float", None, (), wide), ("int8", "int8", (), narrow),
                                     ("twin", "int8", (float32_cache(narrow.contract),), wide)):
        path = tmp_path / f"{name}.onnx"
        export_onnx(m, proj, cfg, path, cache_dtype=cd)
        with graph_variant(path, name, all_logits, *transforms) as p:
            lm = OrtLM(make_session(p, kernel="function"), fc, all_rows=True)
            seen = []
            lm.generate(ids, np.ones_like(ids), SamplingConfig(max_new_tokens=6), on_logits=lambda s, x: seen.append(x))
            logits[name] = np.stack(seen)
    assert np.array_equal(logits["twin"], logits["float"])
    first = np.abs(logits["int8"][0] - logits["float"][0]).max()  # the prompt's: both runs on the same tokens
    assert 1e-5 < first < 0.05, first  # the rounding shows, and stays small
