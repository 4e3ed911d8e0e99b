import json

import pytest
import torch
from helpers import tiny_projection

from aqua_export import calibrate, models
from aqua_export import projection as artifact
from aqua_export.config import ConfigError


def _calib(model, tok, tmp_path, name, **kw):
    tensors, meta = calibrate.calibrate(model, tok, progress=False, **kw)
    path = tmp_path / name
    artifact.write(path, tensors, meta)
    return path


def test_artifact_layout_orthogonal_sorted_and_deterministic(tmp_path, char_tok):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n  Indented line.\n" * 20)
    model = models.tiny_model("llama")
    before = model.config._attn_implementation
    a = _calib(model, char_tok, tmp_path, "a.safetensors", texts=[str(text)], tokens=600, seq_len=64)
    b = _calib(model, char_tok, tmp_path, "b.safetensors", texts=[str(text)], tokens=600, seq_len=64)
    assert a.read_bytes() == b.read_bytes()
    proj = artifact.load_projection(a)
    assert len(proj.P) == 2
    for P, E in zip(proj.P, proj.energy):
        assert P.shape == (2, 16, 16) and E.shape == (2, 16)
        assert (P.transpose(1, 2) @ P - torch.eye(16)).abs().max() < 1e-5
        assert (E[:, :-1] >= E[:, 1:]).all()
    meta = proj.metadata
    assert meta["tokens"] == "600" and meta["seq_len"] == "64" and meta["corpus"] == "t.txt"
    assert json.loads(meta["fingerprint"]) == models.fingerprint(model)
    # hooks are gone: no recorder state, attention implementation restored
    assert model.config._attn_implementation == before
    assert not hasattr(model.model.layers[0].self_attn, "_aqua_moments")


def test_p_diagonalises_the_stack_second_moment(tmp_path):
    """P^T C P is diagonal with the stored energies: P really is the SVD basis of [Q_1..Q_g; K]."""
    model = models.tiny_model("qwen2")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    mom = calibrate.Moments.zeros(2, 2, 16)
    with torch.no_grad(), calibrate.recording(model, mom):
        model(input_ids=ids, use_cache=False)
    t = calibrate.projection_tensors(mom)
    P = t["layers.1.P"].double()
    D = P.transpose(1, 2) @ mom.qk[1] @ P
    off = D - torch.diag_embed(torch.diagonal(D, dim1=-2, dim2=-1))
    assert off.abs().max() < 1e-6 * D.abs().max()
    assert torch.allclose(torch.diagonal(D, dim1=-2, dim2=-1) / mom.n_qk, t["layers.1.energy"].double(), rtol=1e-4)
    # n_qk counts g query rows + 1 key row per token
    assert mom.n_qk == 2 * 40 * (2 + 1)


def test_jsonl_and_self_generated_corpus(tmp_path, char_tok):
    model = models.tiny_model("mistral")
    j = tmp_path / "c.jsonl"
    j.write_text('{"text": "alpha beta"}\n\n{"text": "gamma delta epsilon"}\n')
    _calib(model, char_tok, tmp_path, "j.safetensors", texts=[str(j)], tokens=100, seq_len=8)
    p = _calib(model, char_tok, tmp_path, "g.safetensors", tokens=64, seq_len=16, seed=3)
    p2 = _calib(model, char_tok, tmp_path, "g2.safetensors", tokens=64, seq_len=16, seed=3)
    assert p.read_bytes() == p2.read_bytes()
    assert artifact.load_projection(p).metadata["corpus"] == "self-generated(seed=3)"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1 has no string \"text\" field"):
        calibrate.calibrate(model, char_tok, texts=[str(bad)], progress=False)


def test_bad_projection_files(tmp_path):
    model = models.tiny_model("llama")
    good = tiny_projection(model, tmp_path)
    path = tmp_path / "tiny-0.safetensors"
    with pytest.raises(ConfigError, match="does not exist"):
        artifact.load_projection(tmp_path / "missing.safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ConfigError, match="corrupt or not safetensors"):
        artifact.load_projection(corrupt)
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="corrupt"):
        artifact.load_projection(trunc)
    # not orthogonal
    from safetensors import safe_open

    from aqua_export.safetensors_io import save

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors["layers.0.P"] = tensors["layers.0.P"] * 2
    save(tmp_path / "scaled.safetensors", tensors, meta)
    with pytest.raises(ConfigError, match="layers.0.P is not orthogonal"):
        artifact.load_projection(tmp_path / "scaled.safetensors")
    # another model
    other = models.tiny_model("llama", seed=5)
    with pytest.raises(ConfigError, match="calibrated on another model .*attention_sha256.*recalibrate"):
        good.check_model(other)
    with pytest.raises(ConfigError, match="differs in .*architecture"):
        good.check_model(models.tiny_model("qwen2"))


@pytest.mark.slow
def test_embedded_calibration_is_fast_and_streams(smollm, tmp_path):
    import time

    model, tok = smollm
    t0 = time.perf_counter()
    tensors, meta = calibrate.calibrate(model, tok, texts=["builtin:python-reference"], tokens=1024, seq_len=256,
                                        progress=False)
    dt = time.perf_counter() - t0
    assert meta["tokens"] == "1024"
    assert tensors["layers.29.P"].shape == (3, 64, 64)
    # 16k tokens must take minutes: 1k tokens well under 16 s here leaves that margin on 2 cores
    assert dt < 30, dt


@pytest.mark.slow
def test_torchrun_two_processes_match_one_byte_for_byte(tmp_path):
    """Data-parallel calibration (torchrun, gloo on CPU): the corpus is split over 2 ranks, rank 0 folds the
    per-chunk moments in chunk order, and the artifact equals a single process's byte for byte. 1500 tokens
    in windows of 128 make 4 forwards (4 + 4 + 3 windows, then the short one): ranks get 2 each."""
    import subprocess
    import sys

    from helpers import saved_checkpoint

    ckpt = saved_checkpoint(tmp_path / "ckpt")
    common = ["calibrate", "--model", str(ckpt), "--text", "builtin:gpl-3", "--tokens", "1500", "--seq-len", "128",
              "--quiet"]
    one = subprocess.run([sys.executable, "-m", "aqua_export", *common, "--out", str(tmp_path / "one.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "aqua_export", *common, "--out", str(tmp_path / "two.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 alone writes
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    assert artifact.load_projection(tmp_path / "two.safetensors").metadata["tokens"] == "1500"


@pytest.mark.slow
def test_device_map_offload_calibrates_the_same(tmp_path, capsys, caplog):
    """A model that does not fit the memory it is given: accelerate places what fits (max_memory) and
    offloads the rest to disk; calibration streams through it and gives the same projection."""
    from helpers import saved_checkpoint

    from aqua_export.cli import main

    ckpt = saved_checkpoint(tmp_path / "ckpt", layers=4)
    common = ["calibrate", "--model", str(ckpt), "--text", "builtin:gpl-3", "--tokens", "600", "--seq-len", "128",
              "--quiet"]
    assert main([*common, "--out", str(tmp_path / "plain.safetensors")]) == 0
    # the embeddings alone take ~12 MB (49152 x 64 float32): a 4 MB CPU budget forces layers to disk
    assert main([*common, "--device-map", "auto", "--max-memory", "cpu=4MB", "--out", str(tmp_path / "off.safetensors")]) == 0
    assert "offloaded to the disk" in caplog.text  # accelerate really streamed weights from disk
    a = artifact.load_projection(tmp_path / "plain.safetensors")
    b = artifact.load_projection(tmp_path / "off.safetensors")
    for x, y in zip(a.P + a.P_v + a.energy, b.P + b.P_v + b.energy):
        assert torch.allclose(x, y, atol=1e-6)
    assert main([*common, "--max-memory", "cpu=4MB", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "--max-memory needs --device-map" in capsys.readouterr().err


def test_max_memory_parsing():
    assert models.parse_max_memory("cpu=2GiB, 0=20GiB") == {"cpu": "2GiB", 0: "20GiB"}
    with pytest.raises(ConfigError, match="DEVICE=SIZE"):
        models.parse_max_memory("cpu2GiB")


def test_bfloat16_checkpoint_calibrates_like_its_float32_load(tmp_path):
    """A bfloat16 checkpoint kept in bfloat16 (no float32 copy) and computed in float32 layer by layer gives
    the artifact of the same checkpoint loaded as float32, byte for byte (bfloat16 -> float32 is exact)."""
    from helpers import saved_checkpoint

    from aqua_export.reference.precision import float32_compute, storage_dtype

    ckpt = saved_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)
    m16, tok = models.load(str(ckpt), dtype="auto")
    m32, _ = models.load(str(ckpt))
    assert storage_dtype(m16) == torch.bfloat16 and storage_dtype(m32) == torch.float32
    a = _calib(m16, tok, tmp_path, "a.safetensors", texts=["builtin:gpl-3"], tokens=700, seq_len=128)
    b = _calib(m32, tok, tmp_path, "b.safetensors", texts=["builtin:gpl-3"], tokens=700, seq_len=128)
    assert a.read_bytes() == b.read_bytes()
    # the hooks are gone afterwards: the bfloat16 model computes in bfloat16 again, and the weights stayed bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert m16(input_ids=ids).logits.dtype == torch.bfloat16
        with float32_compute(m16):
            assert m16(input_ids=ids).logits.dtype == torch.float32
    assert storage_dtype(m16) == torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "olmoe"])
def test_float64_compute_equals_a_float64_copy(arch, monkeypatch):
    """computing_in(model, float64) widens one layer at a time (the output layer by vocabulary chunks, a MoE's experts
    without torch's grouped GEMM, which takes no float64): the logits of a float64 copy of the model, and the model
    is as before afterwards."""
    import copy

    from aqua_export.reference import precision

    monkeypatch.setattr(precision, "HEAD_ROWS", 50)  # 128 vocabulary rows: three chunks
    m = models.tiny_model(arch)
    experts = m.config._experts_implementation
    exact = copy.deepcopy(m).double()
    exact.set_experts_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        with precision.computing_in(m, torch.float64):
            got = m(input_ids=ids).logits
        want = exact(input_ids=ids).logits
        assert got.dtype == torch.float64 and (got - want).abs().max() <= 1e-12
        assert m(input_ids=ids).logits.dtype == torch.float32 and precision.storage_dtype(m) == torch.float32
    assert m.config._experts_implementation == experts
