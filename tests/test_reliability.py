"""Bad input a user can cause: one ``aqua-export: error:`` line, a non-zero exit, nothing half-written, no
traceback. A tiny random checkpoint (real tokenizer) is built once into a folder; tests damage copies of it."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import one_line, saved_checkpoint

from aqua_export.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rel")
    ckpt = saved_checkpoint(tmp / "ckpt", max_position_embeddings=64)
    out = tmp / "built"
    assert main(["--model", str(ckpt), "--k-ratio", "0.5", "--calib-text", "builtin:gpl-3", "--calib-tokens", "256",
                 "--parity-prompt-tokens", "32", "--parity-steps", "2", "--out", str(out), "--external-data"]) == 0
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
    one_line(capsys, "past the model's context of 64")


def test_empty_prompt(folder, capsys):
    assert main(["run", str(folder), "--prompt", ""]) == 2
    one_line(capsys, "--prompt is empty")


@pytest.mark.parametrize("damage,needle", [("truncate", "is damaged: model.onnx has"),
                                           ("random", "cannot be loaded by ONNX Runtime")])
def test_corrupt_model_file(copy, capsys, damage, needle):
    """A shorter model.onnx is named by its size before ONNX Runtime sees it; one of the right size but random
    bytes by ONNX Runtime's refusal (run), or its checksum (parity, check)."""
    m = copy / "model.onnx"
    data = m.read_bytes()
    m.write_bytes(data[: len(data) // 3] if damage == "truncate" else random.Random(0).randbytes(len(data)))
    assert main(["run", str(copy), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    one_line(capsys, needle)
    for cmd in (["parity", str(copy), "--steps", "1"], ["check", str(copy)]):
        assert main(cmd) == 2
        one_line(capsys, "is damaged: model.onnx")


def test_overwritten_weights_are_named_by_check_parity_and_run(copy, capsys):
    """200 bytes of model.onnx.data overwritten (the file keeps its size): `check` and `parity` name the file by its
    checksum, and `run` refuses the NaN logits in one line instead of printing nothing."""
    import onnx

    m = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    w = next(t for t in m.graph.initializer if "layers.0" in t.name and t.data_location == onnx.TensorProto.EXTERNAL)
    offset = int(next(e.value for e in w.external_data if e.key == "offset"))
    with open(copy / "model.onnx.data", "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 200)  # float32 NaNs
    for cmd in (["check", str(copy)], ["parity", str(copy), "--steps", "1"]):
        assert main(cmd) == 2
        one_line(capsys, "is damaged: model.onnx.data differs from what the build wrote")
    assert main(["run", str(copy), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    one_line(capsys, "computed logits that are not numbers")


def test_check_says_what_it_verified(folder, capsys):
    assert main(["check", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "each as the build wrote it (SHA-256)" in out and "model.onnx.data" not in out


@pytest.mark.parametrize("edit,needle", [
    (lambda c: {"k_ratio": "banana", "layers": -3}, "format_version"),
    (lambda c: [1, 2, 3], "not a JSON object"),
    (lambda c: {**c, "geometry": {**c["geometry"], "layers": -3}}, "geometry.layers"),
    (lambda c: {**c, "geometry": {**c["geometry"], "layers": "two"}}, "geometry.layers"),
    (lambda c: {**c, "aqua": {**c["aqua"], "k_ratio": "banana"}}, "k_ratio='banana' is not a number"),
    (lambda c: {**c, "contract": {**c["contract"], "h2o": "bogus"}}, "contract.h2o"),
    (lambda c: {**c, "contract": {**c["contract"], "widths": [60] * len(c["contract"]["widths"])}}, "disagree"),
    (lambda c: {**c, "contract": {**c["contract"], "dtype": "int8"}}, "dtype"),
])
def test_edited_config_is_refused_with_one_line(copy, capsys, edit, needle):
    """Content that cannot describe a folder, even with its checksum made to match (what is checked beneath it)."""
    f = copy / "aqua_config.json"
    f.write_text(json.dumps(_resealed(edit(json.loads(f.read_text())))))
    assert main(["run", str(copy), "--prompt", "Hi"]) == 2
    one_line(capsys, needle)


def _resealed(c):
    """An edited config with its own checksum recomputed (a careful editor), so the checks beneath it run."""
    from aqua_export.runtime.folder import CHECKSUM, checksum_of

    if not isinstance(c, dict):
        return c
    c = {k: v for k, v in c.items() if k != CHECKSUM}
    return {**c, CHECKSUM: checksum_of(c)}


@pytest.mark.parametrize("command", [["check"], ["run", "--prompt", "Hi"], ["parity"], ["eval", "--text", "builtin:gpl-3"],
                                     ["bench", "--context", "8"]])
def test_an_edited_config_is_noticed_by_every_command(copy, capsys, command):
    """A folder whose aqua_config.json was edited (its k and the contract's k, the graph left as built): every
    command that opens it says so in one line, before any model loads."""
    f = copy / "aqua_config.json"
    c = json.loads(f.read_text())
    c["aqua"]["k_ratio"] = 0.25
    c["contract"]["selected"] = [max(1, k // 2) for k in c["contract"]["selected"]]
    f.write_text(json.dumps(c, indent=1))
    where = [command[0], "--folder", str(copy)] + command[1:] if command[0] == "eval" else \
        [command[0], str(copy)] + command[1:]
    assert main(where) == 2
    one_line(capsys, "was edited after the build")


def test_wrong_layer_count_is_caught_by_the_graph_check(copy, capsys):
    f = copy / "aqua_config.json"
    c = json.loads(f.read_text())
    c["geometry"]["layers"] += 1
    c["contract"]["layers"] += 1
    for key in ("widths", "selected", "value_widths"):
        c["contract"][key].append(c["contract"][key][-1])
    f.write_text(json.dumps(_resealed(c)))
    assert main(["run", str(copy), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    one_line(capsys, "does not match its model.onnx")


def test_fuzz_every_file_of_the_folder(folder, tmp_path, capsys):
    """Random bytes, truncation and JSON mutations of each file `run` reads: exit 0 (a harmless change) or one
    error line; never a traceback."""
    rng = random.Random(1)
    files = ["model.onnx", "model.onnx.data", "aqua_config.json", "tokenizer.json", "tokenizer_config.json"]
    for i in range(20):
        dst = tmp_path / f"z{i}"
        shutil.copytree(folder, dst)
        _damage(dst / files[i % len(files)], i // len(files), rng)
        rc = main(["run", str(dst), "--prompt", "Hi", "--max-new-tokens", "2"])
        _zero_or_one_line(rc, capsys, (files[i % len(files)], i // len(files)))


def _damage(f: Path, kind: int, rng) -> None:
    """One of four damages to a file: random bytes, a truncation, a JSON field set to nonsense, deletion."""
    data = f.read_bytes()
    if kind == 0:
        f.write_bytes(rng.randbytes(min(len(data) // 2 + 1, 1 << 20)))
    elif kind == 1:
        f.write_bytes(data[: rng.randrange(1, max(2, len(data)))])
    elif kind == 2 and f.suffix == ".json":
        obj = json.loads(data)
        if isinstance(obj, dict) and obj:
            obj[rng.choice(sorted(obj))] = rng.choice([None, -1, "x", [], {}, 1e309])
        f.write_text(json.dumps(obj))
    else:
        f.unlink()


def _zero_or_one_line(rc, capsys, what):
    if rc != 0:
        assert rc == 2, what
        one_line(capsys)
    else:
        capsys.readouterr()


def test_fuzz_the_model_inputs(tmp_path, capsys):
    """The same damages to each file of a checkpoint given as --model: exit 0 or one error line, never a traceback."""
    rng = random.Random(2)
    ckpt = saved_checkpoint(tmp_path / "ckpt", max_position_embeddings=64)
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for i in range(12):
        dst = tmp_path / f"m{i}"
        shutil.copytree(ckpt, dst)
        _damage(dst / files[i % len(files)], i // len(files), rng)
        rc = main(["calibrate", "--model", str(dst), "--text", "builtin:gpl-3", "--tokens", "64", "--seq-len", "32",
                   "--quiet", "--out", str(tmp_path / f"p{i}.safetensors")])
        _zero_or_one_line(rc, capsys, (files[i % len(files)], i // len(files)))


@pytest.mark.slow
def test_fuzz_the_conversion_cache(tmp_path, monkeypatch, capsys):
    """The same damages to the embedded model's converted copy in $AQUA_CACHE: 0 or one line naming the folder."""
    from aqua_export import models

    real = models.resolve("llama")[0]
    rng = random.Random(3)
    files = ["config.json", "model.safetensors", "tokenizer.json"]
    for i in range(6):
        monkeypatch.setenv("AQUA_CACHE", str(tmp_path / f"c{i}"))
        cached = tmp_path / f"c{i}" / "models" / models.EMBEDDED_FOLDER
        shutil.copytree(real, cached)
        _damage(cached / files[i % len(files)], i // len(files), rng)
        rc = main(["eval", "--model", "llama", "--text", "builtin:gpl-3", "--tokens", "16"])
        _zero_or_one_line(rc, capsys, (files[i % len(files)], i // len(files)))
        shutil.rmtree(tmp_path / f"c{i}")


@pytest.mark.parametrize("name", ["AQUA_ORT_KERNEL", "AQUA_CACHE"])
def test_fuzz_the_environment(folder, tmp_path, monkeypatch, capsys, name):
    """The variables the tool reads, set to a text file, a folder, a missing path, a path under a file: 0 or one
    line."""
    note = tmp_path / "note.txt"
    note.write_text("x")
    for value in (str(note), str(tmp_path), str(tmp_path / "missing"), str(note / "under"), " "):
        monkeypatch.setenv(name, value)
        rc = main(["run", str(folder), "--prompt", "Hi", "--max-new-tokens", "2"])
        _zero_or_one_line(rc, capsys, value)


def _as_a_terminal_shows(text: str) -> list[str]:
    """The lines a terminal would show for ``text``: a carriage return moves back to the line's start, and what
    follows overwrites it (how progress bars redraw, and erase themselves)."""
    lines, line, col = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    lines.append("".join(line).rstrip())
    return [x for x in lines if x]


def _interrupt(args, ready, tmp_path):
    """Start aqua-export, send SIGINT once ``ready(stdout, stderr)`` holds, return (exit code, stderr)."""
    import threading

    p = subprocess.Popen([sys.executable, "-m", "aqua_export", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    seen = {"out": "", "err": ""}

    def pump(stream, key):
        for ch in iter(lambda: stream.read(1), ""):
            seen[key] += ch

    threads = [threading.Thread(target=pump, args=(s, k), daemon=True) for s, k in ((p.stdout, "out"), (p.stderr, "err"))]
    for t in threads:
        t.start()
    t0 = time.time()
    while not ready(seen["out"], seen["err"]) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=60)
    for t in threads:
        t.join(timeout=10)
    return rc, seen["err"]


@pytest.mark.slow
def test_ctrl_c_in_calibration_and_parity_is_one_visible_line(tmp_path, smollm_projection):
    """Interrupted inside calibration and inside parity, the last line a terminal shows is ours, not erased by the
    progress bar it interrupted; exit 130, nothing written."""
    from aqua_export.projection import write

    proj = tmp_path / "proj.safetensors"
    write(proj, smollm_projection.tensors(), smollm_projection.metadata)
    runs = [(["calibrate", "--model", "llama", "--text", "builtin:python-reference", "--out", str(tmp_path / "p.safetensors")],
             lambda out, err: "calibrate:" in err),
            (["--model", "llama", "--k-ratio", "0.5", "--projection", str(proj), "--out", str(tmp_path / "o")],
             lambda out, err: "ONNX Runtime, the folder's graph" in out)]
    for args, ready in runs:
        rc, err = _interrupt(args, ready, tmp_path)
        shown = _as_a_terminal_shows(err)
        assert rc == 130 and shown[-1] == "aqua-export: interrupted (nothing was written)", err
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj.safetensors"]


NON_ASCII = "Héllo 🌍🚀 — 你好, naïve café ✓"


def test_a_stream_holds_back_cut_characters(folder):
    """Byte-level tokens cut emoji and CJK characters in pieces (a prefix decodes to U+FFFD): streamed token by token,
    the text printed equals the whole decode, and no piece printed is a cut character."""
    import io

    import numpy as np

    from aqua_export.runtime.text import TextStream, load_tokenizer

    tok = load_tokenizer(folder)
    ids = tok(NON_ASCII, add_special_tokens=False)["input_ids"]
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # cuts happen
    writes = []

    class Out(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    out = Out()
    stream = TextStream(tok, out)
    for i, t in enumerate(ids):
        stream(i, np.array([t]))
    stream.close()
    assert out.getvalue() == NON_ASCII and not any("\ufffd" in w for w in writes)


@pytest.mark.parametrize("runtime", ["aqua", "genai"])
def test_serving_a_folder_imports_no_torch(folder, runtime):
    """`aqua-export run` on a float folder, in either runtime, never imports torch or transformers (seconds and
    hundreds of MB of a start-up; `python -X importtime` shows the rest)."""
    code = ("import sys; from aqua_export.cli import main; rc = main(['run', sys.argv[1], '--prompt', 'Hi', '--chat', "
            "'--max-new-tokens', '2', '--runtime', sys.argv[2]]); "
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(folder), runtime], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "0 []", r.stdout


@pytest.mark.parametrize("runtime", ["aqua", "genai"])
def test_non_ascii_round_trips_single_and_batch(folder, capsys, runtime):
    """A non-ASCII prompt in both runtimes: one prompt streams exactly the decoded generation, and a batch prints
    each row's decoded generation under its prompt."""
    from aqua_export.runtime.hosts import open_lm
    from aqua_export.runtime.sampling import SamplingConfig
    from aqua_export.runtime.text import encode_prompts, load_tokenizer

    tok = load_tokenizer(folder)
    prompts = [NON_ASCII, "你好 🌍"]
    lm = open_lm(folder, runtime)
    want = []
    for batch in ([prompts[0]], prompts):
        ids, mask = encode_prompts(tok, batch)
        gen = lm.generate(ids, mask, SamplingConfig(max_new_tokens=16), eos_token_id=tok.eos_token_id)
        want.append([tok.decode(row, skip_special_tokens=True) for row in gen])
    assert main(["run", str(folder), "--prompt", prompts[0], "--max-new-tokens", "16", "--runtime", runtime]) == 0
    assert capsys.readouterr().out == want[0][0] + "\n"
    args = ["run", str(folder), "--max-new-tokens", "16", "--runtime", runtime]
    assert main(args + [x for p in prompts for x in ("--prompt", p)]) == 0
    assert capsys.readouterr().out == "".join(f"--- {p!r}\n{text}\n" for p, text in zip(prompts, want[1]))


def test_retention_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["retention", "--model", "llama", "--projection", str(tmp_path / "p"), "--text", "builtin:gpl-3",
                 "--out", str(f)]) == 2
    one_line(capsys)


def test_missing_model_path_is_named_as_a_path(tmp_path, capsys):
    assert main(["calibrate", "--model", str(tmp_path / "no" / "such"), "--out", str(tmp_path / "p.safetensors")]) == 2
    one_line(capsys, "does not exist")


def test_short_text_warns(tmp_path, capsys, char_tok):
    from aqua_export import corpus

    ids = corpus.tokenize(char_tok, "abcdef", 2048)
    assert ids.numel() == 6 and "6 tokens, fewer than the 2048 asked" in capsys.readouterr().err


def test_help_version_and_usage_errors(capsys):
    assert main(["run", "--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--k-ratio", "--calib-tokens", "--external-data", "--force", "{magnitude,static,weighted,group,group-weighted}"):
        assert opt in out
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("aqua-export ")
    assert main(["--model", "llama", "--selection", "bogus"]) == 2
    one_line(capsys, "argument --selection: bogus is unknown")


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


def test_the_cli_reference_is_the_parsers_own_help():
    """docs/cli.md is what `python -m tools cli-reference` writes from the parsers now, and names every option of every
    command: an option added without rerunning the tool fails here."""
    from aqua_export.cli import build_arg_parser, build_parser
    from tools.cli_reference import OUT, reference

    text = OUT.read_text()
    assert text == reference(), "docs/cli.md is stale: run .venv/bin/python -m tools cli-reference"
    parsers = [build_arg_parser(), build_parser()]
    sub = next(a for a in parsers[1]._actions if a.__class__.__name__ == "_SubParsersAction")
    parsers += list(sub.choices.values())
    options = {o for p in parsers for a in p._actions for o in a.option_strings if o.startswith("--")}
    assert len(options) > 40 and not sorted(o for o in options if o not in text)
    assert "docs/cli.md" in (OUT.parents[1] / "README.md").read_text()


def test_parity_summary_says_what_is_a_gate(folder):
    from aqua_export.parity.report import summary_lines

    lines = summary_lines(json.loads((folder / "parity.json").read_text()))
    assert lines[0].startswith("[gate] ORT vs the PyTorch reference") and lines[-1] == "parity PASS"
    assert any(x.startswith("[gate] selection:") for x in lines)
    assert all(x.startswith(("[gate", "[report]", "parity ")) for x in lines)


# a build whose every stage waits a moment after announcing itself, so a signal sent on its "[i/5]" line lands inside
# stage i (an instrument of this test: the build itself never waits)
SLOW_STAGES = """
import sys, time
from aqua_export import build
shown = build._stage
build._stage = lambda *a, **k: (shown(*a, **k), time.sleep(3))
from aqua_export.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _tiny_build(ckpt, out) -> list[str]:
    return ["--model", str(ckpt), "--k-ratio", "0.5", "--calib-text", "builtin:gpl-3", "--calib-tokens", "256",
            "--parity-prompt-tokens", "32", "--parity-steps", "2", "--out", str(out)]


def _killed_at_stages(ckpt, tmp_path, kills: dict) -> dict:
    """Builds started together, each sent kills[stage] (a signal) once its stage's line is printed: per stage, the
    exit code and stderr."""
    procs = {stage: subprocess.Popen([sys.executable, "-c", SLOW_STAGES, *_tiny_build(ckpt, tmp_path / f"o{stage}")],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for stage in kills}
    out = {}
    for stage, p in procs.items():
        for line in p.stdout:
            if line.startswith(f"[{stage}/5]"):
                p.send_signal(kills[stage])
                break
        _, err = p.communicate(timeout=120)
        out[stage] = (p.returncode, err)
    return out


def test_sigterm_and_sighup_at_every_stage_end_like_ctrl_c(tmp_path):
    """SIGTERM (timeout, docker stop, systemd) or SIGHUP in any stage of a build: one line naming the signal, exit
    128 + its number, no temporary sibling and no lock left beside --out."""
    ckpt = saved_checkpoint(tmp_path / "ckpt", max_position_embeddings=64)
    kills = {1: signal.SIGTERM, 2: signal.SIGTERM, 3: signal.SIGHUP, 4: signal.SIGTERM, 5: signal.SIGTERM}
    for stage, (rc, err) in _killed_at_stages(ckpt, tmp_path, kills).items():
        name = signal.Signals(kills[stage]).name
        ours = [x.strip() for x in err.replace("\r", "\n").splitlines() if "aqua-export:" in x]
        assert rc == 128 + kills[stage] and ours == [f"aqua-export: stopped by {name} (nothing was written)"], err
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_build_removes_what_a_killed_build_left(tmp_path, capsys):
    """SIGKILL mid-build leaves its temporary sibling (nothing runs after SIGKILL); the next build to the same --out
    removes it (and a killed replacement's old folder) and says so; a sibling of another --out stays."""
    ckpt = saved_checkpoint(tmp_path / "ckpt", max_position_embeddings=64)
    (rc, _), = _killed_at_stages(ckpt, tmp_path, {3: signal.SIGKILL}).values()
    assert rc == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".o3.") and p.name.endswith(".tmp")]
    assert len(left) == 1
    (tmp_path / ".o3.old-12345").mkdir()
    other = tmp_path / ".o3.b.abcdefgh.tmp"  # --out o3.b's: not this build's
    other.mkdir()
    assert main(_tiny_build(ckpt, tmp_path / "o3")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o3.b.abcdefgh.tmp", "ckpt", "o3"]
    assert capsys.readouterr().out.count("left by a build of") == 2


def test_force_through_a_link_replaces_the_folder_it_names(tmp_path, capsys):
    """--out a symbolic link to a built folder, with --force: the folder the link names is replaced and the link stays
    a link to it; nothing is left beside either (rmtree does not remove a link, so renaming the link away left one)."""
    ckpt = saved_checkpoint(tmp_path / "ckpt", max_position_embeddings=64)
    assert main(_tiny_build(ckpt, tmp_path / "v1")) == 0
    first = (tmp_path / "v1" / "aqua_config.json").read_bytes()
    (tmp_path / "current").symlink_to("v1")
    assert main([*_tiny_build(ckpt, tmp_path / "current"), "--force"]) == 0
    assert os.readlink(tmp_path / "current") == "v1" and (tmp_path / "v1").is_dir() and \
        not (tmp_path / "v1").is_symlink()
    assert (tmp_path / "v1" / "aqua_config.json").read_bytes() != first  # rebuilt (its resources differ)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "current", "v1"]
    capsys.readouterr()
    assert main(["check", str(tmp_path / "current")]) == 0
