"""AquaAttention, the fused attention node: the native kernel and the function body against the PyTorch
reference (export.attention_reference), for every selection rule, decode and prefill, padding, soft-capping,
buffers larger than the filled length, and float16."""

import numpy as np
import pytest
import torch

from aqua_export.export import attention_op_model, attention_reference
from aqua_export.runtime import make_session, native_library
from helpers import MIN, attention_inputs, random_projection

NATIVE = native_library() is not None
KERNELS = ["function"] + (["native"] if NATIVE else [])

# (B, Hkv, g, T, r, L, C): decode at batch 1 with a long L (the kernel splits the positions over threads),
# batched decode with a buffer larger than L, prefill (T > 1, causal), one query head per group, g = 4, and
# Llama-3's head_dim 128 (the float32 value product runs in passes of 64 columns)
SHAPES = [(1, 2, 3, 1, 64, 3000, 3000), (3, 3, 3, 1, 32, 300, 517), (2, 2, 3, 7, 16, 40, 40), (2, 1, 1, 5, 8, 9, 12),
          (1, 2, 4, 3, 64, 600, 700), (2, 2, 4, 1, 128, 700, 800)]


def _run(kernel, k, rule, softcap, q, kc, vc, length, mask, dtype="float32", P=None):
    model = attention_op_model(k, rule, softcap, dtype, projected=P is not None)
    sess = make_session(model.SerializeToString(), kernel=kernel)
    feed = {"q": q.numpy(), "kc": kc.numpy(), "vc": vc.numpy(), "length": np.array([length], np.int64),
            "mask": mask.numpy()}
    return sess.run(None, feed if P is None else dict(feed, P=P.numpy()))[0]



@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", [0, 1, 2])
@pytest.mark.parametrize("k_of_r", [1, 0.5, "r"])
def test_attention_equals_reference_float32(kernel, shape, rule, k_of_r):
    r = shape[4]
    k = 1 if k_of_r == 1 else r if k_of_r == "r" else r // 2
    q, kc, vc, length, mask = attention_inputs(shape)
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
    q, kc, vc, length, mask = attention_inputs(shape, rv=rv)
    got = _run(kernel, shape[4] // 2, 1, 0.0, q, kc, vc, length, mask)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, shape[4] // 2, 1).numpy()
    assert got.shape == ref.shape and got.shape[-1] == rv
    assert np.abs(got - ref).max() <= 2e-5


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_softcap(kernel):
    q, kc, vc, length, mask = attention_inputs((2, 2, 3, 4, 16, 50, 64))
    q = q * 4  # scores well past the cap, where tanh bends them
    got = _run(kernel, 8, 1, 5.0, q, kc, vc, length, mask)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 8, 1, softcap=5.0).numpy()
    plain = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 8, 1).numpy()
    assert np.abs(got - ref).max() <= 2e-5
    assert np.abs(got - plain).max() > 1e-2  # the cap changed the result: the test can fail


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_float16(kernel):
    """float16 in and out, scores and softmax in float32: within float16's rounding of the output (2^-10 relative)."""
    q, kc, vc, length, mask = attention_inputs((2, 3, 3, 2, 32, 200, 256), torch.float16)
    got = _run(kernel, 16, 0, 0.0, q, kc, vc, length, mask, "float16").astype(np.float64)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 16, 0).numpy()
    assert np.abs(got - ref).max() <= 4e-3


def test_group_rule_shares_one_selection():
    """Rule 1 keeps one set per (batch, KV head, token): with an identity key cache and V the scores are q^[I]
    itself, so every query head of a group must have nonzero scores on the same coordinates."""
    from aqua_export.export import topk_gather_dot_reference

    q, _, _, _, _ = attention_inputs((2, 2, 3, 2, 8, 8, 8))
    s = topk_gather_dot_reference(q, torch.eye(8).expand(2, 2, 8, 8), 3, rule=1)
    kept = s != 0
    assert (kept == kept[:, :, :1]).all() and (kept.sum(-1) == 3).all()
    own = topk_gather_dot_reference(q, torch.eye(8).expand(2, 2, 8, 8), 3, rule=0) != 0
    assert not (own == own[:, :, :1]).all()  # per-head selections differ on these queries


@pytest.mark.skipif(not NATIVE, reason="native kernel not built (run `make plugin`)")
def test_native_rejects_bad_input():
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 16, 20, 20))
    with pytest.raises(Exception, match="total_length must fit"):
        _run("native", 8, 0, 0.0, q, kc, vc, 21, mask)
    with pytest.raises(Exception, match="k must be in"):
        _run("native", 17, 0, 0.0, q, kc, vc, length, mask)
    with pytest.raises(Exception, match="disagree"):
        _run("native", 8, 0, 0.0, q, kc[:, :, :8], vc, length, mask)


@pytest.mark.skipif(not NATIVE, reason="native kernel not built (run `make plugin`)")
def test_native_row_hidden_everywhere_is_zero():
    """A query row the mask hides from every position (a padding token) outputs zeros, not NaN."""
    q, kc, vc, length, mask = attention_inputs((2, 2, 3, 1, 16, 30, 30))
    mask[1] = MIN
    got = _run("native", 8, 0, 0.0, q, kc, vc, length, mask)
    assert np.isfinite(got).all() and (got[1] == 0).all() and (got[0] != 0).any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape,d", [((1, 2, 3, 1, 64, 3000, 3000), 64), ((3, 3, 3, 1, 32, 300, 517), 32),
                                     ((2, 2, 3, 7, 16, 40, 40), 24), ((2, 2, 4, 1, 96, 700, 800), 128)],
                         ids=["decode-split", "batched-decode", "prefill-sliced", "decode-sliced-128"])
@pytest.mark.parametrize("rule", [0, 1])
def test_attention_projects_the_query(kernel, shape, d, rule):
    """With the optional sixth input P [Hkv, d, r] the node takes q [B,Hkv,g,T,d] and projects it itself
    (r < d: AQUA-Memory's sliced P): equal to the reference's q P, then the same attention."""
    b, hkv, g, t, r, length, cap = shape
    _, kc, vc, length, mask = attention_inputs(shape)
    q = torch.randn(b, hkv, g, t, d, generator=torch.Generator().manual_seed(2))
    P = random_projection(hkv, d, r)
    got = _run(kernel, r // 2, rule, 0.0, q, kc, vc, length, mask, P=P)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, r // 2, rule,
                              projection=P.double()).numpy()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 2e-5, np.abs(got - ref).max()
    unprojected = attention_reference(q[..., :r].double(), kc.double(), vc.double(), length, mask, r // 2, rule)
    assert np.abs(got - unprojected.numpy()).max() > 1e-2  # P was applied: the test can fail


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_projects_float16(kernel):
    q, kc, vc, length, mask = attention_inputs((2, 3, 3, 2, 32, 200, 256), torch.float16)
    P = random_projection(3, 32, 32).half()
    got = _run(kernel, 16, 1, 0.0, q, kc, vc, length, mask, "float16", P=P).astype(np.float64)
    ref = attention_reference(q.double(), kc.double(), vc.double(), length, mask, 16, 1,
                              projection=P.double()).numpy()
    assert np.abs(got - ref).max() <= 4e-3


@pytest.mark.skipif(not NATIVE, reason="native kernel not built (run `make plugin`)")
def test_native_rejects_a_projection_of_the_wrong_shape():
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 16, 20, 20))
    for bad in (random_projection(3, 16, 16), random_projection(2, 24, 16), random_projection(2, 16, 8)):  # Hkv, d, r wrong
        with pytest.raises(Exception, match="projection must be"):
            _run("native", 8, 0, 0.0, q, kc, vc, length, mask, P=bad)
