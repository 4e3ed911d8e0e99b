"""A study: MatMulNBits alone at accuracy level 0 (float32 activations) against level 4 (int8) on this CPU, and level
3 (bf16 asked); int4 weights in blocks of 32, 2 threads, the embedded model's shapes (K x N 576 x 1536, 1536 x 576,
576 x 576), from one row (a decode step) to 8,000 (an 8k prompt): whether a folder's prompt products (float32 from
quantize.FLOAT_ACTIVATION_ROWS new tokens up) still take the faster path on a CPU with VNNI, and the float32 rate
the prompt's products reach.

    python -m tools.studies.activation_levels_study -> benchmarks/activation_levels_study.json and .md
"""

from __future__ import annotations

import json
import sys

import numpy as np

from aqua_export.outputs import atomic_write_bytes
from tools.harness import BENCHMARKS, interleaved_medians, table

SHAPES = ((576, 1536), (1536, 576), (576, 576))
ROWS = (1, 16, 64, 1024, 8000)


def session(k: int, n: int, level: int):
    """A one-node MatMulNBits graph: int4 weights (random codes, block 32), x [rows, K] -> y [rows, N]."""
    import onnxruntime as ort
    from onnx import TensorProto
    from onnx import helper as H
    from onnx import numpy_helper

    gen = np.random.default_rng(0)
    blocks = (k + 31) // 32
    w = gen.integers(0, 255, (n, blocks, 16), dtype=np.uint8)
    scales = (gen.random(n * blocks) * 0.01).astype(np.float32)
    node = H.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=32,
                       accuracy_level=level)
    graph = H.make_graph([node], "g", [H.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                         [H.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                         initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(scales, "s")])
    model = H.make_model(graph, opset_imports=[H.make_opsetid("", 20), H.make_opsetid("com.microsoft", 1)],
                         ir_version=10)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    # the two levels' sessions alternate: a spinning pool would take the cores from the other's
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    from aqua_export.meter import cpu_name

    rows = []
    for k, n in SHAPES:
        sessions = {level: session(k, n, level) for level in (0, 3, 4)}
        for m in ROWS:
            x = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
            t = interleaved_medians({level: (lambda s=s: s.run(None, {"x": x})) for level, s in sessions.items()},
                            reps=max(5, 2000 // m), budget_s=5.0)
            rows.append({"K": k, "N": n, "rows": m, "level0_ms": t[0] * 1e3, "level3_ms": t[3] * 1e3,
                         "level4_ms": t[4] * 1e3,
                         "level0_gflops": 2 * m * k * n / t[0] / 1e9})
            print(rows[-1], flush=True)
    out = {"cpu": cpu_name(), "rows": rows}
    atomic_write_bytes(BENCHMARKS / "activation_levels_study.json", json.dumps(out, indent=1).encode())
    md = ["# MatMulNBits: float32 against int8 activations", "",
          f"`python -m tools.studies.activation_levels_study` on {out['cpu']}, 2 threads, int4 weights (block 32), "
          "median of interleaved calls (thread pools not spinning). Level 0: float32 activations (a prompt's "
          "products, from quantize.FLOAT_ACTIVATION_ROWS new tokens up); level 4: int8 (a decode step's); level 3 "
          "asks for bf16 (what a bf16 CPU could double), which ONNX Runtime's CPU kernel runs as float32.", "",
          *table(["K x N", "rows", "level 0 (ms)", "level 3 (ms)", "level 4 (ms)", "level 0 / level 4",
                  "level 0 GFLOP/s"],
                 [[f"{r['K']} x {r['N']}", r["rows"], f"{r['level0_ms']:.3f}", f"{r['level3_ms']:.3f}",
                   f"{r['level4_ms']:.3f}",
                   f"{r['level0_ms'] / r['level4_ms']:.2f}", f"{r['level0_gflops']:.0f}"] for r in rows]), ""]
    atomic_write_bytes(BENCHMARKS / "activation_levels_study.md", "\n".join(md).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
