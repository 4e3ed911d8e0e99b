"""AquaAttention, the fused attention node: the native kernel and the function body against the PyTorch
reference (export.attention_reference), for every selection rule, decode and prefill, padding, soft-capping,
buffers larger than the filled length, and float16."""

import numpy as np
import pytest
import torch

from aqua_export.export import attention_op_model, attention_reference
from aqua_export.runtime import make_session, native_library

NATIVE = native_library() is not None
KERNELS = ["function"] + (["native"] if NATIVE else [])
MIN = float(torch.finfo(torch.float32).min)

# (B, Hkv, g, T, r, L, C): decode at batch 1 with a long L (the kernel splits the positions over threads),
# batched decode with a buffer larger than L, prefill (T > 1, causal), one query head per group, g = 4, and
# Llama-3's head_dim 128 (the float32 value product runs in passes of 64 columns)
SHAPES = [(1, 2, 3, 1, 64, 3000, 3000), (3, 3, 3, 1, 32, 300, 517), (2, 2, 3, 7, 16, 40, 40), (2, 1, 1, 5, 8, 9, 12),
          (1, 2, 4, 3, 64, 600, 700), (2, 2, 4, 1, 128, 700, 800)]


def _inputs(shape, dtype=torch.float32, seed=0, pad=True, rv=None):
    b, hkv, g, t, r, length, cap = shape
    rv = r if rv is None else rv
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, t, r, generator=gen)
    q[0, 0, 0, 0, : min(4, r)] = 1.5  # a tie: the lower index wins
    kc = torch.randn(b, hkv, r, cap, generator=gen)
    vc = torch.randn(b, hkv, cap, rv, generator=gen)
    pos = torch.arange(length)
    new = torch.arange(length - t, length)
    ok = (pos[None, :] <= new[:, None]).expand(b, t, length).clone()  # causal over the new tokens
    if pad and b > 1:
        ok[1:, :, : length // 3] = False  # left padding of the later rows
    mask = torch.where(ok, 0.0, MIN)[:, None, None]
    return q.to(dtype), kc.to(dtype), vc.to(dtype), length, mask


def _run(kernel, k, rule, softcap, q, kc, vc, length, mask, dtype="float32"):
    sess = make_session(attention_op_model(k, rule, softcap, dtype).SerializeToString(), kernel=kernel)
    return sess.run(None, {"q": q.numpy(), "kc": kc.numpy(), "vc": vc.numpy(),
                           "length": np.array([length], np.int64), "mask": mask.numpy()})[0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", [0, 1, 2])
@pytest.mark.parametrize("k_of_r", [1, 0.5, "r"])
def test_attention_equals_reference_float32(kernel, shape, rule, k_of_r):
    r = shape[4]
    k = 1 if k_of_r == 1 else r if k_of_r == "r" else r // 2
    q, kc, vc, length, mask = _inputs(shape)
    got = _run(kernel, k, rule, 0.0, q, kc, vc, length, mask)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, k, rule).numpy()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 2e-5, np.abs(got - ref).max()  # float32 accumulation over L terms


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,rv", [((1, 2, 3, 1, 32, 3000, 3000), 48), ((2, 2, 3, 7, 16, 40, 40), 8),
                                      ((2, 2, 3, 1, 64, 600, 600), 52), ((1, 2, 3, 2, 64, 300, 300), 100)],
                         ids=["decode-split-wider-v", "prefill-narrower-v", "decode-v-52", "v-wider-than-64"])
def test_values_of_their_own_width(kernel, shape, rv):
    """AQUA-Memory may cache V at its own width rv: out is rv wide (the split decode merges rv + 2 partials)."""
    q, kc, vc, length, mask = _inputs(shape, rv=rv)
    got = _run(kernel, shape[4] // 2, 1, 0.0, q, kc, vc, length, mask)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, shape[4] // 2, 1).numpy()
    assert got.shape == ref.shape and got.shape[-1] == rv
    assert np.abs(got - ref).max() <= 2e-5


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_softcap(kernel):
    q, kc, vc, length, mask = _inputs((2, 2, 3, 4, 16, 50, 64))
    q = q * 4  # scores well past the cap, where tanh bends them
    got = _run(kernel, 8, 1, 5.0, q, kc, vc, length, mask)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 8, 1, softcap=5.0).numpy()
    plain = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 8, 1).numpy()
    assert np.abs(got - ref).max() <= 2e-5
    assert np.abs(got - plain).max() > 1e-2  # the cap changed the result: the test can fail


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_float16(kernel):
    """float16 in and out, scores and softmax in float32: within float16's rounding of the output (2^-10 relative)."""
    q, kc, vc, length, mask = _inputs((2, 3, 3, 2, 32, 200, 256), torch.float16)
    got = _run(kernel, 16, 0, 0.0, q, kc, vc, length, mask, "float16").astype(np.float64)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 16, 0).numpy()
    assert np.abs(got - ref).max() <= 4e-3


def test_group_rule_shares_one_selection():
    """Rule 1 keeps one set per (batch, KV head, token): with an identity key cache and V the scores are q^[I]
    itself, so every query head of a group must have nonzero scores on the same coordinates."""
    from aqua_export.export import topk_gather_dot_reference

    q, _, _, _, _ = _inputs((2, 2, 3, 2, 8, 8, 8))
    s = topk_gather_dot_reference(q, torch.eye(8).expand(2, 2, 8, 8), 3, rule=1)
    kept = s != 0
    assert (kept == kept[:, :, :1]).all() and (kept.sum(-1) == 3).all()
    own = topk_gather_dot_reference(q, torch.eye(8).expand(2, 2, 8, 8), 3, rule=0) != 0
    assert not (own == own[:, :, :1]).all()  # per-head selections differ on these queries


@pytest.mark.skipif(not NATIVE, reason="native kernel not built (run `make plugin`)")
def test_native_rejects_bad_input():
    q, kc, vc, length, mask = _inputs((1, 2, 3, 1, 16, 20, 20))
    with pytest.raises(Exception, match="total_length must fit"):
        _run("native", 8, 0, 0.0, q, kc, vc, 21, mask)
    with pytest.raises(Exception, match="k must be in"):
        _run("native", 17, 0, 0.0, q, kc, vc, length, mask)
    with pytest.raises(Exception, match="disagree"):
        _run("native", 8, 0, 0.0, q, kc[:, :, :8], vc, length, mask)


@pytest.mark.skipif(not NATIVE, reason="native kernel not built (run `make plugin`)")
def test_native_row_hidden_everywhere_is_zero():
    """A query row the mask hides from every position (a padding token) outputs zeros, not NaN."""
    q, kc, vc, length, mask = _inputs((2, 2, 3, 1, 16, 30, 30))
    mask[1] = MIN
    got = _run("native", 8, 0, 0.0, q, kc, vc, length, mask)
    assert np.isfinite(got).all() and (got[1] == 0).all() and (got[0] != 0).any()
