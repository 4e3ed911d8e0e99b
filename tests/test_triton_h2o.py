"""The Triton GPU kernel of H2OAttention against the slot-level reference (h2o.reference): on the GPU when there
is one, otherwise the same kernel in Triton's CPU interpreter. The cases are test_h2o.py's (the CPU kernel's).

Tolerances as test_h2o.py: float32 outputs and heavy sums 1e-5, float16 outputs 2e-2; token buffers (the
eviction decisions) identical.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported: every kernel here is interpreted
pytest.importorskip("triton", reason="triton is not installed (it comes with `pip install -e .[test]`)")

from aqua_export import h2o  # noqa: E402
from aqua_export.triton_h2o import block_s, h2o_attention  # noqa: E402
from helpers import H2O_MASKS, h2o_inputs, h2o_token_by_token, random_projection  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(ins, **attrs):
    got = h2o_attention(*[x.to(DEV) for x in ins], **attrs)
    return [x.cpu() for x in got]


def _check(got, want, tol):
    for name, a, e in zip(h2o.OUTPUTS, got, want):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        if name == "present_token":
            assert torch.equal(a, e), name
        else:
            assert (a.double() - e.double()).abs().max() <= tol, name


@pytest.mark.parametrize("rule,k", [(0, 8), (1, 8), (2, 8), (0, 1), (0, 16)])
@pytest.mark.parametrize("mask", sorted(H2O_MASKS))
def test_triton_h2o_equals_reference(rule, k, mask):
    m = H2O_MASKS[mask]
    ins = h2o_inputs(m.shape[0], 2, 3, m.shape[1], 16, m)
    got = _run(ins, k=k, rule=rule, ratio=0.5)
    _check(got, h2o.reference(*ins, k=k, rule=rule, ratio=0.5), 1e-5)
    live = (got[4] >= 0).sum(-1)
    assert live.tolist() == ([[12, 12]] if mask == "full" else [[11, 11], [11, 11]])


def test_triton_h2o_softcap_ratio_float16_and_several_blocks():
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 2, 24, 16, m)
    _check(_run(ins, k=6, softcap=2.0, ratio=0.3), h2o.reference(*ins, k=6, softcap=2.0, ratio=0.3), 1e-5)
    ins16 = h2o_inputs(2, 2, 2, 24, 16, m, dtype=torch.float16)
    got, want = _run(ins16, k=6, ratio=0.5), h2o.reference(*ins16, k=6, ratio=0.5)
    assert got[0].dtype == torch.float16 and (got[0].double() - want[0].double()).abs().max() <= 2e-2
    # r = 64, g = 4: 32 slots per block, so a 40-slot cache spans two blocks of every pass
    assert block_s(4, 64, 40) == 32
    m40 = torch.ones(1, 80, dtype=torch.int64)
    ins = h2o_inputs(1, 1, 4, 80, 64, m40)
    got = _run(ins, k=48, rule=1, ratio=0.5)
    assert got[1].shape[2] == 41
    _check(got, h2o.reference(*ins, k=48, rule=1, ratio=0.5), 1e-5)


@pytest.mark.parametrize("rv", [8, 24])
def test_triton_h2o_values_of_their_own_width(rv):
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m, rv=rv)
    got = _run(ins, k=8, rule=1, ratio=0.5)
    assert got[0].shape[-1] == rv and got[2].shape[-1] == rv
    _check(got, h2o.reference(*ins, k=8, rule=1, ratio=0.5), 1e-5)


def test_triton_h2o_prompt_in_one_forward_evicts_as_token_by_token():
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m)
    whole = _run(ins, k=8, rule=1, ratio=0.5)
    out, state = h2o_token_by_token(lambda one: _run(one, k=8, rule=1, ratio=0.5), ins, whole[1].shape[2])
    assert torch.equal(out, whole[0])
    for a, b in zip(whole[1:], state):
        assert torch.equal(a, b)


def test_triton_h2o_continues_from_a_past_in_place():
    """A chunk of 5 from a state that already evicted, in buffers with room to spare: written where they are."""
    m = H2O_MASKS["padded"]
    first = h2o_inputs(2, 2, 3, 19, 16, m[:, :19])
    state = _run(first, k=8, ratio=0.5)[1:]
    cap = 16
    bufs = [torch.zeros(2, 2, 16, cap), torch.zeros(2, 2, cap, 16), torch.zeros(2, 2, cap),
            torch.full((2, 2, cap), -1, dtype=torch.int64)]
    c = state[0].shape[2]  # widen by hand: keys dim-major
    bufs[0][..., :c] = state[0].reshape(2, 2, 16, c)
    bufs[0] = bufs[0].reshape(2, 2, cap, 16)
    bufs[1][:, :, :c], bufs[2][..., :c], bufs[3][..., :c] = state[1], state[2], state[3]
    nxt = h2o_inputs(2, 2, 3, 5, 16, m, past=[b.clone() for b in bufs], seed=1)
    bufs = [b.to(DEV) for b in bufs]
    got = h2o_attention(*[x.to(DEV) for x in nxt[:3]], *bufs, nxt[7].to(DEV), k=8, ratio=0.5)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got[1:], bufs))
    _check([x.cpu() for x in got], h2o.reference(*nxt, k=8, ratio=0.5), 1e-5)


def test_triton_h2o_refuses_bad_input():
    m = H2O_MASKS["full"]
    ins = h2o_inputs(1, 2, 3, 24, 16, m)
    with pytest.raises(ValueError, match=r"k must be in \[1, r=16\]"):
        h2o_attention(*ins, k=17)
    with pytest.raises(ValueError, match="ratio in"):
        h2o_attention(*ins, k=8, ratio=1.5)
    with pytest.raises(ValueError, match="disagree"):
        h2o_attention(ins[0], ins[1][:, :, :3], *ins[2:], k=8)
    # a past that holds more live tokens than any run of this ratio could leave: 10 live after 12 tokens at 0.5
    past = [torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 10),
            torch.arange(10).expand(1, 2, 10).contiguous()]
    bad = h2o_inputs(1, 2, 3, 1, 16, torch.ones(1, 13, dtype=torch.int64), past=past)
    with pytest.raises(ValueError, match="not this graph's state"):
        h2o_attention(*bad, k=8)


@pytest.mark.parametrize("d", [16, 24])
def test_triton_h2o_projects_the_query(d):
    """projection P [Hkv, d, r]: q [B,Hkv,g,T,d] projected (q^ = q P) before the kernel; against the reference
    given q and P, and a projection of the wrong shape refused."""
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m)
    ins[0] = torch.randn(2, 2, 3, 24, d, generator=torch.Generator().manual_seed(2))
    P = random_projection(2, d, 16)
    got = _run(ins, k=6, rule=1, ratio=0.5, projection=P.to(DEV))
    _check(got, h2o.reference(*ins, k=6, rule=1, ratio=0.5, projection=P), 1e-5)
    with pytest.raises(ValueError, match="projection must be"):
        _run(ins, k=6, ratio=0.5, projection=random_projection(3, d, 16).to(DEV))
