"""AQUA-Memory's width per layer (allocate.py): water-filling, the energy and measured costs, the measured slice
costs in the artifact, and the widths reaching the reference and the folder config."""

import dataclasses

import pytest
import torch
from helpers import folder_cfg, tiny_projection

from aqua_export import allocate, models
from aqua_export import projection as artifact
from aqua_export import slice_costs
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.reference.attention import apply_aqua


def test_water_fill_gives_columns_where_cost_drops_most():
    # layer 0 loses 1 per dropped column, layer 1 loses 10: layer 1 stays whole, layer 0 takes the cut
    d = 8
    costs = torch.stack([torch.arange(d, -1, -1.0), 10 * torch.arange(d, -1, -1.0)])
    assert allocate.water_fill(costs, 12, floor=2) == (4, 8)
    assert allocate.water_fill(costs, 16, floor=2) == (8, 8)
    assert sum(allocate.water_fill(torch.rand(5, d + 1).sort(-1, descending=True).values, 23, floor=2)) == 23
    with pytest.raises(ConfigError, match="cannot be spread"):
        allocate.water_fill(costs, 3, floor=2)


def _tiny(tmp_path, layers=3):
    model = models.tiny_model("llama", num_hidden_layers=layers)
    return model, tiny_projection(model, tmp_path)


def test_energy_costs_and_widths(tmp_path):
    model, proj = _tiny(tmp_path)
    d = model.config.hidden_size // model.config.num_attention_heads
    hkv = model.config.num_key_value_heads
    costs = allocate.energy_costs(proj)
    assert costs.shape == (3, 2, d + 1)  # layer, K^ / V, width
    assert torch.allclose(costs[..., 0], torch.full((3, 2), 1.0 * hkv, dtype=torch.float64)) and (costs[..., -1] == 0).all()
    assert (costs[..., 1:] <= costs[..., :-1] + 1e-12).all()  # energy sorted descending: cost never grows with width
    cfg = AquaConfig(slice_ratio=0.25, slice_alloc="energy")
    kw, vw = allocate.layer_widths(cfg, proj, 3, d)
    r = cfg.retained_width(d)
    assert sum(kw) + sum(vw) == 2 * 3 * r and all(d // 4 <= w <= d for w in kw + vw)
    assert allocate.layer_widths(dataclasses.replace(cfg, slice_alloc="uniform"), None, 3, d) == ((r,) * 3, (r,) * 3)
    assert allocate.layer_widths(AquaConfig(slice_alloc="energy"), proj, 3, d) == ((d,) * 3, (d,) * 3)  # no cut


def test_measured_costs_round_trip_and_allocate(tmp_path, char_tok):
    model, proj = _tiny(tmp_path)
    d = model.config.hidden_size // model.config.num_attention_heads
    cfg = AquaConfig(slice_ratio=0.25, slice_alloc="measured")
    with pytest.raises(ConfigError, match="calibrate --slice-costs"):
        allocate.layer_widths(cfg, proj, 3, d)
    path = tmp_path / "with-costs.safetensors"
    proj2 = slice_costs.add_costs(model, char_tok, proj, path, ["builtin:gpl-3"], progress=False)
    widths = [int(w) for w in proj2.metadata["slice_widths"].split(",")]
    assert widths == sorted(set(widths)) and all(0 < w < d for w in widths)
    assert len(proj2.slice_cost) == 3 and all(c.shape == (2, len(widths)) for c in proj2.slice_cost)
    assert all((c >= -1e-9).all() for c in proj2.slice_cost) and torch.equal(proj2.P[1], proj.P[1])
    curve = allocate.measured_costs(proj2, d)
    assert curve.shape == (3, 2, d + 1)
    for i in range(3):  # the curves pass through the measured points and end at 0 for the full width
        assert torch.allclose(curve[i][:, widths], proj2.slice_cost[i].double().clamp_min(0))
        assert (curve[i, :, d] == 0).all()
    kw, vw = allocate.layer_widths(cfg, proj2, 3, d)
    assert sum(kw) + sum(vw) == 2 * 3 * cfg.retained_width(d)


def test_the_reference_caches_each_layers_width(tmp_path):
    """widths reach the reference: layer i caches widths[i] coordinates; full widths are dense attention."""
    model, proj = _tiny(tmp_path)
    d = model.config.hidden_size // model.config.num_attention_heads
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with apply_aqua(model, proj, AquaConfig(), widths=(d, d, d)):
            full = model(input_ids=ids).logits
        with apply_aqua(model, proj, AquaConfig(), widths=(d, d // 2, d)) as session:
            assert [s.r for s in session.states] == [d, d // 2, d]
            cut = model(input_ids=ids).logits
        restored = model(input_ids=ids).logits
    assert (full - dense).abs().max() <= 1e-4 and (cut - dense).abs().max() > 1e-3
    assert torch.equal(restored, dense)


def test_folder_config_takes_allocated_widths(tmp_path):
    model, proj = _tiny(tmp_path)
    cfg = AquaConfig(k_ratio=0.75, slice_ratio=0.25, slice_alloc="energy")
    fc = folder_cfg(model, cfg, projection=proj)
    assert sum(fc.contract.widths + fc.contract.value_widths) == 2 * 3 * cfg.retained_width(fc.geometry.head_dim)
    wrong = dataclasses.replace(fc.contract, widths=tuple(w + 1 for w in fc.contract.widths))
    with pytest.raises(ConfigError, match="disagree with the AQUA settings"):
        dataclasses.replace(fc, contract=wrong)


def test_corrupt_slice_costs_are_refused(tmp_path):
    model, proj = _tiny(tmp_path)
    tensors = proj.tensors()
    for extra, meta, needle in [
        ({"layers.0.slice_cost": torch.zeros(2, 2)}, {"slice_widths": "4,8"}, "missing for some layers"),
        ({f"layers.{i}.slice_cost": torch.zeros(2, 2) for i in range(3)}, {}, "without valid slice_widths"),
        ({f"layers.{i}.slice_cost": torch.zeros(2, 3) for i in range(3)}, {"slice_widths": "4,8"}, "is not [2, 2] finite"),
    ]:
        path = tmp_path / "bad.safetensors"
        artifact.write(path, {**tensors, **extra}, {**proj.metadata, **meta})
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
            artifact.load_projection(path)


def test_value_width_apart_from_the_keys(tmp_path):
    """The reference can cache V at its own width (how tools/quality.py measures where slicing costs): V cut
    alone changes the output, keys at full width with V whole is dense."""
    model, proj = _tiny(tmp_path)
    d = model.config.hidden_size // model.config.num_attention_heads
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with apply_aqua(model, proj, AquaConfig(), widths=(d,) * 3, value_widths=(d,) * 3):
            same = model(input_ids=ids).logits
        with apply_aqua(model, proj, AquaConfig(), widths=(d,) * 3, value_widths=(d // 2,) * 3) as session:
            assert [s.value_width for s in session.states] == [d // 2] * 3
            v_cut = model(input_ids=ids).logits
    assert (same - dense).abs().max() <= 1e-4 and (v_cut - dense).abs().max() > 1e-3
