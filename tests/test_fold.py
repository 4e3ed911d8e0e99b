import pytest
import torch
from helpers import tiny_projection

from aqua_export import fold, models
from aqua_export.archs import ADAPTERS


def _random_orthogonal(hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0].float()


@pytest.mark.parametrize("arch", sorted(ADAPTERS))
def test_folded_value_output_equals_unfolded(arch, tmp_path):
    m = models.tiny_model(arch)
    proj = tiny_projection(m, tmp_path)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        for layer, pv in zip(ADAPTERS[arch].layers(m), proj.P_v):
            v_proj, o_proj = ADAPTERS[arch].value_output(layer)
            w, b = fold.fold_value(v_proj.weight, v_proj.bias, pv)
            v_proj.weight.copy_(w)
            if b is not None:
                v_proj.bias.copy_(b)
            o_proj.weight.copy_(fold.fold_output(o_proj.weight, pv, models.attention_geometry(m)["heads"] // pv.shape[0]))
        out = m(input_ids=ids).logits
    assert (out - ref).abs().max() <= 1e-5


def test_fold_value_is_p_transpose_per_head():
    hkv, d, D = 3, 8, 20
    p = _random_orthogonal(hkv, d, 0)
    w = torch.randn(hkv * d, D)
    b = torch.randn(hkv * d)
    x = torch.randn(5, D)
    w2, b2 = fold.fold_value(w, b, p)
    v = (x @ w.T + b).reshape(5, hkv, d)
    v2 = (x @ w2.T + b2).reshape(5, hkv, d)
    assert torch.allclose(v2, torch.einsum("nhd,hde->nhe", v, p), atol=1e-5)


def test_fold_shapes_are_checked():
    p = _random_orthogonal(2, 8, 1)
    with pytest.raises(AssertionError):
        fold.fold_value(torch.randn(15, 4), None, p)
    with pytest.raises(AssertionError):
        fold.fold_output(torch.randn(4, 30), p, 2)


def test_scale_fold_into_query():
    w, b = torch.randn(6, 4), torch.randn(6)
    w2, b2 = fold.fold_scale_into_query(w, b, 0.125)
    x = torch.randn(3, 4)
    assert torch.allclose(x @ w2.T + b2, 0.125 * (x @ w.T + b))


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
def test_weighted_bases_rank_by_w_and_keep_every_score(cache_dtype):
    """fold.selection_bases under a weighted rule: |q^'| is |q^| w, and each score term q^_i k^_i survives: a float
    cache holds k^ / w, an int8 cache k^ / w^split with the node's key_weights w^(1 - split) dividing it."""
    from aqua_export.config import AquaConfig

    hkv, d, r = 2, 8, 6
    P = _random_orthogonal(hkv, d, 3)
    rms = torch.rand(hkv, d, generator=torch.Generator().manual_seed(4)) + 0.1
    q, k = torch.randn(hkv, d), torch.randn(hkv, d)
    b = fold.selection_bases(P, rms, r, AquaConfig(k_ratio=0.5, selection="group-weighted"), cache_dtype)
    q_hat, k_hat = torch.einsum("hd,hdr->hr", q, P[:, :, :r]), torch.einsum("hd,hdr->hr", k, P[:, :, :r])
    w = fold.selection_weights(rms, r)
    qp, kp = torch.einsum("hd,hdr->hr", q, b.query), torch.einsum("hd,hdr->hr", k, b.key)
    assert torch.allclose(qp, q_hat * w, atol=1e-5)
    assert (b.key_weights is not None) == (cache_dtype == "int8")
    read = kp / b.key_weights if b.key_weights is not None else kp  # what the node scores with
    assert torch.allclose(kp, k_hat / w ** (fold.INT8_KEY_SPLIT if cache_dtype == "int8" else 1.0), atol=1e-5)
    assert torch.allclose(qp * read, q_hat * k_hat, atol=1e-5)
    plain = fold.selection_bases(P, rms, r, AquaConfig(k_ratio=0.5), cache_dtype)
    assert plain.key_weights is None and torch.equal(plain.query, plain.key)
