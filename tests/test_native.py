"""The native ONNX Runtime TopKGatherDot kernel (plugins/ort) against the reference and the function body."""

import json

import numpy as np
import pytest
import torch

from aqua_export.export import single_op_model, topk_gather_dot_reference
from aqua_export.runtime import make_session, native_library

if native_library() is None:
    pytest.skip("native kernel not built (run `make plugin`): the function-body tests in test_export.py still run",
                allow_module_level=True)

# (B, Hkv, g, T, r, S): GQA groups, odd T and S, decode (T = 1), a long S crossing the kernel's 1024 block
SHAPES = [(1, 1, 1, 1, 16, 5), (2, 3, 3, 1, 64, 1031), (3, 2, 2, 5, 8, 7), (1, 2, 4, 3, 64, 2500)]


def _feed(q, kc):
    """The single-op model's inputs: every slot of the key cache filled (total_length = its last dim)."""
    return {"q": q, "kc": kc, "length": np.array([kc.shape[-1]], np.int64)}


def _inputs(shape, dtype, seed=0):
    b, hkv, g, t, r, s = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, t, r, generator=gen)
    q[0, 0, 0, 0, : min(4, r)] = 1.5  # a tie: the lower index must win, as everywhere
    q[-1, -1, -1, -1, :] = 0.25       # all coordinates tied
    kc = torch.randn(b, hkv, r, s, generator=gen)
    return q.to(dtype), kc.to(dtype)




@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("k_of_r", [1, 0.5, "r"])
@pytest.mark.parametrize("rule", [0, 1, 2])
def test_native_equals_reference_float32(shape, k_of_r, rule):
    r = shape[4]
    k = 1 if k_of_r == 1 else r if k_of_r == "r" else r // 2
    q, kc = _inputs(shape, torch.float32)
    sess = make_session(single_op_model(k, rule=rule).SerializeToString(), kernel="native")
    got = sess.run(None, _feed(q.numpy(), kc.numpy()))[0]
    ref = topk_gather_dot_reference(q.double(), kc.double(), k, rule).numpy()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("k", [1, 3, 8])
def test_native_selects_exactly_the_reference_set(k):
    """Identity key cache: score[c] = q[c] if c was kept else 0, so the kept set is read off exactly."""
    q, _ = _inputs((3, 2, 2, 5, 8, 1), torch.float32)
    kc = torch.eye(8).expand(3, 2, 8, 8).contiguous()
    sess = make_session(single_op_model(k).SerializeToString(), kernel="native")
    got = sess.run(None, _feed(q.numpy(), kc.numpy()))[0]
    ref = topk_gather_dot_reference(q, kc, k).numpy()
    assert np.array_equal(got != 0, ref != 0)
    assert np.array_equal(got, ref)
    assert ((got != 0).sum(-1) == k).all()


def test_native_float16_matches_reference():
    q, kc = _inputs((2, 3, 3, 2, 64, 300), torch.float16)
    sess = make_session(single_op_model(32, "float16").SerializeToString(), kernel="native")
    got = sess.run(None, _feed(q.numpy(), kc.numpy()))[0].astype(np.float32)
    ref = topk_gather_dot_reference(q.float(), kc.float(), 32).numpy()
    # float32 accumulation, one float16 rounding of the output: |s| <~ 30 -> 2^-11 relative
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()


def test_native_and_function_body_agree_and_native_really_runs(tmp_path):
    """Same model, once with the native kernel and once with the function body; profiling proves which ran."""
    import onnxruntime as ort

    q, kc = _inputs((2, 3, 3, 4, 64, 777), torch.float32, seed=1)
    outs = {}
    for kernel in ("native", "function"):
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / kernel)
        so.register_custom_ops_library(str(native_library())) if kernel == "native" else None
        sess = ort.InferenceSession(single_op_model(32).SerializeToString(), so)
        outs[kernel] = sess.run(None, _feed(q.numpy(), kc.numpy()))[0]
        ops = {e["args"].get("op_name") for e in json.load(open(sess.end_profiling())) if e.get("cat") == "Node"}
        assert ("TopKGatherDot" in ops) == (kernel == "native"), ops
        assert ("TopK" in ops) == (kernel == "function"), ops
    assert np.abs(outs["native"] - outs["function"]).max() <= 1e-5


@pytest.mark.parametrize("length", [0, 1, 1100])
def test_native_scores_only_the_filled_slots(length):
    """A shared buffer of C = 1500 slots with L filled: scores [.., L], equal to the reference on K^[..., :L]."""
    q, kc = _inputs((2, 3, 3, 1, 64, 1500), torch.float32, seed=2)
    sess = make_session(single_op_model(48).SerializeToString(), kernel="native")
    got = sess.run(None, {"q": q.numpy(), "kc": kc.numpy(), "length": np.array([length])})[0]
    ref = topk_gather_dot_reference(q.double(), kc[..., :length].double(), 48).numpy()
    assert got.shape == ref.shape == (2, 3, 3, 1, length)
    assert np.abs(got - ref).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref).max(initial=0))
    with pytest.raises(Exception, match="total_length must be in"):
        sess.run(None, {"q": q.numpy(), "kc": kc.numpy(), "length": np.array([1501])})


def test_native_rejects_bad_shapes():
    sess = make_session(single_op_model(4).SerializeToString(), kernel="native")
    q = np.zeros((1, 2, 1, 1, 8), np.float32)
    with pytest.raises(Exception, match="disagree on B, Hkv or r"):
        sess.run(None, _feed(q, np.zeros((1, 2, 6, 3), np.float32)))
    sess = make_session(single_op_model(9).SerializeToString(), kernel="native")
    with pytest.raises(Exception, match=r"k must be in \[1, r\]"):
        sess.run(None, _feed(q, np.zeros((1, 2, 8, 3), np.float32)))


def test_library_built_against_an_older_c_api_loads_in_this_runtime():
    """docs/design.md, Build facts: the headers (Debian, API 21) are older than the wheel; the versioned C API loads them."""
    import ctypes

    import onnxruntime as ort

    api = ctypes.CDLL(str(native_library())).AquaOrtApiVersion
    api.restype = ctypes.c_uint32
    built = api()
    runtime_minor = int(ort.__version__.split(".")[1])
    assert 1 <= built <= runtime_minor, (built, ort.__version__)


@pytest.mark.parametrize("shape", [(1, 3, 3, 1, 1024, 1100, 64), (2, 2, 2, 5, 37, 40, 48), (1, 1, 1, 7, 5, 5, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_native_value_product_reads_the_filled_slots(shape, dtype):
    """probs [B, Hkv, g, T, L] @ V[:, :, :L] of a buffer of C >= L slots; r not a multiple of the 32-column
    tile; decode (T = 1) and prefill rows. float32: 1e-5; float16: float32 accumulation, one rounding."""
    from onnx import TensorProto
    from onnx import helper as H

    from aqua_export.export import DOMAIN, VALUE_PRODUCT, _register_schema, value_product_body

    _register_schema()
    b, h, g, t, length, cap, r = shape
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    node = H.make_node(VALUE_PRODUCT, ["p", "v"], ["o"], domain=DOMAIN)
    graph = H.make_graph([node], "vp", [H.make_tensor_value_info("p", et, [None] * 5),
                                        H.make_tensor_value_info("v", et, [None] * 4)],
                         [H.make_tensor_value_info("o", et, [None] * 5)])
    model = H.make_model(graph, opset_imports=[H.make_opsetid("", 20), H.make_opsetid(DOMAIN, 1)],
                         functions=[value_product_body(20)], ir_version=10).SerializeToString()
    rng = np.random.default_rng(3)
    p = rng.random((b, h, g, t, length)).astype(dtype)
    v = rng.standard_normal((b, h, cap, r)).astype(dtype)
    ref = p.astype(np.float64) @ v[:, :, None, :length].astype(np.float64)
    got = make_session(model, kernel="native").run(None, {"p": p, "v": v})[0].astype(np.float64)
    body = make_session(model, kernel="function").run(None, {"p": p, "v": v})[0].astype(np.float64)
    tol = 1e-5 if dtype == "float32" else 2e-3
    assert got.shape == ref.shape and np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())
    assert np.abs(body - ref).max() <= tol * max(1.0, np.abs(ref).max())
