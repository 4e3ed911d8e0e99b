"""Every custom op, every implementation, one catalogue (op_catalogue.py): each case against the op's float64
reference within the tolerance of its dtype, bad inputs refused by the implementations that validate, the golden
tie-breaks and budgets reproduced everywhere, and each native kernel proven to run (not its function body)."""

import json

import numpy as np
import pytest
import torch
from implementations import IMPLEMENTATIONS, VALIDATING
from op_catalogue import BUDGET_GOLDEN, CATALOGUE, SELECTION_GOLDEN

from aqua_export.contract import Contract
from aqua_export.ops import cache_update, h2o_attention, rules, topk_gather_dot
from aqua_export.ops.catalogue import OPS
from aqua_export.ops.spec import GROUP, MAGNITUDE, RULE_NAMES
from aqua_export.runtime.session import make_session, native_library

INTERPRETED = not torch.cuda.is_available()


def _pairs():
    for entry in CATALOGUE:
        for case in entry.cases:
            for name, impl in IMPLEMENTATIONS.items():
                if not impl.supports(entry.op) or (case.only and name not in case.only):
                    continue
                if case.error and name not in VALIDATING:
                    continue
                if name == "triton" and case.large and INTERPRETED:
                    continue  # sized for compiled kernels: the interpreter runs the small cases of the same grid
                yield pytest.param(entry, case, name, id=f"{entry.op.name}-{case.id}-{name}")


def _impl(name):
    impl = IMPLEMENTATIONS[name]
    reason = impl.unavailable()
    if reason:
        pytest.skip(reason)
    return impl


def _widened(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _compare(entry, case, got, want):
    tol = entry.tolerance[case.dtype]
    for port, a, e in zip(entry.op.outputs, got, want):
        if port.name not in tol and "*" not in tol:
            continue
        assert tuple(a.shape) == tuple(e.shape), port.name
        if port.name in entry.int_outputs:
            assert torch.equal(a, e), port.name
            continue
        bound, relative = tol.get(port.name, tol.get("*"))
        scale = max(1.0, e.abs().max().item()) if relative and e.numel() else 1.0
        err = (a.double() - e.double()).abs().max().item() if e.numel() else 0.0
        assert err <= bound * scale, f"{port.name}: {err:.2e} > {bound * scale:.2e}"


@pytest.mark.parametrize("entry,case,name", list(_pairs()))
def test_op_matches_reference(entry, case, name):
    impl = _impl(name)
    ins = case.inputs()
    if case.error:
        with pytest.raises(Exception, match=case.error):
            impl.run(entry.op, ins, case.projected, case.dtype, case.attrs, case.cache_dtype)
        return
    got = impl.run(entry.op, ins, case.projected, case.dtype, case.attrs, case.cache_dtype)
    if case.versus_reference:
        want = entry.op.reference(*[_widened(x) for x in ins], **case.attrs)
        _compare(entry, case, got, want if isinstance(want, (tuple, list)) else (want,))
    if case.unlike is not None:  # the answer of a case the op must not compute (P not applied, no soft-cap)
        assert (got[0].double() - case.unlike(ins).double()).abs().max() > 1e-2
    if case.check is not None:
        case.check(got, ins)


def _implementations_of(op):
    return [n for n, impl in IMPLEMENTATIONS.items() if impl.supports(op)]


@pytest.mark.parametrize("name", _implementations_of(topk_gather_dot.OP))
@pytest.mark.parametrize("rows,k,rule,kept", SELECTION_GOLDEN, ids=range(len(SELECTION_GOLDEN)))
def test_selection_golden(rows, k, rule, kept, name):
    """Golden rows' kept coordinates: the reference rule's, and every implementation's TopKGatherDot scores over an
    identity key cache (score c = q^_c where c is kept, else 0: a coordinate kept wrongly shows its value)."""
    impl = _impl(name)
    q = torch.tensor(rows, dtype=torch.float32)[None, None, :, None, :]  # [1, 1, g, 1, r]
    r = q.shape[-1]
    keys = torch.eye(r)[None, None].contiguous()
    scores = impl.run(topk_gather_dot.OP, [q, keys, torch.tensor([r])], False, "float32", {"k": k, "rule": rule})[0]
    idx = rules.select_indices(q, k, RULE_NAMES[rule])[0, 0, :, 0].sort(-1).values.tolist()
    assert idx == kept
    assert torch.equal(scores[0, 0, :, 0], rules.keep_selected(q, k, rule)[0, 0, :, 0])


@pytest.mark.parametrize("name", _implementations_of(h2o_attention.OP))
@pytest.mark.parametrize("ratio,n,kept", BUDGET_GOLDEN, ids=[f"{r}-{n}" for r, n, _ in BUDGET_GOLDEN])
def test_budget_golden(ratio, n, kept, name):
    """After a prompt of n real tokens every KV head keeps budget(ratio, n) of them, with the ratio as the node's
    float32 attribute; the reference rule gives the same."""
    from helpers import h2o_inputs

    assert int(rules.budget(ratio, n)) == kept
    impl = _impl(name)
    ins = h2o_inputs(1, 1, 1, n, 8, np.ones((1, n), np.int64))
    out = impl.run(h2o_attention.OP, ins, False, "float32", {"k": 4, "ratio": ratio})
    assert ((out[4] >= 0).sum(-1) == kept).all()


@pytest.mark.parametrize("kernel", ["function", "native"])
@pytest.mark.parametrize("op", [cache_update.KEY, cache_update.VALUE], ids=lambda op: op.name)
def test_cache_update_ops_in_place_and_growing(op, kernel):
    """Both genai buffer modes: a past of C >= L slots (written in place when bound to present) and a past of
    L - S slots (present grows to L). The function body and the native kernel give the same buffers."""
    import onnxruntime as ort

    sess = _impl(kernel).session(op, "float32", False, {})
    rng = np.random.default_rng(0)
    b, h, r, s, p = 2, 3, 5, 2, 4

    new = rng.standard_normal((b, h, s, r), dtype=np.float32)
    # growing: past of p slots -> present of p + s
    past = rng.standard_normal((b, h, p, r), dtype=np.float32)
    got = sess.run(None, {"past": past, "new": new, "total_length": np.array([p + s])})[0]
    assert got.shape == (b, h, p + s, r)
    if op is cache_update.KEY:
        want = np.concatenate([Contract.key_rows(past), new.transpose(0, 1, 3, 2)], axis=3)
        assert np.array_equal(Contract.key_rows(got), want)
    else:
        assert np.array_equal(got, np.concatenate([past, new], axis=2))
    # shared: one buffer of 16 slots bound as past and present; slots p.. p+s-1 written, the rest untouched
    cap = 16
    buf = rng.standard_normal((b, h, cap, r), dtype=np.float32)
    before = buf.copy()
    ov = ort.OrtValue.ortvalue_from_numpy(buf)
    io = sess.io_binding()
    io.bind_ortvalue_input("past", ov)
    io.bind_cpu_input("new", new)
    io.bind_cpu_input("total_length", np.array([p + s]))
    io.bind_ortvalue_output("present", ov)
    sess.run_with_iobinding(io)
    view, old = (Contract.key_rows(buf), Contract.key_rows(before)) if op is cache_update.KEY else (buf, before)
    fresh = new.transpose(0, 1, 3, 2) if op is cache_update.KEY else new
    ax = 3 if op is cache_update.KEY else 2
    sl = [slice(None)] * 4
    sl[ax] = slice(p, p + s)
    assert np.array_equal(view[tuple(sl)], fresh)
    sl[ax] = slice(0, p)
    assert np.array_equal(view[tuple(sl)], old[tuple(sl)])
    if kernel == "native":  # in place: the slots past L are not touched (the body re-pads them with zeros)
        sl[ax] = slice(p + s, cap)
        assert np.array_equal(view[tuple(sl)], old[tuple(sl)])
    if kernel == "native":  # the kernel refuses L - S beyond the past's slots (the body's Slice would clamp)
        with pytest.raises(Exception, match="total_length - new tokens"):
            sess.run(None, {"past": past, "new": new, "total_length": np.array([p + s + 3])})


def test_group_rule_shares_one_selection():
    """Rule 1 keeps one set per (batch, KV head, token): with an identity key cache the scores are q^[I] itself, so
    every query head of a group has nonzero scores on the same coordinates (and per-head selections differ)."""
    from helpers import attention_inputs

    q = attention_inputs((2, 2, 3, 2, 8, 8, 8))[0]
    keys = torch.eye(8).expand(2, 2, 8, 8)
    kept = topk_gather_dot.reference(q, keys, k=3, rule=GROUP) != 0
    assert (kept == kept[:, :, :1]).all() and (kept.sum(-1) == 3).all()
    own = topk_gather_dot.reference(q, keys, k=3, rule=MAGNITUDE) != 0
    assert not (own == own[:, :, :1]).all()


@pytest.mark.skipif(native_library() is None, reason="native kernel not built (run `make plugin`)")
@pytest.mark.parametrize("op,cache_dtype", [(op, None) for op in OPS] +
                         [(op, c) for op in OPS if any(p.type == "C" for p in op.inputs) for c in ("float16", "int8")
                          if op.name != "TopKGatherDot" or c == "float16"],
                         ids=lambda x: getattr(x, "name", x))
def test_native_kernel_runs_not_the_body(op, cache_dtype, tmp_path):
    """Profiling shows each op's node ran as the library's kernel (a library missing an op, or the op at a type pair,
    would silently run its function body instead), float16 and int8 caches under a float32 query too."""
    import onnxruntime as ort

    entry = next(e for e in CATALOGUE if e.op is op)
    case = next(c for c in entry.cases if not c.error and not c.projected and c.dtype == "float32"
                and c.cache_dtype == cache_dtype)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / op.name)
    so.register_custom_ops_library(str(native_library()))
    sess = ort.InferenceSession(op.model(cache_dtype=cache_dtype, **case.attrs).SerializeToString(), so)
    ins = case.inputs()
    sess.run(None, {n: x.numpy() for n, x in zip(op.input_names, ins)})
    ran = {e["args"].get("op_name") for e in json.load(open(sess.end_profiling())) if e.get("cat") == "Node"}
    assert ran == {op.name}, ran


def test_library_built_against_an_older_c_api_loads_in_this_runtime():
    """docs/design.md, Build facts: the headers (Debian, API 21) are older than the wheel; the versioned C API loads them."""
    import ctypes

    import onnxruntime as ort

    if native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    api = ctypes.CDLL(str(native_library())).AquaOrtApiVersion
    api.restype = ctypes.c_uint32
    built = api()
    runtime_minor = int(ort.__version__.split(".")[1])
    assert 1 <= built <= runtime_minor, (built, ort.__version__)


def test_every_op_has_a_catalogue_entry_and_a_valid_schema():
    """The catalogue covers the ops a graph carries; each one-node model passes ONNX's checker."""
    import onnx

    assert [e.op for e in CATALOGUE] == list(OPS)
    for op in OPS:
        onnx.checker.check_model(op.model(**next(c.attrs for c in next(e for e in CATALOGUE if e.op is op).cases)))


def test_a_session_of_each_op_loads_on_function_bodies_alone():
    """Without the native library every op's model still runs (its function body)."""
    for entry in CATALOGUE:
        case = next(c for c in entry.cases if not c.error)
        sess = make_session(entry.op.model(case.dtype, projected=case.projected, **case.attrs).SerializeToString(),
                            kernel="function")
        assert len(sess.get_outputs()) == len(entry.op.outputs)


def test_matmul_q4a8_packs_again_for_other_weights():
    """The native MatMulQ4A8 packs its weights on a node's first run: a second run fed other weight buffers (a model
    whose weights are inputs, not initializers) must be answered with those, not the first run's packing."""
    from op_catalogue import _q4a8_inputs

    from aqua_export.ops import matmul_q4a8

    if native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    attrs = {"K": 64, "N": 32, "block_size": 32}
    sess = make_session(matmul_q4a8.OP.model("float32", **attrs).SerializeToString(), kernel="native")
    for seed in (0, 1):
        a, b, scales = _q4a8_inputs((1, 6), 64, 32, 32, seed=seed)
        got = sess.run(None, {"a": a.numpy(), "b": b.numpy(), "scales": scales.numpy()})[0]
        want = matmul_q4a8.OP.reference(a.double(), b, scales.double(), **attrs).numpy()
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), seed
