"""H2OAttention beyond its catalogue cases (op_catalogue.py), on every implementation (implementations.py): a T-token
forward against T one-token forwards, continuing from a state that already evicted, decode over a long scattered
past, buffers updated in place; and the rules' budget and slot count.

Tolerances as the catalogue's: float32 outputs 1e-5 (heavy sums relative to their size), token buffers (the
eviction decisions) identical.
"""

import numpy as np
import pytest
import torch
from helpers import H2O_MASKS, h2o_inputs, h2o_token_by_token
from implementations import IMPLEMENTATIONS

from aqua_export.ops import h2o_attention, rules
from aqua_export.ops.spec import GROUP

H2O = h2o_attention.OP
NAMES = [n for n, impl in IMPLEMENTATIONS.items() if impl.supports(H2O)]


def _impl(name):
    impl = IMPLEMENTATIONS[name]
    if impl.unavailable():
        pytest.skip(impl.unavailable())
    return impl


def _run(name, ins, **attrs):
    return _impl(name).run(H2O, ins, False, "float32", attrs)


def _check(got, want, tol=1e-5):
    for name, a, e in zip(H2O.output_names, got, want):
        assert tuple(a.shape) == tuple(e.shape), name
        if name == "present_token":
            assert torch.equal(a, e), name
        else:
            scale = max(1.0, e.abs().max().item()) if name == "present_heavy" else 1.0
            assert (a.double() - e.double()).abs().max() <= tol * scale, name


@pytest.mark.parametrize("name", NAMES)
def test_a_prompt_in_one_forward_evicts_as_token_by_token(name):
    """A T-token forward reproduces T one-token forwards exactly (same slots, same heavy sums, same outputs),
    then decoding continues from either state alike."""
    ins = h2o_inputs(2, 2, 3, 24, 16, H2O_MASKS["padded"])
    whole = _run(name, ins, k=8, rule=GROUP, ratio=0.5)
    out, state = h2o_token_by_token(lambda one: _run(name, one, k=8, rule=GROUP, ratio=0.5), ins, whole[1].shape[2])
    assert torch.equal(out, whole[0])
    for a, b in zip(whole[1:], state):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_continuing_from_a_past(name):
    """A chunk of 5 from a state that already evicted, against the reference."""
    m = H2O_MASKS["padded"]
    state = _run(name, h2o_inputs(2, 2, 3, 19, 16, m[:, :19]), k=8, ratio=0.5)[1:]
    nxt = h2o_inputs(2, 2, 3, 5, 16, m, past=state, seed=1)
    _check(_run(name, nxt, k=8, ratio=0.5), H2O.reference(*nxt, k=8, ratio=0.5))


# Triton over 1,024 slots takes minutes in the CPU interpreter: there on a GPU only (as the catalogue's large cases)
@pytest.mark.parametrize("name", [n for n in NAMES if n != "triton" or torch.cuda.is_available()])
def test_decode_over_a_long_scattered_past(name):
    """Decode at batch 1 over 1,024 slots (the native kernel splits each row's slots over tasks there): live slots
    scattered with holes and a wholly free block; the first step exceeds the budget (a slot is evicted), the second
    does not."""
    b, hkv, cap, r, n = 1, 2, 1024, 16, 1001  # n real tokens seen; ratio 0.5 keeps 501 and a new one evicts
    gen = torch.Generator().manual_seed(3)
    token = torch.full((b, hkv, cap), -1, dtype=torch.int64)
    for h in range(hkv):
        slots = torch.cat([torch.arange(0, 256), torch.arange(512, cap)])  # slots 256..511 stay free
        slots = slots[torch.randperm(len(slots), generator=gen)[:501]]
        token[0, h, slots] = torch.randperm(n, generator=gen)[:501].sort().values
    live = token >= 0
    past = [torch.randn(b, hkv, cap, r, generator=gen) * live[..., None], torch.randn(b, hkv, cap, r, generator=gen),
            torch.rand(b, hkv, cap, generator=gen) * live, token]
    for step in range(2):
        ins = h2o_inputs(b, hkv, 3, 1, r, np.ones((b, n + 1 + step), np.int64), past=past, seed=step)
        got = _run(name, ins, k=6, rule=GROUP, ratio=0.5)
        _check(got, H2O.reference(*ins, k=6, rule=GROUP, ratio=0.5))
        assert ((got[4] >= 0).sum(-1) == [501, 502][step]).all()  # one in and one out, then the budget grows
        past = [x.clone() for x in got[1:]]


def test_native_updates_bound_buffers_in_place():
    """Buffers with room for the new tokens, bound as both past and present, are written where they are."""
    import onnxruntime as ort

    impl = _impl("native")
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m)
    attrs = {"k": 8, "ratio": 0.5}
    want = [x.numpy() for x in impl.run(H2O, ins, False, "float32", attrs)]
    sess = impl.session(H2O, "float32", False, attrs)
    cap = 32  # more than needed (12)
    bufs = [np.zeros((2, 2, cap, 16), np.float32), np.zeros((2, 2, cap, 16), np.float32),
            np.zeros((2, 2, cap), np.float32), np.full((2, 2, cap), -1, np.int64)]
    io = sess.io_binding()
    for n, x in zip(H2O.input_names[:3], ins[:3]):
        io.bind_cpu_input(n, x.numpy())
    io.bind_cpu_input("attention_mask", m)
    io.bind_output("out")
    for past, present, a in zip(H2O.input_names[3:7], H2O.output_names[1:], bufs):
        v = ort.OrtValue.ortvalue_from_numpy(a)
        io.bind_ortvalue_input(past, v)
        io.bind_ortvalue_output(present, v)
    sess.run_with_iobinding(io)
    assert np.array_equal(io.get_outputs()[0].numpy(), want[0])
    c = want[1].shape[2]
    assert np.array_equal(bufs[3][..., :c], want[4]) and (bufs[3][..., c:] == -1).all()
    assert np.array_equal(bufs[2][..., :c], want[3])
    assert np.array_equal(bufs[1][:, :, :c], want[2])
    assert np.array_equal(bufs[0].reshape(2, 2, 16, cap)[..., :c], want[1].reshape(2, 2, 16, c))


def test_triton_continues_from_a_past_in_place():
    """A chunk of 5 from a state that already evicted, in buffers with room to spare: written where they are."""
    _impl("triton")
    from aqua_export.kernels.triton.h2o_attention import h2o_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = H2O_MASKS["padded"]
    state = _run("triton", h2o_inputs(2, 2, 3, 19, 16, m[:, :19]), k=8, ratio=0.5)[1:]
    cap = 16
    bufs = [torch.zeros(2, 2, 16, cap), torch.zeros(2, 2, cap, 16), torch.zeros(2, 2, cap),
            torch.full((2, 2, cap), -1, dtype=torch.int64)]
    c = state[0].shape[2]  # widen by hand: keys dim-major
    bufs[0][..., :c] = state[0].reshape(2, 2, 16, c)
    bufs[0] = bufs[0].reshape(2, 2, cap, 16)
    bufs[1][:, :, :c], bufs[2][..., :c], bufs[3][..., :c] = state[1], state[2], state[3]
    nxt = h2o_inputs(2, 2, 3, 5, 16, m, past=[b.clone() for b in bufs], seed=1)
    bufs = [b.to(dev) for b in bufs]
    got = h2o_attention(*[x.to(dev) for x in nxt[:3]], *bufs, nxt[7].to(dev), k=8, ratio=0.5)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got[1:], bufs))
    _check([x.cpu() for x in got], H2O.reference(*nxt, k=8, ratio=0.5))


def test_budget_and_slots_needed():
    """rules.budget on numpy and torch alike; slots_needed bounds the live slots of any run (one token in, at most
    one out, per real token)."""
    n = np.array([1, 2, 3, 7, 100])
    assert rules.budget(0.5, n).tolist() == rules.budget(0.5, torch.from_numpy(n)).tolist() == [1, 1, 2, 4, 50]
    for ratio in (0.1, 0.3, 0.5, 0.9, 1.0):
        live = peak = 0
        for seen in range(1, 300):
            live += 1
            peak = max(peak, live)
            assert peak <= rules.slots_needed(ratio, [seen])
            live = min(live, int(rules.budget(ratio, seen)))
    assert rules.slots_needed(0.5, [11, 6]) == 7 and rules.slots_needed(0.5, []) == 0
