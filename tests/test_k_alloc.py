"""The selection width k spread over layers and shared by a layer's heads (allocate.layer_selected / head_prices,
--k-alloc): the same total as uniform, the energy and measured costs, the per-head measured costs and prices in the
artifact, and the allocation reaching the reference, the contract and a parity-checked export."""

import dataclasses

import pytest
import torch
from conftest import CharTokenizer
from helpers import folder_cfg, tiny_projection

from aqua_export import allocate, models
from aqua_export import projection as artifact
from aqua_export import slice_costs
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.reference.attention import apply_aqua
from aqua_export.runtime.session import native_library

KERNEL = "native" if native_library() is not None else "function"


def _tiny(tmp_path, layers=3):
    model = models.tiny_model("llama", num_hidden_layers=layers)
    d = model.config.hidden_size // model.config.num_attention_heads
    return model, tiny_projection(model, tmp_path), d


def test_water_fill_stops_each_buffer_at_its_cap():
    d = 8
    costs = torch.stack([torch.arange(d, -1, -1.0), 10 * torch.arange(d, -1, -1.0)])
    assert allocate.water_fill(costs, 10, floor=1, caps=(8, 4)) == (6, 4)  # layer 1 would take 8 uncapped
    with pytest.raises(ConfigError, match="cannot be spread"):
        allocate.water_fill(costs, 13, floor=1, caps=(8, 4))


@pytest.mark.parametrize("k_ratio", [0.25, 0.5, 0.75])
def test_energy_allocation_keeps_uniforms_total(tmp_path, k_ratio):
    model, proj, d = _tiny(tmp_path)
    uniform = AquaConfig(k_ratio=k_ratio, selection="weighted")
    ks = allocate.layer_selected(dataclasses.replace(uniform, k_alloc="energy"), proj, (d,) * 3)
    assert sum(ks) == 3 * uniform.selected_of(d) and all(max(1, d // 8) <= k <= d for k in ks)
    assert allocate.layer_selected(uniform, None, (d,) * 3) == (uniform.selected_of(d),) * 3
    # with AQUA-Memory's widths: each k at most its layer's width, the total uniform's over those widths
    widths = (d, d // 2, 3 * d // 4)
    ks = allocate.layer_selected(dataclasses.replace(uniform, k_alloc="energy"), proj, widths)
    assert sum(ks) == sum(uniform.selected_of(r) for r in widths) and all(k <= r for k, r in zip(ks, widths))


def test_energy_allocation_follows_the_spectra(tmp_path):
    """A layer whose energy sits in few coordinates costs little to narrow: it gets the smaller k."""
    model, proj, d = _tiny(tmp_path)
    flat = torch.ones(proj.energy[0].shape)
    peaked = torch.zeros(proj.energy[0].shape)
    peaked[:, 0] = 1.0
    skewed = dataclasses.replace(proj, energy=(flat, peaked, flat))
    ks = allocate.layer_selected(AquaConfig(k_ratio=0.5, k_alloc="energy"), skewed, (d,) * 3)
    assert ks[1] == max(1, d // 8) and ks[0] + ks[2] == 3 * (d // 2) - ks[1]


def test_measured_select_costs_round_trip_and_allocate(tmp_path, char_tok):
    model, proj, d = _tiny(tmp_path)
    cfg = AquaConfig(k_ratio=0.5, selection="weighted", k_alloc="measured")
    with pytest.raises(ConfigError, match="calibrate --select-costs weighted"):
        allocate.layer_selected(cfg, proj, (d,) * 3)
    path = tmp_path / "with-costs.safetensors"
    proj2 = slice_costs.add_select_costs(model, char_tok, proj, path, ["builtin:gpl-3"], "weighted", progress=False)
    ks = [int(k) for k in proj2.metadata["select_widths"].split(",")]
    hks = [int(k) for k in proj2.metadata["select_head_widths"].split(",")]
    assert all(x == sorted(set(x)) and all(0 < k < d for k in x) for x in (ks, hks))
    assert proj2.metadata["select_rule"] == "weighted" and torch.equal(proj2.P[1], proj.P[1])
    hkv = model.config.num_key_value_heads
    assert len(proj2.select_cost) == 3 and all(c.shape == (len(ks),) and (c >= -1e-9).all() for c in proj2.select_cost)
    assert all(c.shape == e.shape == (hkv, len(hks)) and (c >= -1e-9).all() and (e > 0).all()
               for c, e in zip(proj2.select_head_cost, proj2.select_head_energy))
    # the narrowest selection costs the most and drops the most score (the curves' shape, every layer and head)
    assert all(c[0] >= c[-1] for c in proj2.select_cost)
    assert all((c[:, 0] >= c[:, -1]).all() and (e[:, 0] > e[:, -1]).all()
               for c, e in zip(proj2.select_head_cost, proj2.select_head_energy))
    curve = allocate.select_measured_costs(proj2, cfg)
    assert curve.shape == (3, d + 1) and (curve[:, d] == 0).all()
    assert torch.allclose(curve[:, ks], torch.stack(proj2.select_cost).double().clamp_min(0))
    alloc = allocate.layer_selected(cfg, proj2, (d,) * 3)
    assert sum(alloc) == 3 * cfg.selected_of(d)
    prices = allocate.head_prices(cfg, proj2)  # sqrt of the geometric mean of KL per dropped score^2
    ratio = proj2.select_head_cost[1][0].double().clamp_min(1e-12) / proj2.select_head_energy[1][0].double()
    assert len(prices) == 3 and all(len(p) == hkv and all(x > 0 for x in p) for p in prices)
    assert prices[1][0] == pytest.approx(float(ratio.log().mean().exp().sqrt()), rel=1e-9)
    with pytest.raises(ConfigError, match="--select-costs magnitude"):  # measured under another rule
        allocate.layer_selected(dataclasses.replace(cfg, selection="magnitude"), proj2, (d,) * 3)
    # the optional costs survive a rewrite of the artifact, and a corrupt set is refused in one line
    again = artifact.load_projection(path)
    assert torch.equal(again.select_cost[2], proj2.select_cost[2])
    assert torch.equal(again.select_head_cost[2], proj2.select_head_cost[2])
    bad = tmp_path / "bad.safetensors"
    artifact.write(bad, {**proj2.tensors(), "layers.0.select_head_cost": torch.zeros(len(hks))}, proj2.metadata)
    with pytest.raises(ConfigError, match=r"a select_head_cost is not \[%d, %d\] finite" % (hkv, len(hks))):
        artifact.load_projection(bad)
    # an artifact with layer costs only (the per-layer format before heads shared k) holds no usable set: measured
    # asks to calibrate again
    old = tmp_path / "old.safetensors"
    tensors = {k: v for k, v in proj2.tensors().items() if "select_head" not in k}
    artifact.write(old, tensors, proj2.metadata)
    assert not artifact.load_projection(old).has_select_costs("weighted")
    with pytest.raises(ConfigError, match="calibrate --select-costs weighted"):
        allocate.head_prices(cfg, artifact.load_projection(old))


def test_the_reference_selects_each_layers_k(tmp_path):
    model, proj, d = _tiny(tmp_path)
    cfg = AquaConfig(k_ratio=0.5, k_alloc="energy")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with apply_aqua(model, proj, cfg) as session:
            assert tuple(s.k for s in session.states) == allocate.layer_selected(cfg, proj, (d,) * 3)
        with apply_aqua(model, proj, AquaConfig(k_ratio=0.5), selected=(d, 2, d)) as session:
            assert [s.k for s in session.states] == [d, 2, d]
            narrow = model(input_ids=ids).logits
        with apply_aqua(model, proj, AquaConfig(k_ratio=0.5), selected=(d, d, d)):
            full = model(input_ids=ids).logits
        dense = model(input_ids=ids).logits
    assert (full - dense).abs().max() <= 1e-4 and (narrow - dense).abs().max() > 1e-3


def test_folder_config_takes_the_allocation(tmp_path):
    model, proj, d = _tiny(tmp_path)
    cfg = AquaConfig(k_ratio=0.5, k_alloc="energy")
    fc = folder_cfg(model, cfg, projection=proj)
    assert fc.contract.selected == allocate.layer_selected(cfg, proj, (d,) * 3)
    more = dataclasses.replace(fc.contract, selected=tuple(k + 1 for k in fc.contract.selected))
    with pytest.raises(ConfigError, match="disagree with the AQUA settings"):
        dataclasses.replace(fc, contract=more)  # a step would read more than uniform's rows
    with pytest.raises(ConfigError, match="disagree with the AQUA settings"):  # uniform settings, uneven k
        dataclasses.replace(fc, aqua=AquaConfig(k_ratio=0.5))


def _synthetic_costs(proj, d: int):
    """proj with made-up measured selection costs for the weighted rule: uneven layer curves and head prices."""
    n, hkv = len(proj.P), proj.P[0].shape[0]
    ks, hks = [d // 8, d // 4, d // 2], [d // 4, d // 2]
    layer = tuple(torch.tensor([4.0, 2.0, 1.0]) * (1 + 3 * i) for i in range(n))
    head = tuple(torch.tensor([[2.0, 1.0]] * hkv) * torch.arange(1, hkv + 1.0)[:, None] for _ in range(n))
    energy = tuple(torch.tensor([[2.0, 1.0]] * hkv) for _ in range(n))
    meta = {**proj.metadata, "select_widths": ",".join(map(str, ks)), "select_head_widths": ",".join(map(str, hks)),
            "select_rule": "weighted"}
    return dataclasses.replace(proj, select_cost=layer, select_head_cost=head, select_head_energy=energy,
                               metadata=meta)


@pytest.mark.parametrize("alloc", ["energy", "measured"])
def test_an_allocated_export_passes_parity(tmp_path, alloc):
    """k per layer and the heads' prices reach every AquaAttention node, and parity holds against the reference's
    own allocation (energy: equal prices; measured, on made-up costs: unequal ones)."""
    from aqua_export.export.exporter import export_onnx
    from aqua_export.parity.harness import run_parity

    model = models.tiny_model("llama", num_hidden_layers=3)
    proj = tiny_projection(model, tmp_path)
    if alloc == "measured":
        proj = _synthetic_costs(proj, model.config.hidden_size // model.config.num_attention_heads)
    cfg = AquaConfig(k_ratio=0.5, selection="weighted", k_alloc=alloc)
    proto = export_onnx(model, proj, cfg, tmp_path / "m.onnx")
    ks = allocate.layer_selected(cfg, proj, (model.config.hidden_size // model.config.num_attention_heads,) * 3)
    assert len(set(ks)) > 1  # the test needs an uneven allocation
    nodes = [n for n in proto.graph.node if n.op_type == "AquaAttention"]
    assert [next(a.i for a in n.attribute if a.name == "k") for n in nodes] == list(ks)
    prices = allocate.head_prices(cfg, proj)  # the heads share each layer's k per token at these prices
    assert len({x for p in prices for x in p}) == (1 if alloc == "energy" else 2)
    attrs = [x for n in nodes for x in next(a.floats for a in n.attribute if a.name == "head_prices")]
    assert attrs == pytest.approx([x for p in prices for x in p], rel=1e-6)  # float32 attributes
    res = run_parity(tmp_path / "m.onnx", folder_cfg(model, cfg, projection=proj), CharTokenizer(), proj, cfg, model,
                     prompt_tokens=24, steps=4, kernel=KERNEL)
    assert res["pass"], res


def test_measured_without_costs_is_one_line(tmp_path, smollm_projection, capsys):
    """eval with --k-alloc measured on an artifact without selection costs: one line naming the command that adds
    them; an unknown allocation is refused by the parser."""
    from aqua_export.cli import main
    from aqua_export.projection import write

    path = tmp_path / "proj.safetensors"
    write(path, smollm_projection.tensors(), smollm_projection.metadata)
    rc = main(["eval", "--text", "builtin:gpl-3", "--k-ratio", "0.5", "--k-alloc", "measured", "--selection",
               "weighted", "--projection", str(path), "--tokens", "64", "--seq-len", "32"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "calibrate --select-costs weighted" in err
    assert main(["eval", "--text", "builtin:gpl-3", "--k-alloc", "greedy"]) == 2
    assert "argument --k-alloc: greedy is unknown: use one of uniform, energy, measured" in capsys.readouterr().err


def test_pooled_selection_shares_the_layers_budget():
    """rules.pooled_keep: per token exactly Hkv g k coordinates over the layer, a dear head taking more than a
    cheap one, ties to the lower flat index (kv head, row, coordinate); the group rules pool one set per group."""
    from aqua_export.ops import rules

    score = torch.rand(2, 3, 2, 5, 8, generator=torch.Generator().manual_seed(0))  # [B, Hkv, g, T, r]
    keep = rules.pooled_keep(score, 3, [1.0, 1.0, 1.0])
    assert (keep.sum((1, 2, 4)) == 3 * 2 * 3).all()
    dear = rules.pooled_keep(score, 3, [1.0, 4.0, 1.0]).sum((0, 2, 3, 4))
    assert dear[1] > keep.sum((0, 2, 3, 4))[1] and dear[1] > dear[0]
    tied = rules.pooled_keep(torch.ones(1, 2, 1, 1, 4), 1, [1.0, 1.0])  # 2 of 8 equal: the first two
    assert tied.flatten().tolist() == [True, True] + [False] * 6
    q = torch.randn(1, 2, 3, 4, 8, generator=torch.Generator().manual_seed(1))
    group = rules.selection_keep(q, 2, "group", prices=[1.0, 3.0])
    assert (group == group[:, :, :1]).all() and (group[:, :, 0].sum((1, 3)) == 2 * 2).all()
    static = rules.selection_keep(q, 2, "static", prices=[1.0, 3.0])  # the static rule reads no query: its own k
    assert (static.sum(-1) == 2).all() and static[..., :2].all()


def test_shared_k_is_refused_where_a_node_takes_one_k_per_row(tmp_path):
    """TensorRT's TopKGatherDot and AQUA-H2O take one k per row: one line each; a contract's prices are checked."""
    import json

    from aqua_export.build import check_options
    from aqua_export.options import BuildOptions
    from aqua_export.contract import Contract

    cfg = AquaConfig(k_ratio=0.5, selection="weighted", k_alloc="measured")
    assert cfg.shares_k and not dataclasses.replace(cfg, selection="static").shares_k
    assert not dataclasses.replace(cfg, h2o_ratio=0.5).shares_k
    with pytest.raises(ConfigError, match="shares each layer's k.*--runtime aqua"):
        check_options(BuildOptions(runtime="tensorrt"), cfg)
    base = dict(layers=2, kv_heads=2, widths=(8, 8), selected=(4, 4), value_widths=(8, 8), vocab=10)
    ct = Contract(**base, prices=[[1, 2], [0.5, 1.5]])
    assert ct.prices == ((1.0, 2.0), (0.5, 1.5)) and Contract.from_dict(json.loads(json.dumps(ct.to_dict()))) == ct
    for bad in ([[1, 2]], [[1, 2], [1, -1]], [[1, 2], [1, float("nan")]], [[1, 2, 3], [1, 2]]):
        with pytest.raises(ConfigError, match="contract.prices must list 2 positive prices per layer"):
            Contract(**base, prices=bad)
    with pytest.raises(ConfigError, match="AQUA-H2O's node takes one k per row"):
        Contract(**base, prices=[[1, 2], [1, 2]], h2o=True)
