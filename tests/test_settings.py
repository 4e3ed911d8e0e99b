"""The settings package is the one place a setting is spelled: AquaConfig's fields, every parser's flags, lm-eval's
model_args, the docs table and the folder names all come from settings.MECHANISMS."""

import dataclasses

import pytest

from aqua_export import settings
from aqua_export.cli import build_arg_parser, build_parser
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.lm_eval_model import AquaLM, config_of_model_args

EVERY_ON = AquaConfig(k_ratio=0.5, slice_ratio=0.25, slice_alloc="energy", k_alloc="energy", selection="group",
                      token_budget=256, token_sink=32, token_window=128)


def _options(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


def test_aqua_config_is_made_of_the_settings():
    assert [f.name for f in dataclasses.fields(AquaConfig)] == [*settings.SETTINGS, "version"]
    assert AquaConfig() == AquaConfig(**{n: s.default for n, s in settings.SETTINGS.items()})
    assert AquaConfig.from_json(EVERY_ON.to_json()) == EVERY_ON
    assert set(EVERY_ON.on) == {"selection", "memory", "k_alloc", "tokens"} and AquaConfig().on == ()


def test_every_command_taking_settings_has_each_flag_with_its_default():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for parser in (build_arg_parser(), sub.choices["eval"], sub.choices["lm-eval"]):
        opts = _options(parser)
        for s in settings.SETTINGS.values():
            assert opts[s.flag].default == s.default and s.help in opts[s.flag].help
            assert tuple(opts[s.flag].choices or ()) == s.choices


def test_lm_eval_model_args_are_the_settings_as_text():
    assert AquaLM.SETTINGS == tuple(settings.SETTINGS)
    text = {n: str(getattr(EVERY_ON, n)) for n in settings.SETTINGS}
    assert config_of_model_args(**text) == EVERY_ON
    with pytest.raises(ConfigError, match="token_budget='lots' is not a whole number"):
        config_of_model_args(token_budget="lots")
    with pytest.raises(ConfigError, match=r"k_ratio=1.5 is out of range: use a value in \(0, 1\]"):
        config_of_model_args(k_ratio="1.5")


@pytest.mark.parametrize("name,value,needle", [
    ("k_ratio", 0.0, "out of range"), ("k_ratio", True, "is not a number"), ("k_ratio", float("nan"), "out of range"),
    ("slice_ratio", 1.0, "[0, 1)"), ("h2o_ratio", "x", "is not a number"), ("selection", "best", "is unknown"),
    ("token_budget", -1, "whole number"), ("token_window", 1 << 25, "past any context"),
    ("prefill_threshold", 0.0, "out of range"), ("prefill_k_ratio", 1.5, "out of range"),
])
def test_each_setting_refuses_bad_values_in_one_line(name, value, needle):
    with pytest.raises(ConfigError) as e:
        AquaConfig(**{name: value})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_mechanisms_own_their_node_attributes_and_name_parts():
    attrs = settings.node_attrs(EVERY_ON)
    assert attrs == {"rule": 1, "token_ratio": 1.0, "token_budget": 256, "token_sink": 32, "token_window": 128}
    assert settings.node_attrs(AquaConfig(k_ratio=0.5, h2o_ratio=0.5)) == {"rule": 0, "ratio": 0.5}
    assert settings.name_parts(EVERY_ON) == ["group", "s0.25", "energy", "kalloc-energy", "tb256", "sink32", "win128"]
    assert settings.name_parts(AquaConfig()) == []


@pytest.mark.parametrize("values,needle", [
    ({"prefill_threshold": 0.9, "prefill_stride": 0}, "prefill_stride=0 is out of range"),
    ({"prefill_threshold": 0.9, "prefill_stride": 65}, "[1, 64]"),
    ({"prefill_stride": 4}, "give --prefill-threshold below 1"),
    ({"prefill_threshold": 0.9, "h2o_ratio": 0.5}, "not both"),
])
def test_sparse_prefill_refuses_what_it_cannot_mean(values, needle):
    with pytest.raises(ConfigError) as e:
        AquaConfig(**values)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sparse_prefill_names_its_node_attributes_and_folder():
    cfg = AquaConfig(prefill_threshold=0.98, prefill_stride=4, prefill_k_ratio=0.25)
    assert settings.node_attrs(cfg) == {"rule": 0, "prefill_threshold": 0.98, "prefill_stride": 4,
                                        "prefill_k_ratio": 0.25}
    assert settings.name_parts(cfg) == ["p0.98", "ps4", "pk0.25"]
    assert cfg.on == ("prefill",) and not cfg.is_dense


def _bad_text(s) -> str:
    """A value of setting s its check refuses, as a user would type it."""
    if s.kind is str:
        return "bogus"
    if s.kind is int:
        return "-1" if s.whole[0] >= 0 else str(s.whole[1] + 1)
    return "-inf"  # also read as an option by plain argparse: the parser joins it to its flag


@pytest.mark.parametrize("command", [[], ["eval", "--projection", "x"], ["lm-eval", "--projection", "x"]])
def test_a_bad_value_of_every_setting_names_the_flag_the_user_typed(command, capsys):
    from aqua_export.cli import main

    for s in settings.SETTINGS.values():
        assert main([*command, s.flag, _bad_text(s)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"argument {s.flag}: {_bad_text(s)} " in err, err
        assert s.name not in err.replace(s.flag, ""), err  # the field's spelling is not the user's


def test_a_whole_number_setting_gives_one_range_for_every_bad_value(capsys):
    """-1 and 0 were refused with two different ranges ("a whole number >= 0", "[1, 64]")."""
    from aqua_export.cli import main

    for text in ("-1", "0", "65", "1.5"):
        assert main(["--prefill-threshold", "0.9", "--prefill-stride", text]) == 2
        assert "use a whole number in [1, 64]" in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--prefill-stride", "4"], "--prefill-stride 4 is sparse prefill's: give --prefill-threshold below 1 too, or "
                                "drop it"),
    (["--prefill-k-ratio", "0.5"], "--prefill-k-ratio 0.5 is sparse prefill's"),
    (["--prefill-stride", "4", "--prefill-k-ratio", "0.5"], "--prefill-stride 4 and --prefill-k-ratio 0.5 are sparse "
                                                           "prefill's: give --prefill-threshold below 1 too, or drop "
                                                           "them"),
])
def test_an_estimate_setting_without_sparse_prefill_is_named_alone(flags, needle, capsys):
    from aqua_export.cli import main

    assert main(flags) == 2
    assert needle in capsys.readouterr().err
