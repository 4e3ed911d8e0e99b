"""The graph contract and the folder config: one owner each, typed, validated, JSON round trips."""

import dataclasses
import json

import numpy as np
import pytest

from aqua_export.config import AquaConfig, ConfigError
from aqua_export.contract import Contract
from aqua_export.runtime.folder import FolderConfig, Geometry


def _contract(**kw):
    return Contract(**{"layers": 3, "kv_heads": 2, "widths": (12, 12, 12), "selected": (9, 9, 9), "value_widths": (12, 12, 12), "vocab": 50, **kw})


def test_names_shapes_and_round_trip():
    ct = _contract()
    assert ct.input_names() == ["input_ids", "attention_mask"] + [f"past_key_values.{i}.{k}" for i in range(3)
                                                                    for k in ("key", "value")]
    assert ct.output_names() == ["logits"] + [f"present.{i}.{k}" for i in range(3) for k in ("key", "value")]
    assert ct.feed_shapes(4, 1, 10)["past_key_values.2.value"] == (4, 2, 10, 12)
    assert ct.feed_shapes(4, 1, 10)["attention_mask"] == (4, 11)
    assert Contract.from_dict(json.loads(json.dumps(ct.to_dict()))) == ct
    h2o = _contract(h2o=True)
    assert h2o.input_names()[2:6] == [f"past_key_values.0.{k}" for k in ("key", "value", "heavy", "token")]
    assert h2o.output_names()[-1] == "present.2.token" and "position_ids" not in h2o.input_names()
    assert h2o.feed_shapes(4, 1, 10)["past_key_values.1.token"] == (4, 2, 10)
    assert h2o.empty_buffer("token", 4, 3, 0).tolist() == [[[-1] * 3] * 2] * 4
    assert h2o.empty_buffer("heavy", 1, 2, 1).dtype == np.float32 and h2o.empty_buffer("key", 1, 2, 2).shape == (1, 2, 2, 12)
    inputs, outputs = ct.genai_io()
    assert inputs["past_key_names"] % 2 == "past_key_values.2.key" and outputs["present_value_names"] % 0 == "present.0.value"
    with pytest.raises(ConfigError, match="--runtime aqua"):
        h2o.genai_io()


def test_cache_dtype():
    """The KV buffers' type: the graph's by default (and for folders written before the field), float16 under a
    float32 graph (half the cache bytes), nothing else; it round-trips."""
    ct, narrow = _contract(), _contract(cache_dtype="float16")
    assert ct.cache_dtype == "float32" and Contract.from_dict({k: v for k, v in ct.to_dict().items()
                                                               if k != "cache_dtype"}) == ct
    assert Contract.from_dict(json.loads(json.dumps(narrow.to_dict()))) == narrow
    specs = {t.name: t.dtype for t in narrow.inputs() + narrow.outputs()}
    assert specs["past_key_values.1.key"] == specs["present.2.value"] == "float16" and specs["logits"] == "float32"
    assert narrow.empty_buffer("value", 1, 4, 0).dtype == np.float16
    assert 2 * narrow.cache_bytes(2, 10) == ct.cache_bytes(2, 10) and "float16" in narrow.layout()["key"]
    assert _contract(dtype="float16").cache_dtype == "float16"
    for kw, needle in (({"dtype": "float16", "cache_dtype": "float32"}, "a float16 graph caches float16"),
                       ({"cache_dtype": "float16", "h2o": True}, "AQUA-H2O's slot buffers"),
                       ({"cache_dtype": "int4"}, "contract.cache_dtype must be one of"),
                       ({"dtype": "float16", "cache_dtype": "int8"}, "is for float32 graphs"),
                       ({"cache_dtype": "int8", "h2o": True}, "AQUA-H2O's slot buffers")):
        with pytest.raises(ConfigError, match=needle):
            _contract(**kw)


def test_int8_cache_rows_carry_their_exponent():
    """An int8 cache: each K^ column and V row one element wider (its scale's exponent), int8, a quarter of float32's
    bytes and the exponents; it round-trips and says so in its layout."""
    ct, i8 = _contract(), _contract(cache_dtype="int8")
    assert Contract.from_dict(json.loads(json.dumps(i8.to_dict()))) == i8 and i8.scale_slots == 1
    specs = {t.name: t for t in i8.inputs() + i8.outputs()}
    assert specs["past_key_values.1.key"].dtype == "int8" and specs["present.2.value"].shape[-1] == ct.widths[2] + 1
    assert i8.empty_buffer("key", 1, 4, 0).shape[-1] == ct.widths[0] + 1
    per_slot = sum(w + rv + 2 for w, rv in zip(ct.widths, ct.value_widths)) * ct.kv_heads
    assert i8.cache_bytes(2, 10) == 2 * 10 * per_slot and "int8" in i8.layout()


def test_layers_of_different_widths():
    """AQUA-Memory's allocated slicing: each layer's buffers are as wide as that layer caches."""
    ct = _contract(widths=[16, 8, 12], selected=[12, 6, 9], value_widths=[4, 20, 12])
    assert ct.widths == (16, 8, 12) and not ct.uniform and _contract().uniform
    assert not _contract(value_widths=(12, 12, 11)).uniform
    shapes = ct.feed_shapes(1, 1, 5)
    assert [shapes[f"past_key_values.{i}.key"][-1] for i in range(3)] == [16, 8, 12]
    assert [shapes[f"past_key_values.{i}.value"][-1] for i in range(3)] == [4, 20, 12]
    assert ct.empty_buffer("value", 2, 3, 1).shape == (2, 2, 3, 20) and ct.empty_buffer("key", 2, 3, 1).shape == (2, 2, 3, 8)
    assert Contract.from_dict(json.loads(json.dumps(ct.to_dict()))) == ct
    with pytest.raises(ConfigError, match="one head_size for all"):
        ct.genai_io()


def test_key_buffer_memory_is_dim_major():
    """The declared [B, Hkv, C, r] buffer holds K^ as [B, Hkv, r, C]: row c is contiguous over the slots."""
    rows = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5).astype(np.float32)  # [B, Hkv, r=4, C=5]
    buf = Contract.key_buffer(rows)
    assert buf.shape == (2, 3, 5, 4) and np.array_equal(Contract.key_rows(buf), rows)
    assert np.shares_memory(Contract.key_rows(buf), buf)


@pytest.mark.parametrize("kw,needle", [({"widths": (12, 0, 12)}, "contract.widths"), ({"widths": (12, 12)}, "one integer per layer"),
                                       ({"selected": (9, 13, 9)}, "exceeds contract.widths 12 at layer 1"),
                                       ({"dtype": "int8"}, "contract.dtype"), ({"version": 1}, "version"),
                                       ({"h2o": "yes"}, "contract.h2o")])
def test_contract_refuses_bad_values(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        _contract(**kw)
    with pytest.raises(ConfigError, match="unknown contract field"):
        Contract.from_dict({**_contract().to_dict(), "cache_position": True})


def _folder_cfg():
    aqua = AquaConfig(k_ratio=0.75)
    return FolderConfig(model="llama", aqua=aqua, geometry=Geometry(3, 4, 2, 12, 48),
                        contract=_contract(selected=(aqua.selected_width(12),) * 3), context_length=128, info={"x": 1})


def test_folder_config_round_trips_and_writes_atomically(tmp_path):
    cfg = _folder_cfg()
    cfg.write(tmp_path)
    assert FolderConfig.from_folder(tmp_path) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["aqua_config.json"]  # no temporary left behind


@pytest.mark.parametrize("edit,needle", [
    (lambda d: {**d, "format_version": 1}, "format_version"),
    (lambda d: {**d, "cache": {}}, "unknown field"),
    (lambda d: {**d, "geometry": {**d["geometry"], "layers": -3}}, "geometry.layers"),
    (lambda d: {**d, "geometry": {**d["geometry"], "layers": 4}}, "disagrees with the geometry"),
    (lambda d: {**d, "contract": {**d["contract"], "widths": [11, 12, 12]}}, "disagree with the AQUA settings"),
    (lambda d: {**d, "contract": {**d["contract"], "widths": [11, 13, 12]}}, "disagree with the AQUA settings"),
    (lambda d: {**d, "contract": {**d["contract"], "value_widths": [11, 13, 12]}}, "disagree with the AQUA settings"),
    (lambda d: {**d, "aqua": {**d["aqua"], "k_ratio": "banana"}}, "k_ratio='banana' is not a number"),
    (lambda d: {**d, "context_length": 0}, "context_length"),
])
def test_folder_config_refuses_edits_with_one_line(tmp_path, edit, needle):
    d = _folder_cfg().to_dict()
    (tmp_path / "aqua_config.json").write_text(json.dumps(edit(d)))
    with pytest.raises(ConfigError, match=needle) as e:
        FolderConfig.from_folder(tmp_path)
    assert "\n" not in str(e.value) and "rebuild the folder" in str(e.value)


def test_folder_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _folder_cfg().model = "other"
