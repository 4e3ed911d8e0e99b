"""Bad input a user can cause: one ``aqua-export: error:`` line, a non-zero exit, nothing half-written, no
traceback. A tiny random checkpoint (real tokenizer) is built once into a folder; tests damage copies of it."""

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from aqua_export.cli import main

from helpers import saved_checkpoint


def _one_line_error(capsys, needle: str = "") -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("aqua-export: warning")]
    assert len(lines) == 1 and lines[0].startswith("aqua-export: error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rel")
    ckpt = saved_checkpoint(tmp / "ckpt", max_position_embeddings=64)
    out = tmp / "built"
    assert main(["--model", str(ckpt), "--k-ratio", "0.5", "--calib-text", "builtin:gpl-3", "--calib-tokens", "256",
                 "--parity-prompt-tokens", "32", "--parity-steps", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture
def copy(folder, tmp_path):
    dst = tmp_path / "f"
    shutil.copytree(folder, dst)
    return dst


def test_run_works_on_the_intact_folder(folder, capsys):
    assert main(["run", str(folder), "--prompt", "The license", "--max-new-tokens", "3"]) == 0
    assert json.loads((folder / "aqua_config.json").read_text())["context_length"] == 64


def test_prompt_longer_than_the_context_is_refused_up_front(folder, capsys):
    assert main(["run", str(folder), "--prompt", "word " * 80, "--max-new-tokens", "4"]) == 2
    _one_line_error(capsys, "past the model's context of 64")


def test_empty_prompt(folder, capsys):
    assert main(["run", str(folder), "--prompt", ""]) == 2
    _one_line_error(capsys, "--prompt is empty")


@pytest.mark.parametrize("damage", ["truncate", "random"])
def test_corrupt_model_file(copy, capsys, damage):
    m = copy / "model.onnx"
    data = m.read_bytes()
    m.write_bytes(data[: len(data) // 3] if damage == "truncate" else random.Random(0).randbytes(5000))
    assert main(["run", str(copy), "--prompt", "Hi"]) == 2
    _one_line_error(capsys, "cannot be loaded by ONNX Runtime")
    assert main(["parity", str(copy), "--steps", "1"]) == 2
    _one_line_error(capsys, "cannot be loaded by ONNX Runtime")


@pytest.mark.parametrize("edit,needle", [
    (lambda c: {"k_ratio": "banana", "layers": -3}, "format_version"),
    (lambda c: [1, 2, 3], "not a JSON object"),
    (lambda c: {**c, "geometry": {**c["geometry"], "layers": -3}}, "geometry.layers"),
    (lambda c: {**c, "geometry": {**c["geometry"], "layers": "two"}}, "geometry.layers"),
    (lambda c: {**c, "aqua": {**c["aqua"], "k_ratio": "banana"}}, "k_ratio must be a number"),
    (lambda c: {**c, "contract": {**c["contract"], "h2o": "bogus"}}, "contract.h2o"),
    (lambda c: {**c, "contract": {**c["contract"], "widths": [60] * len(c["contract"]["widths"])}}, "disagree"),
    (lambda c: {**c, "contract": {**c["contract"], "dtype": "int8"}}, "dtype"),
])
def test_edited_config_is_refused_with_one_line(copy, capsys, edit, needle):
    f = copy / "aqua_config.json"
    f.write_text(json.dumps(edit(json.loads(f.read_text()))))
    assert main(["run", str(copy), "--prompt", "Hi"]) == 2
    _one_line_error(capsys, needle)


def test_wrong_layer_count_is_caught_by_the_graph_check(copy, capsys):
    f = copy / "aqua_config.json"
    c = json.loads(f.read_text())
    c["geometry"]["layers"] += 1
    c["contract"]["layers"] += 1
    for key in ("widths", "selected", "value_widths"):
        c["contract"][key].append(c["contract"][key][-1])
    f.write_text(json.dumps(c))
    assert main(["run", str(copy), "--prompt", "Hi"]) == 2
    _one_line_error(capsys, "does not match its model.onnx")


def test_fuzz_every_file_of_the_folder(folder, tmp_path, capsys):
    """Random bytes, truncation and JSON mutations of each file `run` reads: exit 0 (a harmless change) or one
    error line; never a traceback."""
    rng = random.Random(1)
    files = ["model.onnx", "aqua_config.json", "tokenizer.json", "tokenizer_config.json"]
    for i in range(16):
        dst = tmp_path / f"z{i}"
        shutil.copytree(folder, dst)
        f = dst / files[i % len(files)]
        data = f.read_bytes()
        kind = i // len(files)
        if kind == 0:
            f.write_bytes(rng.randbytes(len(data) // 2 + 1))
        elif kind == 1:
            f.write_bytes(data[: rng.randrange(1, max(2, len(data)))])
        elif kind == 2 and f.suffix == ".json":
            obj = json.loads(data)
            if isinstance(obj, dict) and obj:
                key = rng.choice(sorted(obj))
                obj[key] = rng.choice([None, -1, "x", [], {}, 1e309])
            f.write_text(json.dumps(obj))
        else:
            f.unlink()
        rc = main(["run", str(dst), "--prompt", "Hi", "--max-new-tokens", "2"])
        if rc != 0:
            assert rc == 2, (f, kind)
            _one_line_error(capsys)
        else:
            capsys.readouterr()


def test_retention_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["retention", "--model", "llama", "--projection", str(tmp_path / "p"), "--text", "builtin:gpl-3",
                 "--out", str(f)]) == 2
    _one_line_error(capsys)


def test_missing_model_path_is_named_as_a_path(tmp_path, capsys):
    assert main(["calibrate", "--model", str(tmp_path / "no" / "such"), "--out", str(tmp_path / "p.safetensors")]) == 2
    _one_line_error(capsys, "does not exist")


def test_short_text_warns(tmp_path, capsys, char_tok):
    from aqua_export import corpus

    ids = corpus.tokenize(char_tok, "abcdef", 2048)
    assert ids.numel() == 6 and "6 tokens, fewer than the 2048 asked" in capsys.readouterr().err


def test_help_version_and_usage_errors(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--max-new-tokens" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--k-ratio", "--calib-tokens", "--external-data", "--force", "{magnitude,static,weighted,group,group-weighted}"):
        assert opt in out
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("aqua-export ")
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama", "--selection", "bogus"])
    assert e.value.code == 2
    _one_line_error(capsys, "invalid choice")


@pytest.mark.slow
def test_ctrl_c_stops_a_build_with_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "o"
    p = subprocess.Popen([sys.executable, "-m", "aqua_export", "--model", "llama", "--k-ratio", "0.5", "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)  # inside loading or calibration
    p.send_signal(signal.SIGINT)
    t0 = time.time()
    _, err = p.communicate(timeout=60)
    assert time.time() - t0 < 10
    # one line of ours (a progress bar may redraw around it as the process exits), no traceback, nothing left
    ours = [x.strip() for x in err.replace("\r", "\n").splitlines() if "aqua-export:" in x]
    assert p.returncode == 130 and len(ours) == 1 and ours[0].endswith("aqua-export: interrupted (nothing was written)"), err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_design_notes_live_in_the_project():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert "../shared" not in readme and "docs/design.md" in readme
    assert "## What folds into the weights" in (root / "docs" / "design.md").read_text()


def test_readme_documents_every_cli_option():
    """Every option of every command (and of the main build) appears in the README."""
    from pathlib import Path

    from aqua_export.cli import build_arg_parser, build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    parsers = [build_arg_parser(), build_parser()]
    sub = next(a for a in parsers[1]._actions if a.__class__.__name__ == "_SubParsersAction")
    parsers += list(sub.choices.values())
    missing = sorted({o for p in parsers for a in p._actions for o in a.option_strings
                      if o.startswith("--") and o != "--help" and o not in readme})
    assert not missing, missing


def test_parity_summary_says_what_is_a_gate(folder):
    from aqua_export.parity import summary_lines

    lines = summary_lines(json.loads((folder / "parity.json").read_text()))
    assert lines[0].startswith("[gate] ORT vs the PyTorch reference") and lines[-1] == "parity PASS"
    assert any(x.startswith("[gate] selection:") for x in lines)
    assert all(x.startswith(("[gate", "[report]", "parity ")) for x in lines)
