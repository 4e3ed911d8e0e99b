import math

import pytest

from aqua_export.config import AquaConfig, ConfigError


def test_round_trip_json():
    cfg = AquaConfig(k_ratio=0.75, slice_ratio=0.25, h2o_ratio=0.5, selection="static")
    again = AquaConfig.from_json(cfg.to_json())
    assert again == cfg
    assert '"version": 6' in cfg.to_json()
    alloc = AquaConfig(k_ratio=0.4, selection="weighted", k_alloc="measured")
    assert AquaConfig.from_json(alloc.to_json()) == alloc
    tokens = AquaConfig(k_ratio=0.25, token_ratio=0.125, token_sink=4, token_window=32)
    assert AquaConfig.from_json(tokens.to_json()) == tokens and tokens.selects_tokens and not tokens.is_dense


def test_a_version_1_config_reads_as_no_token_selection():
    """Folders built before token selection carry version 1 and no token fields."""
    old = AquaConfig.from_dict({"k_ratio": 0.5, "slice_ratio": 0.0, "h2o_ratio": 1.0, "selection": "magnitude",
                                "slice_alloc": "uniform", "version": 1})
    assert old == AquaConfig(k_ratio=0.5) and not old.selects_tokens


def test_a_version_2_config_reads_as_uniform_k():
    """Folders built before the k allocation carry version 2 and no k_alloc: every layer selects k_ratio of r."""
    old = AquaConfig.from_dict({"k_ratio": 0.5, "selection": "weighted", "token_ratio": 1.0, "version": 2})
    assert old == AquaConfig(k_ratio=0.5, selection="weighted") and old.k_alloc == "uniform"


def test_a_version_5_config_reads_with_the_estimate_it_was_built_with():
    """Versions 4-5 wrote the estimate's old defaults (every 4th row, k' 0.25 r) into every config: a dense one's mean
    nothing now (and would be refused without a threshold), a sparse one's are what its nodes hold."""
    old = {"k_ratio": 0.5, "prefill_threshold": 1.0, "prefill_stride": 4, "prefill_k_ratio": 0.25, "version": 5}
    assert AquaConfig.from_dict(old) == AquaConfig(k_ratio=0.5)
    sparse = AquaConfig.from_dict({**old, "prefill_threshold": 0.98})
    assert (sparse.prefill_stride, sparse.prefill_k_ratio, sparse.version) == (4, 0.25, 6)
    with pytest.raises(ConfigError, match="give --prefill-threshold below 1"):  # a version 6 dense config is refused
        AquaConfig.from_dict({**old, "version": 6})
    for bad, needle in (({"version": "5"}, "--prefill-stride"), ({"prefill_threshold": "x"}, "is not a number")):
        with pytest.raises(ConfigError, match=needle):  # one line, not a TypeError from the upgrade
            AquaConfig.from_dict({**old, **bad})


@pytest.mark.parametrize("field,value,needle", [
    ("token_ratio", 0, "token_ratio=0 is out of range"),
    ("token_budget", -1, "token_budget=-1 is out of range"),
    ("token_window", 2.5, "token_window=2.5 is not a whole number"),
    ("version", 7, "version 7 is not supported"),
    ("prompt_precision", "float16", "prompt_precision='float16' is unknown"),
    ("k_alloc", "greedy", "k_alloc='greedy' is unknown"),
    ("k_ratio", 0, "k_ratio=0 is out of range"),
    ("k_ratio", 1.5, "k_ratio=1.5 is out of range"),
    ("k_ratio", math.nan, "k_ratio=nan is out of range"),
    ("k_ratio", "0.5", "k_ratio='0.5' is not a number"),
    ("k_ratio", True, "k_ratio=True is not a number"),
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


def test_token_selection_refuses_two_counts_and_eviction():
    with pytest.raises(ConfigError, match="give one"):
        AquaConfig(token_ratio=0.5, token_budget=64)
    with pytest.raises(ConfigError, match="not both"):
        AquaConfig(token_ratio=0.5, h2o_ratio=0.5)

