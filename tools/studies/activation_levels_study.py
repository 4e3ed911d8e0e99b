"""A study: the routes ONNX Runtime's CPU kernels offer a folder's linear layers on this CPU, at the embedded model's
shapes (K x N 576 x 1536, 1536 x 576, 576 x 576), from one row (a decode step) to 8,000 (an 8k prompt), 2 threads:

    level 0 / 3 / 4   MatMulNBits, int4 weights in blocks of 32, with float32 activations (0: a folder's prompt
                      products, from quantize.FLOAT_ACTIVATION_ROWS new tokens up), bf16 asked (3) and int8 (4: a
                      decode step's)
    int8 level 4      MatMulNBits with int8 weights (--weights int8), int8 activations
    dynamic int8      DynamicQuantizeMatMul (com.microsoft): the activations quantized to uint8 with one scale per
                      call, int8 weights with one scale per output column, MLAS's integer GEMM (its VNNI kernels where
                      the CPU has them): OpenVINO's route for a prompt's int4 products is int8 activations too
    per-row int8      standard ops: each row's activations to int8 with its own scale (symmetric), MatMulInteger
                      against int8 weights with one scale per column, both scales applied to the int32 sums
    q4a8              MatMulQ4A8 (this project's, ops/matmul_q4a8.py, on its native kernel): the same int4 blocks,
                      the activations rounded to int8 per block of 32 (one scale each), the blocks' sums on the
                      integer units (AVX-512 VNNI here); what an int4 folder at level 4 runs at every row count

Whether a folder's prompt products still take the faster path on a CPU with VNNI, the float32 rate they reach, and
what an int8 route inside ONNX Runtime would give a prompt. What the int8 routes cost in quality is estimated in
PyTorch (quality()): every linear layer of the embedded model, the output layer included, given its input rounded as
the route rounds it (dynamic: to uint8 with one scale per call, its weights to int8 per output row; per-row: each
row to int8, the weights as dynamic's; int8 blocks: each block of 32 inputs to int8, rules.int8_groups, the weights
float); perplexity on builtin:licenses against float32, in windows of 512 and 2,048 tokens (one call each).

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
ROUTES = ("level0", "level3", "level4", "int8_level4", "dynamic_int8", "per_row_int8", "q4a8")


def _session(nodes, initializers, k: int, n: int, functions=()):
    """A graph of nodes x [rows, K] -> y [rows, N] on 2 threads (the project's native kernels registered: the
    routes' sessions alternate, so their pools do not spin and take the cores from the other's)."""
    from onnx import TensorProto
    from onnx import helper as H
    from onnx import numpy_helper

    from aqua_export.ops.spec import DOMAIN, OPSET_VERSION
    from aqua_export.runtime.session import make_session

    graph = H.make_graph(list(nodes), "g", [H.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                         [H.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                         initializer=[numpy_helper.from_array(v, name) for name, v in initializers.items()])
    model = H.make_model(graph, opset_imports=[H.make_opsetid("", 20), H.make_opsetid("com.microsoft", 1),
                                               H.make_opsetid(DOMAIN, OPSET_VERSION)],
                         functions=list(functions), ir_version=10)
    return make_session(model.SerializeToString(), threads=2, kernel="native", spin=False)


def session(k: int, n: int, route: str):
    """The route's one-node graph: random weights (codes), scales about 0.01."""
    from onnx import helper as H

    from onnx import TensorProto

    gen = np.random.default_rng(0)
    w8, col = gen.integers(-127, 128, (k, n), dtype=np.int8), (gen.random(n) * 0.01).astype(np.float32)
    if route == "dynamic_int8":
        node = H.make_node("DynamicQuantizeMatMul", ["x", "w", "s"], ["y"], domain="com.microsoft")
        return _session([node], {"w": w8, "s": col}, k, n)
    if route == "per_row_int8":
        n_ = H.make_node
        nodes = [n_("Abs", ["x"], ["ax"]), n_("ReduceMax", ["ax", "last"], ["mx"], keepdims=1),
                 n_("Div", ["mx", "c127"], ["rs"]), n_("Div", ["x", "rs"], ["xs"]), n_("Round", ["xs"], ["xr"]),
                 n_("Cast", ["xr"], ["xq"], to=TensorProto.INT8), n_("MatMulInteger", ["xq", "w"], ["acc"]),
                 n_("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT), n_("Mul", ["accf", "rs"], ["y1"]),
                 n_("Mul", ["y1", "s"], ["y"])]
        return _session(nodes, {"w": w8, "s": col, "last": np.array([-1], np.int64),
                                "c127": np.array(127, np.float32)}, k, n)
    bits = 8 if route == "int8_level4" else 4
    blocks = (k + 31) // 32
    w = gen.integers(0, 255, (n, blocks, 32 * bits // 8), dtype=np.uint8)
    if route == "q4a8":
        from aqua_export.ops import matmul_q4a8
        from aqua_export.ops.spec import DOMAIN, OPSET

        node = H.make_node(matmul_q4a8.OP.name, ["x", "w", "s"], ["y"], domain=DOMAIN, K=k, N=n, block_size=32)
        return _session([node], {"w": w, "s": (gen.random((n, blocks)) * 0.01).astype(np.float32)}, k, n,
                        functions=[matmul_q4a8.OP.body(OPSET)])
    node = H.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                       block_size=32, accuracy_level=int(route[-1]))  # level0 / 3 / 4, int8_level4
    return _session([node], {"w": w, "s": (gen.random(n * blocks) * 0.01).astype(np.float32)}, k, n)


def _int8_blocks(model):
    """A context in which every nn.Linear of model is given its input rounded to int8 per block of 32 inputs
    (rules.int8_groups, MatMulQ4A8's activations), its weights as they are."""
    import contextlib

    import torch

    from aqua_export.ops.rules import int8_groups

    def rounded_input(module, args):
        x = args[0]
        q, s = int8_groups(x, 32)
        blocks = q.reshape(*x.shape[:-1], -1, 32) * s[..., None]
        return (blocks.reshape(x.shape).to(x.dtype), *args[1:])

    @contextlib.contextmanager
    def ctx():
        hooks = [m.register_forward_pre_hook(rounded_input) for m in model.modules() if isinstance(m, torch.nn.Linear)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
    return ctx()


def _fake_int8(model, per_row: bool):
    """A context in which every nn.Linear of model computes as the dynamic route would (per_row False: its input
    rounded to uint8 over the call's whole tensor, one scale and zero point, the range widened to hold 0) or the
    per-row one (each row's input to int8 with its own scale, symmetric); its weight to int8 with one scale per
    output row (symmetric) in both."""
    import contextlib

    import torch

    def rounded_input(module, args):
        x = args[0]
        if per_row:
            s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
            return (torch.round(x / s).clamp(-127, 127) * s, *args[1:])
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        scale = (hi - lo) / 255 or 1.0
        zero = round(-lo / scale)
        return ((torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale, *args[1:])

    @contextlib.contextmanager
    def ctx():
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        saved = [m.weight.data.clone() for m in linears]
        hooks = [m.register_forward_pre_hook(rounded_input) for m in linears]
        try:
            for m in linears:
                w = m.weight.data
                s = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
                m.weight.data = torch.round(w / s).clamp(-127, 127) * s
            yield
        finally:
            for m, w, h in zip(linears, saved, hooks):
                m.weight.data = w
                h.remove()
    return ctx()


def quality() -> list[dict]:
    """Perplexity of the embedded model on builtin:licenses, float32 against the two int8 routes (PyTorch)."""
    from aqua_export import corpus, evaluate, models

    model, tok = models.load("llama")
    text = corpus.read_text("builtin:licenses")
    out = []
    for seq_len in (512, 2048):
        dense = evaluate.perplexity(model, tok, text, tokens=16384, seq_len=seq_len)["perplexity"]
        q = {}
        for route, ctx in (("dynamic_int8", lambda: _fake_int8(model, False)),
                           ("per_row_int8", lambda: _fake_int8(model, True)), ("int8_blocks", lambda: _int8_blocks(model))):
            with ctx():
                q[route] = evaluate.perplexity(model, tok, text, tokens=16384, seq_len=seq_len)["perplexity"]
        out.append({"seq_len": seq_len, "float32": dense, **q})
        print(out[-1], flush=True)
    return out


def measure() -> dict:
    """Every route at every shape and row count, timed interleaved; then quality()."""
    from aqua_export.meter import cpu_name

    rows = []
    for k, n in SHAPES:
        sessions = {route: session(k, n, route) for route in ROUTES}
        for m in ROWS:
            x = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
            t = interleaved_medians({r: (lambda s=s: s.run(None, {"x": x})) for r, s in sessions.items()},
                                    reps=max(5, 2000 // m), budget_s=5.0)
            rows.append({"K": k, "N": n, "rows": m, **{f"{r}_ms": t[r] * 1e3 for r in ROUTES},
                         **{f"{r}_gflops": 2 * m * k * n / t[r] / 1e9 for r in ROUTES}})
            print(rows[-1], flush=True)
    return {"cpu": cpu_name(), "rows": rows, "quality": quality()}


def render(out: dict) -> str:
    rows = out["rows"]
    md = ["# The linear layers' routes in ONNX Runtime: float32 against int8 activations", "",
          f"`python -m tools.studies.activation_levels_study` on {out['cpu']}, 2 threads, median of interleaved calls "
          "(thread pools not spinning). MatMulNBits with int4 weights (block 32): level 0 float32 activations (a "
          "prompt's products, from quantize.FLOAT_ACTIVATION_ROWS new tokens up), level 3 bf16 asked (ONNX Runtime's "
          "CPU kernel runs it as float32), level 4 int8 (a decode step's); MatMulNBits with int8 weights at level 4; "
          "DynamicQuantizeMatMul: uint8 activations with one scale per call, int8 weights with one per column, MLAS's "
          "integer GEMM; per-row int8: each row's activations to int8 with its own scale, MatMulInteger against int8 "
          "weights (standard ops); MatMulQ4A8: this project's, the int4 blocks against int8 activation blocks of 32 "
          "on the integer units (an int4 folder's products at level 4, every row count). Rates in GFLOP/s (2 K N per "
          "row).", "",
          *table(["K x N", "rows", "level 0 (ms)", "level 3 (ms)", "level 4 (ms)", "MatMulQ4A8 (ms)",
                  "level 0", "level 4", "int8 weights, level 4", "dynamic int8", "per-row int8", "MatMulQ4A8",
                  "MatMulQ4A8 / level 0", "MatMulQ4A8 / level 4"],
                 [[f"{r['K']} x {r['N']}", r["rows"], f"{r['level0_ms']:.3f}", f"{r['level3_ms']:.3f}",
                   f"{r['level4_ms']:.3f}", f"{r['q4a8_ms']:.3f}", f"{r['level0_gflops']:.0f}",
                   f"{r['level4_gflops']:.0f}", f"{r['int8_level4_gflops']:.0f}", f"{r['dynamic_int8_gflops']:.0f}",
                   f"{r['per_row_int8_gflops']:.0f}", f"{r['q4a8_gflops']:.0f}",
                   f"{r['level0_ms'] / r['q4a8_ms']:.2f}x", f"{r['level4_ms'] / r['q4a8_ms']:.2f}x"] for r in rows]), "",
          "What the int8 routes cost (PyTorch, every linear layer as the route computes it, the output layer "
          "included; perplexity of the embedded model on builtin:licenses, 16,384 tokens, each window one call):", "",
          *table(["window", "float32", "dynamic int8", "per-row int8", "int8 blocks of 32 (MatMulQ4A8)"],
                 [[q["seq_len"], f"{q['float32']:.4f}",
                   *(f"{q[r]:.4f} ({100 * (q[r] / q['float32'] - 1):+.2f}%)"
                     for r in ("dynamic_int8", "per_row_int8", "int8_blocks"))]
                  for q in out["quality"]]), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    """--render: rewrite the .md from the .json, nothing measured."""
    path = BENCHMARKS / "activation_levels_study.json"
    if "--render" in (sys.argv[1:] if argv is None else argv):
        out = json.loads(path.read_text())
    else:
        out = measure()
        atomic_write_bytes(path, json.dumps(out, indent=1).encode())
    atomic_write_bytes(BENCHMARKS / "activation_levels_study.md", render(out).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
