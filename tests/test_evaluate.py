import math

import pytest
import torch
from helpers import tiny_projection

from aqua_export import evaluate, models
from aqua_export.config import AquaConfig, ConfigError


def test_perplexity_matches_a_manual_computation(char_tok):
    m = models.tiny_model("llama")
    text = "  leading spaces\n\tand tabs are kept  " * 3
    res = evaluate.perplexity(m, char_tok, text, tokens=50, seq_len=16)
    ids = torch.tensor(char_tok(text)["input_ids"][:50])
    assert res["tokens"] == 50 and res["windows"] == 4 and res["predicted_tokens"] == 15 * 3 + 1
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, 50, 16):
            w = ids[s:s + 16]
            logp = torch.log_softmax(m(input_ids=w[None]).logits[0, :-1].double(), -1)
            nll -= logp.gather(-1, w[1:, None]).sum().item()
            n += w.numel() - 1
    assert math.isclose(res["perplexity"], math.exp(nll / n), rel_tol=1e-6)
    assert res["config"] == AquaConfig().to_dict()


def test_aqua_perplexity_moves_with_k_and_needs_projection(char_tok, tmp_path):
    m = models.tiny_model("qwen2")
    proj = tiny_projection(m, tmp_path)
    text = "abcdefghij klmnop qrstuv wxyz " * 4
    dense = evaluate.perplexity(m, char_tok, text, tokens=96, seq_len=32)["perplexity"]
    one = evaluate.perplexity(m, char_tok, text, tokens=96, seq_len=32, projection=proj, config=AquaConfig())
    low = evaluate.perplexity(m, char_tok, text, tokens=96, seq_len=32, projection=proj, config=AquaConfig(k_ratio=0.25))
    assert math.isclose(one["perplexity"], dense, rel_tol=1e-5)
    assert abs(low["perplexity"] - dense) > 1e-3
    with pytest.raises(ConfigError, match="--k-ratio 0.5 needs a projection"):
        evaluate.perplexity(m, char_tok, text, tokens=96, seq_len=32, config=AquaConfig(k_ratio=0.5))
    with pytest.raises(ConfigError, match="seq-len"):
        evaluate.perplexity(m, char_tok, text, tokens=96, seq_len=1)


def test_retention_report_and_plot(char_tok, tmp_path, tiny_llama):
    m, proj = tiny_llama
    text = "the cat sat on the mat; the dog sat on the log. " * 4
    rep = evaluate.retention_report(m, char_tok, text, proj, tokens=128, seq_len=64, k_ratio=0.5)
    assert set(rep["loss"]) == {"magnitude/offline", "static/offline", "magnitude/online", "static/online"}
    loss = {k: torch.tensor(v) for k, v in rep["loss"].items()}
    assert all(v.shape == (2, 4) for v in loss.values())
    assert all(((v >= 0) & (v <= 1)).all() for v in loss.values())
    # magnitude keeps the largest coordinates of each query: it never retains less than static
    assert (loss["magnitude/offline"] <= loss["static/offline"] + 1e-6).all()
    assert (loss["magnitude/online"] <= loss["static/online"] + 1e-6).all()
    png = tmp_path / "r.png"
    evaluate.plot_retention(rep, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # k = d keeps everything
    full = evaluate.retention_loss([torch.randn(4, 10, 16)], proj.P[:1], 1.0, "magnitude")
    assert full.abs().max() < 1e-6
