"""A folder built here runs on other CPUs: the shipped kernel library picks a variant the CPU runs (plugins/ort/
loader.cc), each variant holds no instruction beyond its level, the folder's own library runs under QEMU emulating
CPUs without AVX-512 (Haswell) and without AVX2 (Nehalem) with the logits of this CPU's run, and a folder whose
library is missing or has no variant for the CPU runs its function bodies with one line."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import saved_checkpoint

from aqua_export.cli import main
from aqua_export.runtime.genai import native_files
from aqua_export.runtime import session
from aqua_export.runtime.session import native_library, native_variant

ROOT = Path(__file__).resolve().parents[1]
QEMU = ROOT / "build" / "qemu" / "usr" / "bin" / "qemu-x86_64"
RUN = Path(__file__).with_name("portable_run.py")
X86 = os.uname().machine == "x86_64"
# emulated CPU -> the variant the loader must pick there (QEMU emulates no AVX-512: TCG has none)
CPUS = {"Haswell": "x86-64-v3", "Nehalem": "x86-64-v2"}
# the most vector registers a variant may name: none past xmm for the baseline, ymm for AVX2
WIDEST = {"x86-64-v2": "xmm", "x86-64-v3": "ymm", "x86-64-v4": "zmm"}
REGISTERS = ("xmm", "ymm", "zmm")
LOGITS_TOL = 1e-3  # the bound; measured (Nehalem's SSE arithmetic in MLAS and the kernels) below 1e-5

needs_library = pytest.mark.skipif(native_library() is None, reason="native kernels not built (run `make plugin`)")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three tiny folders: AquaAttention with token selection and a float16 cache (F16C on v3, scalar on v2),
    AQUA-H2O (its own kernel), and a graph of standard ops (--ops standard)."""
    tmp = tmp_path_factory.mktemp("portable")
    ckpt = saved_checkpoint(tmp / "ckpt", max_position_embeddings=128)
    out = {}
    for name, extra in (("tokens", ["--token-budget", "32", "--token-window", "16", "--cache-dtype", "float16"]),
                        ("h2o", ["--h2o-ratio", "0.5"]), ("standard", ["--token-budget", "32", "--ops", "standard"])):
        out[name] = tmp / name
        assert main(["--model", str(ckpt), "--k-ratio", "0.5", "--calib-text", "builtin:gpl-3", "--calib-tokens", "256",
                     "--parity-prompt-tokens", "32", "--parity-steps", "2", "--out", str(out[name]), *extra]) == 0
    return out


def _run(model: Path, out: Path, library: Path | None, cpu: str | None = None, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(RUN), str(model), str(out)] + ([str(library)] if library else [])
    if cpu:
        cmd = [str(QEMU), "-cpu", cpu] + cmd
        if "OPENBLAS_CORETYPE" in os.environ:  # set on some hosts for the host's CPU: the emulated one is another
            env = {**(env or {}), "OPENBLAS_CORETYPE": cpu}  # (Haswell's kernels are SIGILL on an emulated Nehalem)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr[-2000:]
    got = np.load(out)
    return {"logits": got["logits"], "variant": str(got["variant"]), "stderr": res.stderr}


@needs_library
@pytest.mark.skipif(not X86, reason="the variants checked here are x86-64's")
def test_each_variant_names_no_register_beyond_its_level():
    """objdump of every shipped variant: the baseline names no ymm / zmm register, AVX2 no zmm (a -march=native
    build named thousands of zmm registers on an AVX-512 machine)."""
    files = {f.name: f for f in native_files(native_library())}
    assert set(files) == {"libaqua_ort.so"} | {f"libaqua_ort_{v}.so" for v in WIDEST}
    for name, f in files.items():
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(f)], capture_output=True, text=True,
                              check=True).stdout
        used = set(re.findall(r"%(xmm|ymm|zmm)\d", text))
        level = WIDEST.get(name.removeprefix("libaqua_ort_").removesuffix(".so"), "xmm")  # the loader: baseline
        assert used <= set(REGISTERS[: REGISTERS.index(level) + 1]), (name, used)


@needs_library
def test_the_loader_picks_a_variant_this_cpu_runs_and_refuses_a_forced_one_it_cannot(monkeypatch):
    flags = Path("/proc/cpuinfo").read_text() if X86 else ""
    want = "x86-64-v4" if " avx512vl" in flags and " avx512bw" in flags else "x86-64-v3" if " avx2" in flags else \
        "x86-64-v2" if X86 else "armv8-a"
    assert native_variant() == want
    if X86 and want != "x86-64-v4":
        monkeypatch.setenv("AQUA_ORT_ISA", "x86-64-v4")
        from aqua_export.config import ConfigError

        with pytest.raises(ConfigError, match="this CPU cannot run that variant"):
            native_variant()


@needs_library
@pytest.mark.skipif(not X86, reason="QEMU emulates x86-64 CPUs here")
@pytest.mark.skipif(not QEMU.is_file(), reason="qemu-x86_64 not fetched (make test fetches it into build/qemu)")
@pytest.mark.parametrize("which", ["tokens", "h2o"])
def test_the_folder_runs_on_older_cpus_with_this_cpus_logits(folders, which, tmp_path):
    """The folder's own libaqua_ort.so (what onnxruntime-genai registers; H2O folders, which genai cannot run, carry
    none: the installed one) under QEMU: no SIGILL, the variant the emulated CPU has, logits within 1e-3 of this CPU's
    run; the baseline forced here agrees too."""
    folder = folders[which]
    lib = folder / "libaqua_ort.so" if which != "h2o" else native_library()
    here = _run(folder / "model.onnx", tmp_path / "here.npz", lib)
    assert here["variant"] == native_variant()
    runs = {"baseline here": _run(folder / "model.onnx", tmp_path / "v2.npz", lib, env={"AQUA_ORT_ISA": "x86-64-v2"})}
    assert runs["baseline here"]["variant"] == "x86-64-v2"
    for cpu, variant in CPUS.items():
        runs[cpu] = _run(folder / "model.onnx", tmp_path / f"{cpu}.npz", lib, cpu=cpu)
        assert runs[cpu]["variant"] == variant, runs[cpu]["stderr"][-500:]
    for name, got in runs.items():
        err = float(np.abs(got["logits"] - here["logits"]).max())
        print(f"{which}: {name} vs this CPU: max |dlogit| {err:.2e}")
        assert err <= LOGITS_TOL, name
        assert (got["logits"].argmax(-1) == here["logits"].argmax(-1)).all()


@needs_library
def test_no_variant_beside_the_loader_runs_the_bodies_with_one_line(folders, tmp_path, capfd, monkeypatch):
    """A loader without its variants (an x86-64 older than v2 sees the same): ONNX Runtime gets no kernel and runs
    the function bodies; `aqua-export run` says so in one line and prints what it prints with the kernels."""
    alone = tmp_path / "lib"
    alone.mkdir()
    shutil.copyfile(native_library(), alone / "libaqua_ort.so")
    here = _run(folders["tokens"] / "model.onnx", tmp_path / "a.npz", native_library())
    bodies = _run(folders["tokens"] / "model.onnx", tmp_path / "b.npz", alone / "libaqua_ort.so")
    assert bodies["variant"] == "" and "no kernel variant for this CPU" in bodies["stderr"]
    assert np.abs(bodies["logits"] - here["logits"]).max() <= LOGITS_TOL
    args = ["run", str(folders["tokens"]), "--prompt", "The license", "--max-new-tokens", "4"]
    monkeypatch.setattr(session, "_SAID", set())  # each run's line, whatever ran before in this process
    capfd.readouterr()
    assert main(args) == 0
    got = capfd.readouterr()
    want = got.out
    # run says which path it takes, once: the kernels of the variant this CPU runs
    assert [x for x in got.err.splitlines() if x.strip()] == [
        f"aqua-export: ONNX Runtime runs the custom nodes on the native kernels ({native_variant()}: "
        f"{native_library()})"]
    monkeypatch.setenv("AQUA_ORT_KERNEL", str(alone / "libaqua_ort.so"))
    assert main(args) == 0
    got = capfd.readouterr()
    assert got.out == want
    assert [x for x in got.err.splitlines() if x.strip()] == [
        f"aqua-export: no variant of the native kernels beside {alone / 'libaqua_ort.so'} runs on this CPU (they need "
        "at least x86-64-v2: SSE4.2 and POPCNT): the custom nodes run their ONNX function bodies (slower)"]


@needs_library
def test_genai_runs_a_folder_without_its_library_with_one_line(folders, tmp_path, capfd, monkeypatch):
    """genai refuses a folder whose config names a missing library; `run --runtime genai` opens a view of it without
    the key, says so in one line, and prints the same text."""
    args = ["--prompt", "The license", "--max-new-tokens", "4", "--runtime", "genai"]
    monkeypatch.setattr(session, "_SAID", set())
    capfd.readouterr()
    assert main(["run", str(folders["tokens"]), *args]) == 0
    got = capfd.readouterr()
    want = got.out
    assert [x for x in got.err.splitlines() if x.strip()] == [
        f"aqua-export: onnxruntime-genai runs the custom nodes on {folders['tokens']}'s native kernels "
        f"({native_variant()})"]
    bare = tmp_path / "bare"
    shutil.copytree(folders["tokens"], bare)
    for f in bare.glob("libaqua_ort*.so"):
        f.unlink()
    assert json.loads((bare / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
        "custom_ops_library"] == "libaqua_ort.so"
    assert main(["run", str(bare), *args]) == 0
    got = capfd.readouterr()
    assert got.out == want
    assert [x for x in got.err.splitlines() if x.strip()] == [
        f"aqua-export: {bare} has no libaqua_ort.so (the native kernels): onnxruntime-genai runs the custom nodes' ONNX "
        "function bodies (slower)"]
    # the runtimes run without the kernels, but the folder is not as built: check names every file that is gone
    capfd.readouterr()
    assert main(["check", str(bare)]) != 0
    err = capfd.readouterr().err
    assert "libaqua_ort.so, libaqua_ort_x86-64-v2.so, libaqua_ort_x86-64-v3.so, libaqua_ort_x86-64-v4.so (the native " \
           "kernels) are missing" in err and len(err.strip().splitlines()) == 1, err


def test_a_standard_ops_folder_runs_in_onnx_reference_evaluator_and_infers_every_shape(folders):
    """--ops standard: only ai.onnx nodes beside the com.aqua ones (their bodies inside), so ONNX's own reference
    evaluator runs the folder (a prompt, then a decode step on its cache) with ONNX Runtime's logits, and strict
    shape inference gives every node output a shape, the cache outputs their declared dims."""
    import warnings

    import onnx
    from onnx.reference import ReferenceEvaluator

    from aqua_export.runtime.session import make_session

    path = folders["standard"] / "model.onnx"
    m = onnx.load(path)
    assert {n.domain for n in m.graph.node} == {"", "com.aqua"}
    assert {o.domain for o in m.opset_import} == {"", "com.aqua"}
    ev, sess = ReferenceEvaluator(m), make_session(path)
    pasts = m.graph.input[2:]
    past = [np.zeros((1, p.type.tensor_type.shape.dim[1].dim_value, 0, p.type.tensor_type.shape.dim[3].dim_value),
                     np.float32) for p in pasts]
    ids, seen = (np.arange(12)[None] * 5 + 3).astype(np.int64), 0
    for step in range(2):
        seen += ids.shape[1]
        feed = {"input_ids": ids, "attention_mask": np.ones((1, seen), np.int64), **{
            p.name: v for p, v in zip(pasts, past)}}
        with warnings.catch_warnings():  # the bodies divide by a soft-cap of 0 on the branch Where drops
            warnings.simplefilter("ignore", RuntimeWarning)
            want = ev.run(None, feed)
        got = sess.run(None, feed)
        # the logits generation reads (LogitRows: a prompt's other rows are unspecified, zeros in the body)
        assert np.abs(want[0][:, -1] - got[0][:, -1]).max() <= 1e-4, step
        past, ids = got[1:], np.array([[int(got[0][0, -1].argmax())]], np.int64)
    declared = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in m.graph.output}
    for o in m.graph.output:  # inferred, not read back from the declarations
        o.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True, data_prop=True)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.output) if v.type.tensor_type.HasField(
                  "shape")}
    missing = [o for n in m.graph.node for o in n.output if o and o not in shapes]
    assert not missing, missing[:5]
    for name, want in declared.items():  # [batch, kv_heads, present, r] and [batch, sequence, vocab]: the numbers
        assert shapes[name] == want, (name, shapes[name], want)
