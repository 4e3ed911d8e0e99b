import math

import pytest

from aqua_export.config import AquaConfig, ConfigError


def test_round_trip_json():
    cfg = AquaConfig(k_ratio=0.75, slice_ratio=0.25, h2o_ratio=0.5, selection="static")
    again = AquaConfig.from_json(cfg.to_json())
    assert again == cfg
    assert '"version": 1' in cfg.to_json()


@pytest.mark.parametrize("field,value,needle", [
    ("k_ratio", 0, "k_ratio=0 is out of range"),
    ("k_ratio", 1.5, "k_ratio=1.5 is out of range"),
    ("k_ratio", math.nan, "k_ratio must be a finite number"),
    ("k_ratio", "0.5", "k_ratio must be a number"),
    ("k_ratio", True, "k_ratio must be a number"),
    ("slice_ratio", 1.0, "slice_ratio=1.0 is out of range"),
    ("slice_ratio", -0.1, "slice_ratio=-0.1 is out of range"),
    ("h2o_ratio", 0.0, "h2o_ratio=0.0 is out of range"),
    ("selection", "random", "selection='random' is unknown"),
])
def test_bad_values_name_the_problem(field, value, needle):
    with pytest.raises(ConfigError) as e:
        AquaConfig(**{field: value})
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_field_and_bad_json():
    with pytest.raises(ConfigError, match="unknown AQUA config field"):
        AquaConfig.from_dict({"k_ratio": 0.5, "kratio": 1})
    with pytest.raises(ConfigError, match="not valid JSON"):
        AquaConfig.from_json("{")
    with pytest.raises(ConfigError, match="version 7"):
        AquaConfig(version=7)


def test_widths_follow_design():
    cfg = AquaConfig(k_ratio=0.75, slice_ratio=0.25)
    assert cfg.retained_width(64) == 48
    assert cfg.selected_width(64) == 36
    assert AquaConfig(k_ratio=0.01).selected_width(64) == 1
    assert AquaConfig().is_dense and not cfg.is_dense
