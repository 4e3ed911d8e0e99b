"""QuantizeRows: the rows an int8 cache stores (ops.spec's scale codes), made from a float32 graph's new K^ columns
and V rows as they are written.

    x [B, Hkv, S, w] float32  ->  rows [B, Hkv, S, w + 1] int8: round(x / s) (half to even, clipped to +-127), then
    c, the code of s = int8_scales()[c - lo]: the smallest table scale >= max |x| / 127 (the top code past it)

One node where its function body (row_nodes: standard ops, which any runtime runs) is fourteen: a decode step writes
two such tensors per layer, a few values each, so what they cost is the graph's nodes. Every implementation writes
the bytes rules.int8_rows does.
"""

from __future__ import annotations

from onnx import helper as H

from .nodes import const, scale_table
from .spec import DOMAIN, SCALE_CODES
from .table import ANY, OpDef, Port


def reference(x, **_):
    """rules.int8_rows (the float64 inputs of the catalogue are float32 values: its float32 arithmetic is exact)."""
    from .rules import int8_rows

    return int8_rows(x)


def row_nodes(x: str, out: str, p: str) -> list:
    """x [..., w] float32 -> out [..., w + 1] int8: ops.rules.int8_rows in standard ops, each node and value named
    from the prefix p. The code counts the table's scales below amax / 127 (no logarithm: exact) and the scale is
    read from that table, so this writes the bytes rules.int8_rows does."""
    n = H.make_node
    lo, hi = SCALE_CODES
    nodes = [
        const(p + "last", [-1]), const(p + "d127", 127.0), const(p + "bias", -lo), const(p + "top", hi - lo),
        const(p + "qmin", -127.0), const(p + "qmax", 127.0), scale_table(p + "scales"),
        n("Abs", [x], [p + "abs"]), n("ReduceMax", [p + "abs", p + "last"], [p + "amax"], keepdims=1),
        n("Div", [p + "amax", p + "d127"], [p + "least"]),  # the scale must reach amax / 127
        n("Less", [p + "scales", p + "least"], [p + "below"]), n("Cast", [p + "below"], [p + "below_i"], to=7),
        n("ReduceSum", [p + "below_i", p + "last"], [p + "count"], keepdims=1),
        n("Min", [p + "count", p + "top"], [p + "at"]),  # c - lo
        n("Gather", [p + "scales", p + "at"], [p + "scale"], axis=0),
        n("Div", [x, p + "scale"], [p + "scaled"]), n("Round", [p + "scaled"], [p + "rounded"]),
        n("Clip", [p + "rounded", p + "qmin", p + "qmax"], [p + "q_f"]), n("Cast", [p + "q_f"], [p + "q"], to=3),
        n("Sub", [p + "at", p + "bias"], [p + "c"]), n("Cast", [p + "c"], [p + "c8"], to=3),
        n("Concat", [p + "q", p + "c8"], [out], axis=-1),
    ]
    for node in nodes:
        node.name = p + node.output[0].removeprefix(p)
    return nodes


def body(opset: int, projected: bool = False):
    """row_nodes: Abs, ReduceMax, the table's count below max / 127, Gather, Div, Round, Clip, Cast, Concat."""
    return H.make_function(DOMAIN, OP.name, ["x"], ["rows"], row_nodes("x", "rows", "qr_"),
                           [H.make_opsetid("", opset)])


OP = OpDef("QuantizeRows", "rows [..., w + 1] int8: round(x / s) clipped to +-127, then the code of s (ops.spec)",
           inputs=(Port("x", "float"),), outputs=(Port("rows", "int8"),), body=body, reference=reference,
           shape=lambda d: {"rows": d["x"][:-1] + [ANY]})
