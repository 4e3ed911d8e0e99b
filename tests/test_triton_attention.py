"""The Triton GPU kernel of AquaAttention (triton_attention.py) against the PyTorch reference
(export.attention_reference): on the GPU when there is one, otherwise the same kernel in Triton's CPU interpreter.
The cases are test_native_attention.py's, at sizes the interpreter runs quickly.

Tolerances: float32 2e-5 (float32 accumulation over L terms, as the CPU kernel), float16 4e-3 (float16's rounding
of the output).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported: every kernel here is interpreted
pytest.importorskip("triton", reason="triton is not installed (it comes with `pip install -e .[test]`)")

from aqua_export.export import attention_reference  # noqa: E402
from aqua_export.triton_attention import aqua_attention, split_count  # noqa: E402
from helpers import MIN, attention_inputs, random_projection  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (B, Hkv, g, T, r, L, C): decode with a long L (split positions), batched decode with a buffer larger than L and
# left padding, prefill (T > 1, causal), one query head per group, g = 4 with head_dim 128
SHAPES = [(1, 2, 3, 1, 64, 700, 700), (3, 2, 3, 1, 32, 90, 130), (2, 2, 3, 5, 16, 40, 40), (2, 1, 1, 3, 8, 9, 12),
          (1, 1, 4, 1, 128, 100, 128)]


def _run(q, kc, vc, length, mask, k, rule=0, softcap=0.0, P=None, splits=None):
    got = aqua_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), length, mask.to(DEV), k, rule, softcap,
                         None if P is None else P.to(DEV), splits=splits)
    return got.cpu()


def _ref(q, kc, vc, length, mask, k, rule=0, softcap=0.0, P=None):
    return attention_reference(q.double(), kc.double(), vc.double(), length, mask, k, rule, softcap,
                               None if P is None else P.double())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", [0, 1, 2])
@pytest.mark.parametrize("k_of_r", [1, 0.5, "r"])
def test_triton_attention_equals_reference(shape, rule, k_of_r):
    r = shape[4]
    k = 1 if k_of_r == 1 else r if k_of_r == "r" else r // 2
    ins = attention_inputs(shape)
    got, ref = _run(*ins, k, rule), _ref(*ins, k, rule)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() <= 2e-5


@pytest.mark.parametrize("shape,d", [((1, 2, 3, 1, 64, 300, 300), 64), ((2, 2, 3, 4, 16, 40, 40), 24)],
                         ids=["decode", "prefill-sliced"])
@pytest.mark.parametrize("rule", [0, 1])
def test_triton_attention_projects_the_query(shape, d, rule):
    """With P [Hkv, d, r] the kernel takes q [B,Hkv,g,T,d] and projects it (r < d: a sliced P)."""
    b, hkv, g, t, r, _, _ = shape
    _, kc, vc, length, mask = attention_inputs(shape)
    q = torch.randn(b, hkv, g, t, d, generator=torch.Generator().manual_seed(2))
    P = random_projection(hkv, d, r)
    got, ref = _run(q, kc, vc, length, mask, r // 2, rule, P=P), _ref(q, kc, vc, length, mask, r // 2, rule, P=P)
    assert (got.double() - ref).abs().max() <= 2e-5
    unprojected = _ref(q[..., :r].contiguous(), kc, vc, length, mask, r // 2, rule)
    assert (got.double() - unprojected).abs().max() > 1e-2  # P was applied: the test can fail


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_triton_attention_splits_merge_exactly(splits):
    """Any split of the positions merges to the same result (the split count is the host's choice)."""
    ins = attention_inputs((1, 2, 3, 1, 32, 500, 512))
    got = _run(*ins, 16, 1, splits=splits)
    assert (got.double() - _ref(*ins, 16, 1)).abs().max() <= 2e-5


def test_triton_attention_rv_softcap_float16_and_hidden_rows():
    # V of its own width (AQUA-Memory), soft-capping past the cap
    q, kc, vc, length, mask = attention_inputs((2, 2, 3, 2, 16, 50, 64), rv=24)
    q = q * 4
    got = _run(q, kc, vc, length, mask, 8, 1, softcap=5.0)
    assert got.shape[-1] == 24 and (got.double() - _ref(q, kc, vc, length, mask, 8, 1, 5.0)).abs().max() <= 2e-5
    assert (got.double() - _ref(q, kc, vc, length, mask, 8, 1)).abs().max() > 1e-2
    # float16 in and out
    ins = attention_inputs((2, 2, 3, 2, 32, 120, 128), torch.float16)
    got = _run(*ins, 16, 0)
    assert got.dtype == torch.float16 and (got.double() - _ref(*ins, 16, 0)).abs().max() <= 4e-3
    # a row the mask hides everywhere outputs zeros, not NaN
    q, kc, vc, length, mask = attention_inputs((2, 2, 3, 1, 16, 30, 30))
    mask[1] = MIN
    got = _run(q, kc, vc, length, mask, 8, 0)
    assert torch.isfinite(got).all() and (got[1] == 0).all() and (got[0] != 0).any()


def test_triton_attention_rejects_bad_input():
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 16, 20, 20))
    with pytest.raises(ValueError, match="total_length must fit"):
        _run(q, kc, vc, 21, mask, 8)
    with pytest.raises(ValueError, match="k must be in"):
        _run(q, kc, vc, length, mask, 17)
    with pytest.raises(ValueError, match="disagree"):
        _run(q, kc[:, :, :8], vc, length, mask, 8)
    with pytest.raises(ValueError, match="projection must be"):
        _run(q, kc, vc, length, mask, 8, P=random_projection(2, 16, 8))


def test_split_count_fills_the_gpu_and_keeps_whole_blocks():
    assert split_count(8 * 8, 16384, 16) == 5  # Llama-3.1-8B at batch 8: 64 programs -> 5 splits each
    assert split_count(1000, 16384, 16) == 1  # enough programs already
    assert split_count(1, 40, 16) == 3  # never more splits than blocks
