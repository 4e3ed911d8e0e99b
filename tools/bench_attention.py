"""One decode attention step in ONNX Runtime: the fused AquaAttention node (native kernel) against dense
attention three ways.

    -> benchmarks/attention_step.json and the "Attention step" section of benchmarks/performance.md

Geometry: the embedded model's (9 query heads, 3 KV heads, d = 64). Each graph is one session with the
same thread count, fed the same cache; times are medians of interleaved rounds and every figure reported
is a ratio measured in this run.

    AQUA         q, P --AquaAttention(k, rule)--> out     (q^ = qP inside; K^ dim-major [B,Hkv,d,T], one pass, native:
                                                          the node as an AQUA folder runs it)
    fused dense  q  --AquaAttention(k = d)----> out        (what a dense folder of this project runs)
    ORT dense    q  --MatMul K--> Softmax --MatMul V--> out (standard ops, same layout)
    GQA          com.microsoft.GroupQueryAttention, past/present sharing one buffer (onnxruntime-genai's op)

Token selection rows: AquaAttention with token_ratio R (AquaConfig's sink 16 and window 64): a step reads the
selected rows of K^ for every token, then K^ and V whole for the chosen pages' tokens (a share rho >= R: whole
pages, plus the forced ones). Byte limit: (K + V) / (u K + rho (K + V)).

AQUA-H2O rows: the H2OAttention node (native, given q and P as folders run it) in its steady state, a context of T
tokens already evicted to budget(h, T) live slots (per slot: K^, V, heavy float32, token int64), one token in and
one out per step, buffers bound as past and present (in place). Byte limit: (K + V) / (h (u K + V) + heavy + token).

Selection rules: `head` (each query head its own top-k: magnitude / weighted) and `group` (one top-k per
GQA group: group / group-weighted; the weighted rules reach the kernel as these two, rms(k^) folded into P).
Byte limit: a step reads K and V (dense) or the union u of the group's selected rows of K^ plus V (AQUA):
limit = (K + V) / (u K + V); u = k/d for `group`. Queries: q^ coordinate c drawn with the standard deviation
the calibration measured for it (the embedded model's projection, median layer; iid without the artifact).

Cache widths (--caches, the contract's cache_dtype): every AquaAttention row runs at each width, float32, float16
and int8 (rules.int8_rows: each token's K^ column and V row int8 with a scale code), fused dense at the same width
as its baseline, all widths in one interleaved run; `width_over_this` is the same setting at the other widths over
this one (int8's against float16: what the int8 cache issue asks of a step). ORT dense and GQA read float32; the
H2O node takes float32 caches only.

Each timed step starts with the CPU caches flushed (harness.flush_caches), as a folder's step meets each layer's
cache after the other layers went through: at 1k tokens a cache fits in L3 and a step timed warm reads it from
there. --warm times steps back to back instead.

Rerun: `.venv/bin/python -m tools attention` (about a minute on 2 cores; --quick for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from aqua_export.ops import rules
from tools.harness import flush_caches, interleaved_medians
from aqua_export.ops.spec import CACHE_TYPES, CACHES, PROJECTION, SLOT_EXTRA_BYTES
from aqua_export.runtime.caches import large_empty
from aqua_export.outputs import atomic_write_bytes

HQ, HKV, D = 9, 3, 64
G = HQ // HKV


# (rule, k_ratio): what the table measures; rule 0 = per head, 1 = group-shared
SETTINGS = [("head", 0.75), ("head", 0.5), ("head", 0.25), ("group", 0.75), ("group", 0.625), ("group", 0.5),
            ("group", 0.25)]
RULE = {"head": 0, "group": 1}
# (h2o_ratio, rule, k_ratio): AQUA-H2O settings whose perplexity is no worse than per-head magnitude at k 0.5
# (benchmarks/quality.md, with the weighted rule these kernels run as `group`)
H2O_SETTINGS = [(0.75, "group", 0.75), (0.875, "group", 0.625)]
# (token_ratio, token_budget, rule, k_ratio): token selection with the config's sink 16 and window 64 (pages chosen
# on the scores of k rows of K^, then all of K^ and V for the chosen pages' tokens); a ratio or a fixed budget
TOKEN_SETTINGS = [(0.25, 0, "group", 0.5), (0.125, 0, "group", 0.5), (0.125, 0, "group", 0.25),
                  (0.0625, 0, "group", 0.25), (1.0, 512, "group", 0.25)]
SINK, WINDOW = 16, 64


def _narrow(kc: np.ndarray, v: np.ndarray, width: str) -> dict:
    """The node's cache inputs at a width from float32 K^ [B, Hkv, d, T] and V [B, Hkv, T, d]: as they are, float16,
    or int8 rows with their scale codes (rules.int8_rows: K^ [B, Hkv, d + 1, T], V [B, Hkv, T, d + 1]), each in
    memory as the runtime allocates a cache (large_empty)."""
    if width == "float32":
        return {"key_cache": kc, "value_cache": v}
    if width == "float16":
        k16, v16 = large_empty(kc.shape, np.float16), large_empty(v.shape, np.float16)
        k16[...], v16[...] = kc, v
        return {"key_cache": k16, "value_cache": v16}
    import torch

    kq = rules.int8_rows(torch.from_numpy(kc).transpose(-1, -2)).transpose(-1, -2).numpy()
    vq = rules.int8_rows(torch.from_numpy(v)).numpy()
    k8, v8 = large_empty(kq.shape, np.int8), large_empty(vq.shape, np.int8)
    k8[...], v8[...] = kq, vq
    return {"key_cache": k8, "value_cache": v8}


def gqa_model(**attributes):
    """ONNX Runtime's GroupQueryAttention (onnxruntime-genai's op) at the embedded model's geometry: q [B, S, HQ D],
    k / v [B, S, HKV D] for S new tokens (1 at decode, the prompt's length in a prefill) after a past [B, HKV, P, D]
    (P 0 for a prompt); attributes beyond the heads (scale) as given."""
    from onnx import TensorProto
    from onnx import helper as H

    f = TensorProto.FLOAT
    node = H.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                       ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV,
                       **attributes)
    ins = [H.make_tensor_value_info("q", f, ["B", "S", HQ * D]), H.make_tensor_value_info("k", f, ["B", "S", HKV * D]),
           H.make_tensor_value_info("v", f, ["B", "S", HKV * D]),
           H.make_tensor_value_info("past_k", f, ["B", HKV, "P", D]),
           H.make_tensor_value_info("past_v", f, ["B", HKV, "P", D]),
           H.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
           H.make_tensor_value_info("total", TensorProto.INT32, [1])]
    outs = [H.make_tensor_value_info(n, f, None) for n in ("out", "present_k", "present_v")]
    g = H.make_graph([node], "gqa", ins, outs)
    return H.make_model(g, opset_imports=[H.make_opsetid("", 20), H.make_opsetid("com.microsoft", 1)], ir_version=10)


def _graph(kind: str):
    """The two baselines without a custom node: ORT's GroupQueryAttention ("gqa") and the standard-op dense step."""
    from onnx import TensorProto
    from onnx import helper as H

    f = TensorProto.FLOAT
    if kind == "gqa":
        return gqa_model()
    # ORT dense; AquaAttention is ops.aqua_attention.OP.model (its ports: query_hat, key_cache, ...)
    nodes = [H.make_node("Constant", [], ["ax2"], value_ints=[2]),
             H.make_node("Unsqueeze", ["kc", "ax2"], ["kc_g"]), H.make_node("Unsqueeze", ["vc", "ax2"], ["v_g"]),
             H.make_node("MatMul", ["q", "kc_g"], ["s"]), H.make_node("Add", ["s", "mask"], ["sm"]),
             H.make_node("Softmax", ["sm"], ["w"], axis=-1), H.make_node("MatMul", ["w", "v_g"], ["out"])]
    ins = [H.make_tensor_value_info("q", f, ["B", HKV, G, 1, D]), H.make_tensor_value_info("kc", f, ["B", HKV, D, "T"]),
           H.make_tensor_value_info("vc", f, ["B", HKV, "T", D]), H.make_tensor_value_info("mask", f, ["B", 1, 1, 1, "T"])]
    g = H.make_graph(nodes, kind, ins, [H.make_tensor_value_info("out", f, None)])
    return H.make_model(g, opset_imports=[H.make_opsetid("", 20)], ir_version=10)


def _spectrum() -> np.ndarray:
    """Per-coordinate q^ standard deviation [Hkv, d] of the embedded model's median layer (energy is the
    eigenvalue of the group's uncentred second moment, sorted); iid fallback without the artifact."""
    path = ROOT / "benchmarks" / "llama-projection.safetensors"
    if not path.is_file():
        return None
    from aqua_export.projection import load_projection

    proj = load_projection(path)
    layer = len(proj.P) // 2
    return np.sqrt(np.maximum(proj.energy[layer].numpy(), 0))


def _union_fraction(q: np.ndarray, k: int, rule: str) -> float:
    """Mean over (batch, kv head) of |union of the group's selected coordinates| / d (k / d when shared)."""
    if rule == "group":
        return k / q.shape[-1]
    idx = np.argsort(-np.abs(q), axis=-1, kind="stable")[..., :k]  # [B, Hkv, g, 1, k]
    b, h = q.shape[:2]
    sizes = [len(np.unique(idx[i, j])) for i in range(b) for j in range(h)]
    return float(np.mean(sizes)) / q.shape[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="T 1024 only, few repetitions")
    ap.add_argument("--warm", action="store_true", help="steps back to back, the cache left in the CPU's caches")
    ap.add_argument("--caches", default="float32,float16,int8",
                    help="the AquaAttention rows' cache widths (contract cache_dtype), comma-separated")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    a = ap.parse_args(argv)
    caches = a.caches.split(",")
    if not set(caches) <= set(CACHE_TYPES):
        print(f"--caches takes {', '.join(CACHE_TYPES)} (comma-separated), not {a.caches!r}", file=sys.stderr)
        return 2
    from aqua_export.runtime.session import native_library

    if native_library() is None:
        print("the native kernel is not built: run `make plugin`", file=sys.stderr)
        return 2
    contexts = [1024] if a.quick else [int(x) for x in a.contexts.split(",")]
    h2o = H2O_SETTINGS if "float32" in caches else []
    if not h2o:
        print("no AQUA-H2O rows: its node takes float32 caches only, and --caches leaves float32 out", flush=True)
    reps = 5 if a.quick else a.reps
    spectrum = _spectrum()
    sessions = _sessions(caches, h2o, a.threads)
    rng = np.random.default_rng(0)
    rows = []
    for t in contexts:
        for b in [int(x) for x in a.batches.split(",")]:
            fns, q = _runners(sessions, caches, b, t, rng, spectrum, reps + 2)
            med = interleaved_medians(fns, reps, 60.0 if t >= 16384 else 20.0,
                                      between=None if a.warm else flush_caches)
            for r in _rows(med, caches, h2o, q, t, b):
                rows.append(r)
                print(json.dumps(r), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cache_widths": caches, "threads": a.threads, "reps": reps,
            "caches": "warm" if a.warm else "flushed before each step",
            "geometry": {"heads": HQ, "kv_heads": HKV, "head_dim": D},
            "queries": "spectrum" if spectrum is not None else "iid",
            "native_library": str(native_library().relative_to(ROOT)) if native_library().is_relative_to(ROOT) else "env"}
    atomic_write_bytes(out / "attention_step.json", json.dumps({"meta": meta, "rows": rows}, indent=1).encode())
    return 0


def _sessions(caches: list[str], h2o: list, threads: int) -> dict:
    """One session per measured graph: the standard-op baselines ("ort-dense", "gqa"), the AquaAttention settings at
    each cache width (keys lead with the width: (c, "fused-dense"), (c, rule, ratio), (c, "tokens", ...)) and the
    H2O settings (("h2o", h, rule, ratio), float32 caches)."""
    from aqua_export.ops import aqua_attention, h2o_attention
    from aqua_export.runtime.session import make_session

    def sess(model, kernel="native"):
        return make_session(model.SerializeToString(), threads, kernel, spin=False)

    sessions = {"ort-dense": sess(_graph("dense"), "function"), "gqa": sess(_graph("gqa"), "function")}
    for c in caches:
        width = {"cache_dtype": c, **({"cache_scales": 1} if CACHES[c].scale_slots else {})}  # as decoder_graph sets it
        sessions[c, "fused-dense"] = sess(aqua_attention.OP.model(k=D, **width))
        for rule, ratio in SETTINGS:
            sessions[c, rule, ratio] = sess(aqua_attention.OP.model(projected=True, k=round(ratio * D),
                                                                    rule=RULE[rule], **width))
        for tr, tb, rule, ratio in TOKEN_SETTINGS:
            sessions[c, "tokens", tr, tb, rule, ratio] = sess(aqua_attention.OP.model(
                projected=True, k=round(ratio * D), rule=RULE[rule], token_ratio=tr, token_budget=tb, token_sink=SINK,
                token_window=WINDOW, **width))
    for h, rule, ratio in h2o:
        sessions["h2o", h, rule, ratio] = sess(h2o_attention.OP.model(projected=True, k=round(ratio * D),
                                                                      rule=RULE[rule], ratio=h))
    return sessions


def _runners(sessions: dict, caches: list[str], b: int, t: int, rng, spectrum, steps: int) -> tuple[dict, np.ndarray]:
    """(one step of each session at batch b after t tokens, every AquaAttention width fed the same cache; q^
    [b, Hkv, g, 1, d], the queries the selections ran on). steps: the H2O runners' mask count."""
    # the cache in memory as the runtime allocates its buffers (runtime.caches.large_empty: huge pages)
    kc, v = large_empty((b, HKV, D, t), np.float32), large_empty((b, HKV, t, D), np.float32)
    kc[...] = rng.standard_normal(kc.shape, dtype=np.float32)
    v[...] = rng.standard_normal(v.shape, dtype=np.float32)
    sd = spectrum[None, :, None, None, :] if spectrum is not None else 1.0
    q = (rng.standard_normal((b, HKV, G, 1, D)) * sd).astype(np.float32)
    feed = {"q": q, "kc": kc, "vc": v, "mask": np.zeros((b, 1, 1, 1, t), np.float32)}
    # the fused node's ports (ops/aqua_attention.py); every slot filled
    fused = {"query_hat": q, "total_length": np.array([t], np.int64), "attention_mask": np.ones((b, t), np.int64)}
    # the AQUA nodes take q = q^ P^T and P: the same q^, so the same selections
    P = np.linalg.qr(rng.standard_normal((HKV, D, D)))[0].astype(np.float32)
    projected = {**fused, "query_hat": np.einsum("bhgtr,hdr->bhgtd", q, P).astype(np.float32), PROJECTION: P}
    fns = {"ort-dense": lambda s=sessions["ort-dense"]: s.run(None, feed)}
    for c in caches:
        narrow = _narrow(kc, v, c)
        for name, s in sessions.items():
            if name[0] == c:
                fd = {**(fused if name[1] == "fused-dense" else projected), **narrow}
                fns[name] = lambda s=s, fd=fd: s.run(None, fd)
    fns["gqa"] = _gqa_runner(sessions["gqa"], b, t, rng)
    for name in sessions:
        if name[0] == "h2o":
            fns[name] = _h2o_runner(sessions[name], name[1], projected["query_hat"], P, b, t, steps, rng)
    return fns, q


def _ratios(med: dict, aq: float, dense: float) -> dict:
    """A row's ratios: the fused dense node (of the row's width) and the standard-op baselines over ``aq``."""
    return {"fused_dense_over_aqua": round(dense / aq, 3), "ort_dense_over_aqua": round(med["ort-dense"] / aq, 3),
            "gqa_over_aqua": round(med["gqa"] / aq, 3),
            "ort_dense_over_fused_dense": round(med["ort-dense"] / dense, 3)}


def _rows(med: dict, caches: list[str], h2o: list, q: np.ndarray, t: int, b: int) -> list[dict]:
    """The table's rows of one (T, batch) from the medians: AQUA and token selection at each width, then H2O."""
    rows = []
    for c in caches:
        dense = med[c, "fused-dense"]

        def row(key, setting: dict, limit: float) -> dict:
            aq = med[(c, *key)]
            # width_over_this > 1: this width's step is faster than the same setting's at width w
            return {"T": t, "batch": b, "cache": c, **setting, **_ratios(med, aq, dense),
                    "width_over_this": {w: round(med[(w, *key)] / aq, 3) for w in caches if w != c},
                    "byte_limit": round(limit, 3)}

        for rule, ratio in SETTINGS:
            k = round(ratio * D)
            u = _union_fraction(q, k, rule)
            rows.append(row((rule, ratio), {"rule": rule, "k_ratio": ratio, "k": k, "union_fraction": round(u, 3)},
                            2.0 / (1.0 + u)))
        for tr, tb, rule, ratio in TOKEN_SETTINGS:
            k = round(ratio * D)
            u, rho = _union_fraction(q, k, rule), rules.attended_share(t, tr, tb, SINK, WINDOW)
            rows.append(row(("tokens", tr, tb, rule, ratio), {
                "rule": rule, "k_ratio": ratio, "k": k, **({"token_budget": tb} if tb else {"token_ratio": tr}),
                "token_share": round(rho, 4), "union_fraction": round(u, 3)}, 2.0 / (u + 2 * rho)))
    for h, rule, ratio in h2o:
        k = round(ratio * D)
        u = _union_fraction(q, k, rule)
        live = _h2o_live(h, t) / t * (1.0 + u + SLOT_EXTRA_BYTES / (D * 4))
        rows.append({"T": t, "batch": b, "cache": "float32", "rule": rule, "k_ratio": ratio, "k": k, "h2o_ratio": h,
                     "union_fraction": round(u, 3),
                     **_ratios(med, med["h2o", h, rule, ratio], med["float32", "fused-dense"]),
                     "byte_limit": round(2.0 / live, 3)})
    return rows


def _h2o_live(h: float, t: int) -> int:
    """Live slots of a context of t tokens under H2O ratio h (evicted to its budget)."""
    from aqua_export.ops.rules import budget

    return int(budget(h, t))


def _h2o_runner(sess, h: float, q, P, b: int, t: int, steps: int, rng):
    """One decode step of H2OAttention given q and P (the node as folders run it) after a context of t tokens
    (evicted to budget(h, t) live slots), in buffers bound as past and present; every call is the next token
    (the mask grows by one)."""
    import onnxruntime as ort

    from aqua_export.ops.h2o_attention import INPUTS, OUTPUTS
    from aqua_export.ops.rules import slots_needed

    n, cap = _h2o_live(h, t), slots_needed(h, t + steps + 1)
    key = np.zeros((b, HKV, D, cap), np.float32)  # dim-major memory, bound as [B, Hkv, cap, r]
    key[..., :n] = rng.standard_normal((b, HKV, D, n), dtype=np.float32)
    value = np.zeros((b, HKV, cap, D), np.float32)
    value[:, :, :n] = rng.standard_normal((b, HKV, n, D), dtype=np.float32)
    heavy = np.zeros((b, HKV, cap), np.float32)
    heavy[..., :n] = rng.random((b, HKV, n), dtype=np.float32)
    token = np.full((b, HKV, cap), -1, np.int64)
    token[..., :n] = np.arange(t - n, t)
    io = sess.io_binding()
    io.bind_cpu_input("query_hat", q)
    io.bind_cpu_input(PROJECTION, P)
    io.bind_cpu_input("key_new", rng.standard_normal((b, HKV, 1, D), dtype=np.float32))
    io.bind_cpu_input("value_new", rng.standard_normal((b, HKV, 1, D), dtype=np.float32))
    io.bind_output("out")
    for past, present, buf in zip(INPUTS[3:7], OUTPUTS[1:], (key.reshape(b, HKV, cap, D), value, heavy, token)):
        v = ort.OrtValue.ortvalue_from_numpy(buf)
        io.bind_ortvalue_input(past, v)
        io.bind_ortvalue_output(present, v)
    masks = [np.ones((b, t + 1 + i), np.int64) for i in range(steps + 1)]  # made before timing
    state = {"i": 0}

    def step():
        io.bind_cpu_input("attention_mask", masks[state["i"]])
        state["i"] += 1
        sess.run_with_iobinding(io)

    return step


def _gqa_runner(sess, b: int, t: int, rng):
    """GQA appends one token to a past of t - 1 inside a shared past/present buffer of length t
    (onnxruntime-genai's decode setup)."""
    import onnxruntime as ort

    buf_k = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((b, HKV, t, D), dtype=np.float32))
    buf_v = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((b, HKV, t, D), dtype=np.float32))
    io = sess.io_binding()
    io.bind_cpu_input("q", rng.standard_normal((b, 1, HQ * D), dtype=np.float32))
    io.bind_cpu_input("k", rng.standard_normal((b, 1, HKV * D), dtype=np.float32))
    io.bind_cpu_input("v", rng.standard_normal((b, 1, HKV * D), dtype=np.float32))
    io.bind_ortvalue_input("past_k", buf_k)
    io.bind_ortvalue_input("past_v", buf_v)
    io.bind_cpu_input("seqlens_k", np.full((b,), t - 1, np.int32))
    io.bind_cpu_input("total", np.array([t], np.int32))
    io.bind_output("out")
    io.bind_ortvalue_output("present_k", buf_k)
    io.bind_ortvalue_output("present_v", buf_v)
    return lambda: sess.run_with_iobinding(io)


if __name__ == "__main__":
    sys.exit(main())
