"""The Triton GPU kernel of TopKGatherDot against the reference: on the GPU when there is one, otherwise the
same kernel in Triton's CPU interpreter (exactly the program the GPU runs, executed element by element)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when it is first imported: this process runs every kernel interpreted
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (it comes with `pip install -e .[test]`)")

from aqua_export.export import topk_gather_dot_reference  # noqa: E402
from aqua_export.triton_kernel import block_sizes, topk_gather_dot  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu-interpreter"]
SHAPES = [(1, 1, 1, 1, 16, 5), (2, 3, 3, 1, 64, 131), (3, 2, 2, 5, 8, 7), (1, 2, 4, 3, 48, 300)]


def _inputs(shape, seed=0):
    b, hkv, g, t, r, s = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, t, r, generator=gen)
    q[0, 0, 0, 0, : min(4, r)] = 1.5  # ties: the lower index wins
    q[-1, -1, -1, -1, :] = 0.25
    return q, torch.randn(b, hkv, r, s, generator=gen)


def _dev(name):
    return "cuda" if name == "cuda" else "cpu"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("which_k", ["1", "half", "r"])
@pytest.mark.parametrize("rule", [0, 1, 2])
def test_triton_equals_reference(device, shape, which_k, rule):
    r = shape[4]
    k = {"1": 1, "half": r // 2, "r": r}[which_k]
    q, kc = _inputs(shape)
    got = topk_gather_dot(q.to(_dev(device)), kc.to(_dev(device)), k, rule=rule).cpu()
    ref = topk_gather_dot_reference(q.double(), kc.double(), k, rule)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_triton_selects_exactly_the_reference_set(device, k):
    """Identity key cache: score[c] = q[c] when c is kept, else 0."""
    q, _ = _inputs((3, 2, 2, 5, 8, 1))
    kc = torch.eye(8).expand(3, 2, 8, 8).contiguous()
    got = topk_gather_dot(q.to(_dev(device)), kc.to(_dev(device)), k).cpu()
    ref = topk_gather_dot_reference(q, kc, k)
    assert torch.equal(got, ref) and ((got != 0).sum(-1) == k).all()


@pytest.mark.parametrize("device", DEVICES)
def test_triton_float16(device):
    q, kc = _inputs((2, 3, 3, 2, 64, 70))
    got = topk_gather_dot(q.half().to(_dev(device)), kc.half().to(_dev(device)), 32).cpu()
    ref = topk_gather_dot_reference(q.half().float(), kc.half().float(), 32)
    assert got.dtype == torch.float16
    assert (got.float() - ref).abs().max() <= 2e-3 * ref.abs().max()


def test_bad_input_is_refused():
    q, kc = _inputs((1, 2, 1, 1, 8, 3))
    with pytest.raises(ValueError, match=r"k must be in \[1, r=8\]"):
        topk_gather_dot(q, kc, 9)
    with pytest.raises(ValueError, match="disagree"):
        topk_gather_dot(q, kc[:, :, :6], 4)


def test_block_sizes():
    assert block_sizes(64, 16384) == (64, 128)
    assert block_sizes(48, 5) == (64, 16)
    assert block_sizes(8, 7) == (8, 16)


def test_gpu_present_or_reason():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine: the kernel ran in Triton's CPU interpreter only")
    q, kc = _inputs((2, 3, 3, 1, 64, 4096))
    got = topk_gather_dot(q.cuda(), kc.cuda(), 32).cpu()
    assert (got - topk_gather_dot_reference(q, kc, 32)).abs().max() <= 1e-4
