import json
import os
import subprocess
import sys

import pytest

from aqua_export.cli import main

EXE = [sys.executable, "-m", "aqua_export.cli"]


def _run(*args):
    return subprocess.run(EXE + list(args), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args,needle", [
    (["eval", "--text", "builtin:gpl-3", "--k-ratio", "1.5", "--projection", "x"], "argument --k-ratio: 1.5 is out of range"),
    (["eval", "--text", "builtin:gpl-3", "--k-ratio", "nan", "--projection", "x"], "argument --k-ratio: nan is out of range"),
    (["eval", "--text", "builtin:gpl-3", "--slice-ratio", "1.0", "--projection", "x"], "argument --slice-ratio: 1.0 is out of range"),
    (["eval", "--text", "builtin:nope"], "unknown builtin text 'nope'"),
    (["eval", "--text", "builtin:gpl-3", "--k-ratio", "0.5", "--projection", "/nonexistent.safetensors"],
     "projection file /nonexistent.safetensors does not exist"),
    (["eval", "--model", "/nonexistent-folder.gguf", "--text", "builtin:gpl-3"], "GGUF file /nonexistent-folder.gguf does not exist"),
])
def test_bad_input_is_one_line_and_nonzero(args, needle, capsys):
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("aqua-export: error: ") and needle in err and err.count("\n") == 1


def test_unwritable_out_leaves_nothing(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that can write to read-only folders (root): permission check not testable")
        rc = main(["calibrate", "--out", str(ro / "p.safetensors")])
        assert rc == 2 and "not writable" in capsys.readouterr().err
        assert list(ro.iterdir()) == []
    finally:
        os.chmod(ro, 0o700)


def test_out_under_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["calibrate", "--out", str(f / "p.safetensors")]) == 2
    assert f"{f} is a file, not a folder" in capsys.readouterr().err
    assert f.read_text() == "x"


def test_out_is_a_folder(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_and_eval_end_to_end_on_the_embedded_model(tmp_path, smollm_projection):
    out = tmp_path / "p.safetensors"
    r = _run("calibrate", "--model", "llama", "--text", "builtin:python-reference", "--tokens", "512",
             "--seq-len", "256", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    r = _run("eval", "--model", "llama", "--projection", str(out), "--k-ratio", "0.5", "--text", "builtin:gpl-3",
             "--tokens", "300", "--seq-len", "150", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tokens"] == 300 and res["config"]["k_ratio"] == 0.5 and 1 < res["perplexity"] < 1000
    r = _run("retention", "--model", "llama", "--projection", str(out), "--text", "builtin:gpl-3", "--tokens", "256",
             "--out", str(tmp_path / "ret"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ret" / "retention.png").exists()


@pytest.mark.slow
def test_projection_of_another_model_is_refused_by_eval(tmp_path, capsys):
    from helpers import tiny_projection

    from aqua_export import models

    tiny_projection(models.tiny_model("llama"), tmp_path)
    rc = main(["eval", "--model", "llama", "--projection", str(tmp_path / "tiny-0.safetensors"), "--k-ratio", "0.5",
               "--text", "builtin:gpl-3", "--tokens", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "projection was calibrated on another model" in err and err.count("\n") == 1


def test_the_build_options_defaults_are_the_clis():
    """options.OPTIONS declares each build option once: the parser's defaults are BuildOptions()' and each option's
    flag reaches the value the build takes."""
    from aqua_export.cli import build_arg_parser
    from aqua_export.options import OPTIONS, BuildOptions

    assert BuildOptions.from_args(build_arg_parser().parse_args([])) == BuildOptions()
    asked = BuildOptions.from_args(build_arg_parser().parse_args(
        ["--dtype", "float16", "--cache-dtype", "int8", "--weights", "int8", "--weight-block", "64",
         "--weight-zero-points", "--accuracy-level", "0", "--ops", "standard", "--runtime", "tensorrt",
         "--trt-max-batch", "2", "--trt-max-context", "64", "--trt-max-prompt", "16", "--external-data",
         "--parity-steps", "3", "--parity-prompt-tokens", "20"]))
    assert (asked.dtype, asked.cache_dtype, asked.weights.name, asked.weights.block, asked.weights.symmetric,
            asked.weights.accuracy_level, asked.ops, asked.runtime, asked.trt_limits, asked.external_data,
            asked.parity_steps, asked.parity_prompt) == ("float16", "int8", "int8", 64, False, 0, "standard",
                                                         "tensorrt", (2, 64, 16), True, 3, 20)
    assert {o.flag for o in OPTIONS} <= set(build_arg_parser().format_help().split())  # all on the command line
