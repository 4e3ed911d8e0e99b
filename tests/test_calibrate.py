import json

import pytest
import torch

from aqua_export import calibrate, models
from aqua_export.config import ConfigError

from helpers import tiny_projection


def _calib(model, tok, tmp_path, name, **kw):
    tensors, meta = calibrate.calibrate(model, tok, progress=False, **kw)
    path = tmp_path / name
    calibrate.write(path, tensors, meta)
    return path


def test_artifact_layout_orthogonal_sorted_and_deterministic(tmp_path, char_tok):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n  Indented line.\n" * 20)
    model = models.tiny_model("llama")
    before = model.config._attn_implementation
    a = _calib(model, char_tok, tmp_path, "a.safetensors", texts=[str(text)], tokens=600, seq_len=64)
    b = _calib(model, char_tok, tmp_path, "b.safetensors", texts=[str(text)], tokens=600, seq_len=64)
    assert a.read_bytes() == b.read_bytes()
    proj = calibrate.load_projection(a)
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
    assert calibrate.load_projection(p).metadata["corpus"] == "self-generated(seed=3)"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1 has no string \"text\" field"):
        calibrate.calibrate(model, char_tok, texts=[str(bad)], progress=False)


def test_bad_projection_files(tmp_path):
    model = models.tiny_model("llama")
    good = tiny_projection(model, tmp_path)
    path = tmp_path / "tiny-0.safetensors"
    with pytest.raises(ConfigError, match="does not exist"):
        calibrate.load_projection(tmp_path / "missing.safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ConfigError, match="corrupt or not safetensors"):
        calibrate.load_projection(corrupt)
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="corrupt"):
        calibrate.load_projection(trunc)
    # not orthogonal
    from aqua_export.safetensors_io import save
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors["layers.0.P"] = tensors["layers.0.P"] * 2
    save(tmp_path / "scaled.safetensors", tensors, meta)
    with pytest.raises(ConfigError, match="layers.0.P is not orthogonal"):
        calibrate.load_projection(tmp_path / "scaled.safetensors")
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
