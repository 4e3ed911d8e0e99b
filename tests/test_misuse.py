"""What a new user can do wrong, each ending in one ``aqua-export: error:`` line (exit 2) that names the fix, before any
work and with nothing of theirs overwritten: bad model files and caches, outputs that are not ours, two builds at
once, a full disk, bad prompts and sampling settings, and the lm-eval and bench options that were accepted silently."""

import errno
import shutil

import pytest
from helpers import one_line, saved_checkpoint

from aqua_export.cli import main
from aqua_export.config import ConfigError


SHORT_PARITY = ["--parity-prompt-tokens", "32", "--parity-steps", "2"]  # fits the tiny checkpoint's 64 positions, fast


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return saved_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position_embeddings=64)


# ------------------------------------------------------------------ model files and the conversion cache

def test_truncated_checkpoint(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    assert main(["calibrate", "--model", str(bad), "--out", str(tmp_path / "p.safetensors"), "--tokens", "64"]) == 2
    one_line(capsys, "its weight or tokenizer files are damaged or incomplete")
    assert not (tmp_path / "p.safetensors").exists()


@pytest.mark.parametrize("content,needle", [(b"this is a note, not a model\n", "is not a GGUF file"),
                                            (None, "cannot be read as a GGUF model")])
def test_bad_gguf(tmp_path, monkeypatch, capsys, content, needle):
    from aqua_export import models

    monkeypatch.setenv("AQUA_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(content if content is not None else models.embedded_gguf().read_bytes()[:4096])  # truncated
    assert main(["eval", "--model", str(f), "--text", "builtin:gpl-3"]) == 2
    one_line(capsys, needle)
    assert not list((tmp_path / "cache").rglob("config.json"))  # nothing half-converted left in the cache


def test_damaged_conversion_cache_names_the_folder_to_delete(tmp_path, monkeypatch, capsys):
    from aqua_export import models

    real = models.resolve("llama")[0]
    monkeypatch.setenv("AQUA_CACHE", str(tmp_path))
    cached = tmp_path / "models" / models.EMBEDDED_FOLDER
    shutil.copytree(real, cached)
    w = cached / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    assert main(["eval", "--model", "llama", "--text", "builtin:gpl-3", "--tokens", "16"]) == 2
    one_line(capsys, f"delete that folder (rm -r {cached})")


def test_unwritable_conversion_cache_is_refused_before_converting(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("AQUA_CACHE", str(blocker / "cache"))
    assert main(["eval", "--model", "llama", "--text", "builtin:gpl-3"]) == 2
    one_line(capsys, "the conversion cache ($AQUA_CACHE)")


def test_the_embedded_gguf_by_path_reuses_its_conversion(tmp_path, monkeypatch):
    from aqua_export import models

    real = models.resolve("llama")[0]
    assert models.resolve(str(models.embedded_gguf()))[0] == real  # no second float32 copy of the same file


def test_a_text_file_as_the_model(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert main(["eval", "--model", str(f), "--text", "builtin:gpl-3"]) == 2
    one_line(capsys, "is a file, not a model")


# ------------------------------------------------------------------ outputs that are not this tool's

def test_calibrate_never_overwrites_a_users_file(ckpt, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    for extra in ([], ["--force"]):
        assert main(["calibrate", "--model", str(ckpt), "--out", str(notes), "--tokens", "64", *extra]) == 2
        one_line(capsys, "is a file this tool did not write")
    assert notes.read_text() == "precious"
    p = tmp_path / "p.safetensors"
    args = ["calibrate", "--model", str(ckpt), "--out", str(p), "--tokens", "64", "--seq-len", "32",
            "--text", "builtin:gpl-3", "--quiet"]
    assert main(args) == 0 and p.is_file()
    capsys.readouterr()
    assert main(args) == 2
    one_line(capsys, "exists: pass --force to replace it")
    assert main(args + ["--force"]) == 0  # a projection this tool wrote, replaced on request


def test_retention_never_overwrites_a_users_file(tmp_path, capsys):
    out = tmp_path / "ret"
    out.mkdir()
    (out / "retention.png").write_text("my picture")
    assert main(["retention", "--model", "llama", "--projection", "p", "--text", "builtin:gpl-3", "--out", str(out),
                 "--force"]) == 2
    one_line(capsys, "is a file this tool did not write")
    assert (out / "retention.png").read_text() == "my picture"


def test_two_builds_to_one_out_cannot_both_write(tmp_path, capsys):
    """A second job claiming an --out that a running one holds fails at once; the claim goes with its job."""
    from aqua_export.outputs import claim

    out = tmp_path / "eng"
    with claim(out):
        with pytest.raises(ConfigError, match="another aqua-export is writing --out"):
            with claim(out):
                pass
        assert main(["--model", "llama", "--k-ratio", "0.5", "--out", str(out)]) == 2
        one_line(capsys, "another aqua-export is writing --out")
    with claim(out):  # released: claimable again, and no lock file is left beside the output
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_refused_before_work_with_the_numbers(ckpt, tmp_path, monkeypatch, capsys):
    import collections

    from aqua_export import outputs

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
    assert main(["--model", str(ckpt), "--k-ratio", "0.5", "--out", str(tmp_path / "o"), *SHORT_PARITY]) == 2
    one_line(capsys, "GiB on the disk of")
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_disk_filling_up_mid_build_is_one_line_and_leaves_nothing(ckpt, tmp_path, monkeypatch, capsys):
    from aqua_export import build

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(build, "export_folder", full)
    assert main(["--model", str(ckpt), "--k-ratio", "0.5", "--out", str(tmp_path / "o"), "--calib-tokens", "64",
                 "--calib-text", "builtin:gpl-3", *SHORT_PARITY]) == 2
    one_line(capsys, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_out_names_the_reason(tmp_path, monkeypatch):
    import tempfile

    from aqua_export import outputs

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ConfigError, match=r"refuses new files \(Read-only file system\)"):
        outputs.check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []  # no folder made on the way


# ------------------------------------------------------------------ run, bench, eval and lm-eval options

@pytest.fixture(scope="module")
def folders(ckpt, tmp_path_factory):
    """A tiny float32 folder and an AQUA-H2O one (built by the real command)."""
    tmp = tmp_path_factory.mktemp("folders")
    out = {}
    for name, extra in (("plain", []), ("h2o", ["--h2o-ratio", "0.5"])):
        out[name] = tmp / name
        assert main(["--model", str(ckpt), "--k-ratio", "0.5", *extra, "--calib-text", "builtin:gpl-3",
                     "--calib-tokens", "256", "--parity-prompt-tokens", "32", "--parity-steps", "2",
                     "--out", str(out[name])]) == 0
    return out


@pytest.mark.parametrize("args,needle", [
    (["--top-k", "100000"], "exceeds the model's vocabulary of"),
    (["--top-k", "-1"], "--top-k -1 is negative"),
    (["--max-new-tokens", "0"], "generates nothing"),
    (["--prompt", "ok \udcff bytes"], "is not UTF-8 text"),
])
@pytest.mark.parametrize("runtime", ["aqua", "genai"])
def test_run_refuses_bad_requests(folders, capsys, args, needle, runtime):
    prompt = [] if "--prompt" in args else ["--prompt", "Hello"]
    assert main(["run", str(folders["plain"]), *prompt, *args, "--runtime", runtime]) == 2
    one_line(capsys, needle)


def test_a_kernel_library_that_is_not_one(folders, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "libaqua_ort.so"
    fake.write_text("not a library")
    monkeypatch.setenv("AQUA_ORT_KERNEL", str(fake))
    assert main(["run", str(folders["plain"]), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    one_line(capsys, "is not a shared library")


@pytest.mark.parametrize("args,needle", [
    (["--context", "100000"], "past"),
    (["--runtime", "genai"], "run them with --runtime aqua"),
])
def test_bench_refuses_what_it_cannot_measure(folders, capsys, args, needle):
    folder = folders["h2o" if "genai" in args else "plain"]
    assert main(["bench", str(folder), *args]) == 2
    one_line(capsys, needle)


@pytest.mark.parametrize("args,needle", [
    (["eval", "--text", "builtin:gpl-3", "--tokens", "0"], "--tokens 0 leaves nothing to predict"),
    (["eval", "--text", "builtin:gpl-3", "--k-ratio", "0.5"], "--k-ratio 0.5 needs --projection FILE"),
    (["lm-eval", "--model", "llama", "--limit", "0"], "--limit 0 is not a number of items"),
    (["lm-eval", "--model", "llama", "--limit", "-3"], "--limit -3 is not a number of items"),
    (["lm-eval", "--model", "llama", "--k-ratio", "0.5"], "--k-ratio 0.5 needs --projection FILE with --model"),
    (["lm-eval", "--model", "llama", "--k-ratio", "0.5", "--token-budget", "512"],
     "--k-ratio 0.5, --token-budget 512 need --projection FILE with --model"),
])
def test_evaluation_options(capsys, args, needle):
    assert main(args) == 2
    one_line(capsys, needle)


@pytest.mark.slow
def test_a_hub_task_offline_says_what_to_do(capsys):
    assert main(["lm-eval", "--model", "llama", "--tasks", "hellaswag", "--limit", "1"]) == 2
    one_line(capsys, "use --tasks aqua_local")


def test_help_lists_every_subcommand(capsys):
    from aqua_export.cli import SUBCOMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert tuple(sub.choices) == SUBCOMMANDS
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert f"Subcommands: {', '.join(SUBCOMMANDS)}" in " ".join(out.split())


# ------------------------------------------------------------------ a newcomer's second pass (values out of range)

@pytest.mark.parametrize("args,needle", [
    (["--token-budget", "1000000000000"], "argument --token-budget: 1000000000000 is past any context this tool serves"),
    (["--token-budget", "32", "--token-window", "100000000"], "argument --token-window: 100000000 is past any context"),
    (["--token-window", "32"], "token_sink / token_window are token selection's"),
    (["--token-budget", "60", *SHORT_PARITY], "reads every token of any prompt that fits this model's context of 64"),
    (["--parity-prompt-tokens", "60", "--parity-steps", "8"], "past the model's context of 64 tokens"),
    (["--parity-steps", "70"], "past the model's context of 64 tokens"),
    (["--calib-tokens", "-1"], "--calib-tokens -1"),
])
def test_build_values_refused_before_the_model_loads(ckpt, tmp_path, monkeypatch, capsys, args, needle):
    from aqua_export import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["--model", str(ckpt), "--k-ratio", "0.5", "--out", str(tmp_path / "o"), *args]) == 2
    one_line(capsys, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,needle", [
    (["parity", "{plain}", "--steps", "0"], "1 or more decode steps"),
    (["parity", "{plain}", "--steps", "-5"], "1 or more decode steps"),
    (["eval", "--folder", "{plain}", "--text", "builtin:gpl-3", "--seq-len", "512"], "past {plain}'s model context"),
    (["eval", "--folder", "{plain}", "--text", "builtin:gpl-3", "--threads", "-1"], "--threads -1"),
    (["eval", "--folder", "{plain}", "--text", "{tmp}"], "is a folder: give a text file"),
    (["eval", "--folder", "{plain}", "--text", "{nul}"], "holds NUL bytes"),
    (["bench", "{plain}", "--threads", "-2"], "--threads -2"),
    (["bench", "{plain}", "--capacity", "10", "--context", "40"], "--capacity 10 is fewer cache slots than the 50"),
    (["lm-eval", "--folder", "{plain}", "--batch-size", "0"], "--batch-size 0"),
    (["calibrate", "--model", "{ckpt}", "--seq-len", "1000000", "--out", "{tmp}/p.safetensors"],
     "--seq-len 1000000 is past the model's context of 64"),
])
def test_folder_values_refused_with_one_line(folders, ckpt, tmp_path, monkeypatch, capsys, args, needle):
    from aqua_export import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "nul.txt").write_bytes(b"\0\0\0")
    where = {"plain": folders["plain"], "tmp": tmp_path, "nul": tmp_path / "nul.txt", "ckpt": ckpt}
    assert main([a.format(**where) for a in args]) == 2
    one_line(capsys, needle.format(**where))


def test_a_negative_seed_samples_as_genai_does(folders, capsys):
    """--seed -1: a fresh seed each run (onnxruntime-genai's -1), in both runtimes."""
    for runtime in ("aqua", "genai"):
        assert main(["run", str(folders["plain"]), "--prompt", "Hi", "--sample", "--seed", "-1", "--max-new-tokens",
                     "3", "--runtime", runtime]) == 0
