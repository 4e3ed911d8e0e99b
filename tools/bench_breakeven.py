"""The seed paper's break-even: AQUA pays O(d^2) per head and step to project q (q^ = qP) and saves
O(T (d - k)) in the scores, so it wins for T > d^2 / (d - k). Measured here in ONNX Runtime:

    AQUA   q, P --AquaAttention(k, group-shared selection, q^ = qP inside)--> out    (native kernel)
    dense  q -----AquaAttention(k = d)---------------------------------------> out    (a dense folder's step)

for T from 16 to 8192 (batch 1, the embedded model's 9 query / 3 KV heads, d = 64), interleaved
medians: the same fused kernel on both sides, so the difference is the projection, the selection and
the K^ rows not read. The measured crossover is the smallest T from which AQUA stays faster.
    -> benchmarks/breakeven.json (tables in benchmarks/performance.md via tools/perf_report.py)

Rerun: `.venv/bin/python -m tools breakeven` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from tools.bench_attention import D, G, HKV
from tools.harness import interleaved_medians

from aqua_export.outputs import atomic_write_bytes

CONTEXTS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192)


def _graph(k: int | None, P: np.ndarray):
    from onnx import TensorProto, numpy_helper
    from onnx import helper as H

    from aqua_export.ops import aqua_attention
    from aqua_export.ops.spec import DOMAIN, OPSET_VERSION

    op = aqua_attention.OP
    op.register()
    f = TensorProto.FLOAT
    nodes = [H.make_node("Shape", ["kc"], ["n"], start=3, end=4)]  # every slot filled
    inits = [] if k is None else [numpy_helper.from_array(P, "P")]  # [Hkv, d, d], as decoder_graph passes P_q
    nodes.append(H.make_node(op.name, ["q", "kc", "v", "n", "mask"] + ["P"] * (k is not None), ["out"],
                             domain=DOMAIN, k=k or D, rule=1, softcap=0.0, plugin_namespace="aqua", plugin_version="1"))
    ins = [H.make_tensor_value_info("q", f, [1, HKV, G, 1, D]), H.make_tensor_value_info("kc", f, [1, HKV, D, "T"]),
           H.make_tensor_value_info("v", f, [1, HKV, "T", D]), H.make_tensor_value_info("mask", TensorProto.INT64, [1, "T"])]
    g = H.make_graph(nodes, "breakeven", ins, [H.make_tensor_value_info("out", f, None)], initializer=inits)
    return H.make_model(g, opset_imports=[H.make_opsetid("", 20), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                        functions=[op.body(20, projected=k is not None)], ir_version=10)


def crossover(ts: list[int], ratios: list[float]) -> int | None:
    """Smallest T from which every measured ratio (dense time / AQUA time) is above 1."""
    for i, t in enumerate(ts):
        if all(r > 1 for r in ratios[i:]):
            return t
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k-ratios", default="0.75,0.5,0.25")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    a = ap.parse_args(argv)
    from aqua_export.runtime.session import make_session, native_library

    if native_library() is None:
        print("the native kernel is not built: run `make plugin`", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    P = np.linalg.qr(rng.standard_normal((HKV, D, D)))[0].astype(np.float32)
    ks = [max(1, round(float(r) * D)) for r in a.k_ratios.split(",")]
    sessions = {"dense": make_session(_graph(None, P).SerializeToString(), a.threads, "native", spin=False)}
    for k in ks:
        sessions[k] = make_session(_graph(k, P).SerializeToString(), a.threads, "native", spin=False)
    q = rng.standard_normal((1, HKV, G, 1, D), dtype=np.float32)
    ratios = {k: [] for k in ks}
    for t in CONTEXTS:
        kc = rng.standard_normal((1, HKV, D, t), dtype=np.float32)
        v = rng.standard_normal((1, HKV, t, D), dtype=np.float32)
        feed = {"q": q, "kc": kc, "v": v, "mask": np.ones((1, t), np.int64)}  # the node's 2-D attention_mask
        med = interleaved_medians({name: (lambda s=s: s.run(None, feed)) for name, s in sessions.items()},
                                   a.reps, 10.0)
        for k in ks:
            ratios[k].append(med["dense"] / med[k])
        print(t, {k: round(ratios[k][-1], 3) for k in ks}, flush=True)
    rows = [{"k": k, "k_ratio": k / D, "predicted_T": D * D / (D - k), "measured_crossover_T": crossover(list(CONTEXTS), ratios[k]),
             "dense_over_aqua_by_T": dict(zip(map(str, CONTEXTS), [round(x, 3) for x in ratios[k]]))} for k in ks]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": a.threads, "reps": a.reps, "batch": 1, "selection": "group (rule 1)",
            "projection": "AquaAttention's sixth input (q^ = qP inside the node)",
            "geometry": {"heads": HKV * G, "kv_heads": HKV, "head_dim": D}}
    atomic_write_bytes(out / "breakeven.json", json.dumps({"meta": meta, "rows": rows}, indent=1).encode())
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
