"""H2OAttention op by op: the native kernel and the portable function body against the slot-level reference
(h2o.reference), a T-token forward against T one-token forwards, in-place updates of bound buffers, bad input.

Tolerances: float32 outputs 1e-5 and heavy sums 1e-5 (float32 sums of softmax weights against float64);
float16 outputs 2e-2 (its rounding of q^, K^, V). Token buffers (the eviction decisions) must be identical.
"""

import numpy as np
import pytest
import torch

from aqua_export import attention, h2o
from aqua_export.runtime import make_session, native_library
from helpers import H2O_MASKS, h2o_inputs, h2o_token_by_token, random_projection

KERNELS = ["function", "native"]


def _session(tmp_path, kernel, **attrs):
    import onnx

    if kernel == "native" and native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    path = tmp_path / f"h2o-{kernel}.onnx"
    onnx.save(h2o.op_model(**attrs), path)
    return make_session(path, 1, kernel)


def _feed(ins):
    return {n: x.numpy() for n, x in zip(h2o.INPUTS, ins)}


def _check(got, want, tol):
    for name, a, e in zip(h2o.OUTPUTS, got, want):
        e = e.numpy()
        assert a.shape == e.shape, name
        if name == "present_token":
            assert np.array_equal(a, e), name
        else:
            assert np.abs(a.astype(np.float64) - e.astype(np.float64)).max() <= tol, name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rule,k", [(0, 8), (1, 8), (2, 8), (0, 16), (0, 1)])
@pytest.mark.parametrize("mask", sorted(H2O_MASKS))
def test_op_equals_reference(tmp_path, kernel, rule, k, mask):
    m = H2O_MASKS[mask]
    ins = h2o_inputs(m.shape[0], 2, 3, m.shape[1], 16, m)
    want = h2o.reference(*ins, k=k, rule=rule, ratio=0.5)
    got = _session(tmp_path, kernel, k=k, rule=rule, ratio=0.5).run(None, _feed(ins))
    _check(got, want, 1e-5)
    # 0.5 of the real tokens kept per head: 12 of 24, 11 of 21, 11 of 22
    live = (got[4] >= 0).sum(-1)
    assert live.tolist() == [[12, 12]] if mask == "full" else [[11, 11], [11, 11]]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rv", [8, 24])
def test_values_narrower_or_wider_than_the_keys(tmp_path, kernel, rv):
    """AQUA-Memory may cache V at its own width: out and present_value are rv wide."""
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m, rv=rv)
    got = _session(tmp_path, kernel, k=8, rule=1, ratio=0.5).run(None, _feed(ins))
    assert got[0].shape[-1] == rv and got[2].shape[-1] == rv and got[1].shape[-1] == 16
    _check(got, h2o.reference(*ins, k=8, rule=1, ratio=0.5), 1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_softcap_ratio_and_float16(tmp_path, kernel):
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 2, 24, 16, m)
    _check(_session(tmp_path, kernel, k=6, softcap=2.0, ratio=0.3).run(None, _feed(ins)),
           h2o.reference(*ins, k=6, softcap=2.0, ratio=0.3), 1e-5)
    ins16 = h2o_inputs(2, 2, 2, 24, 16, m, dtype=torch.float16)
    got = _session(tmp_path, kernel, k=6, ratio=0.5, dtype="float16").run(None, _feed(ins16))
    want = h2o.reference(*ins16, k=6, ratio=0.5)
    assert got[0].dtype == np.float16 and np.abs(got[0].astype(np.float64) - want[0].double().numpy()).max() <= 2e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_prompt_in_one_forward_evicts_as_token_by_token(tmp_path, kernel):
    """A T-token forward reproduces T one-token forwards exactly (same slots, same heavy sums, same outputs),
    then decoding continues from either state alike."""
    sess = _session(tmp_path, kernel, k=8, rule=1, ratio=0.5)
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m)
    whole = sess.run(None, _feed(ins))
    out, state = h2o_token_by_token(lambda one: [torch.from_numpy(a) for a in sess.run(None, _feed(one))], ins,
                                    whole[1].shape[2])
    assert np.array_equal(out.numpy(), whole[0])
    for a, b in zip(whole[1:], state):
        assert np.array_equal(a, b.numpy())


@pytest.mark.parametrize("kernel", KERNELS)
def test_continuing_from_a_past(tmp_path, kernel):
    """A decode step and a chunk of 5 from a state that already evicted, against the reference."""
    sess = _session(tmp_path, kernel, k=8, ratio=0.5)
    m = H2O_MASKS["padded"]
    first = h2o_inputs(2, 2, 3, 19, 16, m[:, :19])
    state = [torch.from_numpy(a) for a in sess.run(None, _feed(first))[1:]]
    nxt = h2o_inputs(2, 2, 3, 5, 16, m, past=state, seed=1)
    _check(sess.run(None, _feed(nxt)), h2o.reference(*nxt, k=8, ratio=0.5), 1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_over_a_long_scattered_past(tmp_path, kernel):
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
    sess = _session(tmp_path, kernel, k=6, rule=1, ratio=0.5)
    for step in range(2):
        ins = h2o_inputs(b, hkv, 3, 1, r, np.ones((b, n + 1 + step), np.int64), past=past, seed=step)
        got = sess.run(None, _feed(ins))
        _check(got, h2o.reference(*ins, k=6, rule=1, ratio=0.5), 1e-5)
        assert ((got[4] >= 0).sum(-1) == [501, 502][step]).all()  # one in and one out, then the budget grows
        past = [torch.from_numpy(a) for a in got[1:]]


def _projected(ins, d, seed=2):
    """ins with q [B,Hkv,g,T,d] in place of q^ and P [Hkv, d, r] (r = the keys' width; r < d: a sliced P)."""
    b, hkv, g, t, r = ins[0].shape
    q = torch.randn(b, hkv, g, t, d, generator=torch.Generator().manual_seed(seed)).to(ins[0].dtype)
    return [q] + ins[1:], random_projection(hkv, d, r).to(ins[0].dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rule,d", [(0, 16), (1, 16), (1, 24)])
def test_the_node_projects_the_query(tmp_path, kernel, rule, d):
    """With the optional ninth input P [Hkv, d, r] the node takes q and computes q^ = q P itself (decode and a
    prompt, padded rows), equal to the reference given q and P."""
    m = H2O_MASKS["padded"]
    ins, P = _projected(h2o_inputs(2, 2, 3, 24, 16, m), d)
    sess = _session(tmp_path, kernel, k=6, rule=rule, ratio=0.5, projected=True)
    got = sess.run(None, {**_feed(ins), h2o.PROJECTION: P.numpy()})
    want = h2o.reference(*ins, k=6, rule=rule, ratio=0.5, projection=P)
    _check(got, want, 1e-5)
    unprojected = h2o.reference(*[ins[0][..., :16]] + ins[1:], k=6, rule=rule, ratio=0.5)
    assert np.abs(got[0] - unprojected[0].numpy()).max() > 1e-2  # P was applied: the test can fail
    ins16, P16 = _projected(h2o_inputs(2, 2, 3, 24, 16, m, dtype=torch.float16), d)
    got = _session(tmp_path, kernel, k=6, rule=rule, ratio=0.5, dtype="float16", projected=True).run(
        None, {**_feed(ins16), h2o.PROJECTION: P16.numpy()})
    want = h2o.reference(*ins16, k=6, rule=rule, ratio=0.5, projection=P16)
    assert np.abs(got[0].astype(np.float64) - want[0].double().numpy()).max() <= 2e-2


def test_native_rejects_a_projection_of_the_wrong_shape(tmp_path):
    m = H2O_MASKS["padded"]
    ins, _ = _projected(h2o_inputs(2, 2, 3, 24, 16, m), 16)
    sess = _session(tmp_path, "native", k=6, ratio=0.5, projected=True)
    for bad in (random_projection(3, 16, 16), random_projection(2, 24, 16), random_projection(2, 16, 8)):  # Hkv, d, r
        with pytest.raises(Exception, match="projection must be"):
            sess.run(None, {**_feed(ins), h2o.PROJECTION: bad.numpy()})


def test_native_updates_bound_buffers_in_place(tmp_path):
    """Buffers with room for the new tokens, bound as both past and present, are written where they are."""
    import onnxruntime as ort

    sess = _session(tmp_path, "native", k=8, ratio=0.5)
    m = H2O_MASKS["padded"]
    ins = h2o_inputs(2, 2, 3, 24, 16, m)
    want = sess.run(None, _feed(ins))
    cap = 32  # more than needed (12)
    bufs = [np.zeros((2, 2, cap, 16), np.float32), np.zeros((2, 2, cap, 16), np.float32),
            np.zeros((2, 2, cap), np.float32), np.full((2, 2, cap), -1, np.int64)]
    io = sess.io_binding()
    for n, x in zip(h2o.INPUTS[:3], ins[:3]):
        io.bind_cpu_input(n, x.numpy())
    io.bind_cpu_input("attention_mask", m)
    io.bind_output("out")
    for past, present, a in zip(h2o.INPUTS[3:7], h2o.OUTPUTS[1:], bufs):
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


def test_native_refuses_a_state_that_is_not_its_own(tmp_path):
    sess = _session(tmp_path, "native", k=8, ratio=0.5)
    m = np.ones((1, 10), np.int64)
    # 9 tokens seen, budget 5, but 7 live slots: not a state this op could have left
    token = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, -1], [0, 1, 2, -1, -1, -1, -1, -1]]])
    past = (torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8), token)
    with pytest.raises(Exception, match="not this graph's state"):
        sess.run(None, _feed(h2o_inputs(1, 2, 3, 1, 16, m, past=past)))
    with pytest.raises(Exception, match="disagree"):
        bad = h2o_inputs(1, 2, 3, 1, 16, m)
        bad[1] = torch.zeros(1, 2, 1, 8)  # key_new narrower than q^
        sess.run(None, _feed(bad))
    with pytest.raises(Exception, match="ratio in"):
        _session(tmp_path, "native", k=8, ratio=1.5).run(None, _feed(h2o_inputs(1, 2, 3, 1, 16, m[:, :1])))


def test_budget_and_slots_needed():
    """h2o.budget is attention.h2o_budget; slots_needed bounds the live slots of any run (one token in, at most
    one out, per real token)."""
    n = np.array([1, 2, 3, 7, 100])
    assert h2o.budget(0.5, n).tolist() == attention.h2o_budget(0.5, torch.from_numpy(n)).tolist() == [1, 1, 2, 4, 50]
    for ratio in (0.1, 0.3, 0.5, 0.9, 1.0):
        live = peak = 0
        for seen in range(1, 300):
            live += 1
            peak = max(peak, live)
            assert peak <= h2o.slots_needed(ratio, [seen])
            live = min(live, int(h2o.budget(ratio, seen)))
    assert h2o.slots_needed(0.5, [11, 6]) == 7 and h2o.slots_needed(0.5, []) == 0
