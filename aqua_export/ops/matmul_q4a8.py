"""MatMulQ4A8: a prompt's products against int4 weights with its activations rounded to int8 per weight block, so a
CPU multiplies on its integer units (AVX-512 VNNI, vpmaddubsw) where ONNX Runtime's MatMulNBits keeps a prompt's
activations float32 (quantize.FLOAT_ACTIVATION_ROWS says why: its own int8 path is slower there).

    a [..., K] float32, b [N, K / block, block / 2] uint8, scales [N, K / block] float32
        (MatMulNBits' symmetric int4 blocks, quantize.py: nibble - 8 times the block's scale; the same initializers)
    -> y [..., N] float32 = sum_j s[m, j] scales[n, j] sum_{k in block j} q[m, k] (nibble[n, k] - 8)
    (s, q: rules.int8_groups, the activations' int8 blocks: s = max |a| / 127, q = round(a / s) clipped to +-127)

The function body dequantizes both sides and multiplies in float32 (MatMul), so it computes the same sums as the
native kernel (plugins/ort/matmul_q4a8.cc: integer sums per block, scaled once a block) up to float32 rounding.

MatMulQ4A8Gated (GATED) is the same product over a gated MLP's stacked [gate; up] weights (N = 2 I rows, gate's
first), its output the gate applied: y [..., I] = silu(y_gate) * y_up, silu(x) = x / (1 + e^-x). One node in place of
MatMulQ4A8, Split, Sigmoid and two Muls: the [..., 2 I] product and its halves are never written (at 8,000 prompt
tokens on the embedded model, 98 MB a layer, and the copies ~6% of the prompt's time).
"""

from __future__ import annotations

from onnx import TensorProto
from onnx import helper as H

from .nodes import const
from .spec import DOMAIN
from .table import ANY, Attr, OpDef, Port


def reference(a, b, scales, K, N, block_size, **_):
    """float64: the activations' int8 blocks (rules.int8_groups) times the weights' (nibble - 8) x scale."""
    import torch

    from .rules import int8_groups

    q, s = int8_groups(a, block_size)
    nib = torch.stack([b.long() & 15, b.long() >> 4], -1).reshape(N, K // block_size, block_size)
    w = ((nib - 8).double() * scales.double().reshape(N, -1, 1)).reshape(N, K)
    a_blocks = (q.reshape(*q.shape[:-1], K // block_size, block_size) * s[..., None]).reshape(q.shape)
    return a_blocks @ w.T


def gated_reference(a, b, scales, K, N, block_size, **_):
    """float64: reference's product [..., N] -> silu(its first N / 2 columns) * its last N / 2."""
    y = reference(a, b, scales, K, N, block_size)
    gate, up = y[..., :N // 2], y[..., N // 2:]
    return gate * gate.sigmoid() * up


def body(opset: int, projected: bool = False):
    """Abs, ReduceMax, Div, Round, Clip per activation block; BitwiseAnd / BitShift, Sub 8, Mul per weight block;
    MatMul. The block size is read from b's last dimension (twice it), N from its first."""
    return H.make_function(DOMAIN, OP.name, ["a", "b", "scales"], ["y"], _product("y"), [H.make_opsetid("", opset)],
                           attributes=["K", "N", "block_size"])


def gated_body(opset: int, projected: bool = False):
    """body's product, then the gate (_gate) on its two halves."""
    n = H.make_node
    nodes = _product("y_full") + [  # N / 2 columns each, N read from b as in the product
        n("Div", ["n_1d", "two_i"], ["half"]), n("Concat", ["half", "half"], ["halves"], axis=0),
        *_gate("y_full", "halves", "y")]
    return H.make_function(DOMAIN, GATED.name, ["a", "b", "scales"], ["y"], nodes, [H.make_opsetid("", opset)],
                           attributes=["K", "N", "block_size"])


def _gate(product: str, halves: str, out: str, prefix: str = "") -> list:
    """Split ``product`` [..., N] in its two halves (``halves``: [N / 2, N / 2]) along the last axis, Sigmoid and Mul
    (silu of the first), Mul by the second into ``out``: the gate in standard ops (the function body's, and
    float_activations' after MatMulNBits). prefix names the intermediate values and the nodes."""
    n, p = H.make_node, prefix
    return [n("Split", [product, halves], [p + "gate", p + "up"], name=p + "Split", axis=-1),
            n("Sigmoid", [p + "gate"], [p + "sigmoid"], name=p + "Sigmoid"),
            n("Mul", [p + "gate", p + "sigmoid"], [p + "silu"], name=p + "Silu"),
            n("Mul", [p + "silu", p + "up"], [out], name=p + "Gate")]


def _product(out: str) -> list:
    """The function body's nodes of the product a x dequantized b into ``out`` [..., N]."""
    n = H.make_node
    u8 = TensorProto.UINT8
    nodes = [
        const("zero_i", [0]), const("one_i", [1]), const("two_i", [2]), const("three_i", [3]), const("minus_1", [-1]),
        const("pair", [1, 2]), const("d127", 127.0), const("one", 1.0), const("zero", 0.0), const("qmin", -127.0),
        const("qmax", 127.0), const("eight", 8.0), const("low", [15], u8), const("four", [4], u8),
        n("Shape", ["a"], ["a_shape"]), n("Shape", ["b"], ["b_shape"]),
        n("Slice", ["a_shape", "zero_i", "minus_1"], ["lead"]),  # a's leading dimensions
        n("Slice", ["b_shape", "zero_i", "one_i"], ["n_1d"]),  # [N]
        n("Slice", ["b_shape", "zero_i", "two_i"], ["n_nb"]),  # [N, K / block]
        n("Slice", ["b_shape", "one_i", "three_i"], ["nb_half"]), n("Mul", ["nb_half", "pair"], ["nb_block"]),
        # the activations' int8 blocks [..., K / block, block], as float values q s
        n("Concat", ["lead", "nb_block"], ["blocks_shape"], axis=0), n("Reshape", ["a", "blocks_shape"], ["a_blocks"]),
        n("Abs", ["a_blocks"], ["a_abs"]), n("ReduceMax", ["a_abs", "minus_1"], ["a_max"], keepdims=1),
        n("Div", ["a_max", "d127"], ["s"]), n("Equal", ["s", "zero"], ["s_zero"]),
        n("Where", ["s_zero", "one", "s"], ["s_safe"]), n("Div", ["a_blocks", "s_safe"], ["a_scaled"]),
        n("Round", ["a_scaled"], ["a_round"]), n("Clip", ["a_round", "qmin", "qmax"], ["a_clip"]),
        n("Where", ["s_zero", "zero", "a_clip"], ["q"]), n("Mul", ["q", "s"], ["a_q"]),
        n("Reshape", ["a_q", "a_shape"], ["a_int8"]),
        # the weights [K, N]: each byte's low nibble first, minus 8, times the block's scale
        n("BitwiseAnd", ["b", "low"], ["b_lo"]), n("BitShift", ["b", "four"], ["b_hi"], direction="RIGHT"),
        n("Unsqueeze", ["b_lo", "minus_1"], ["b_lo_1"]), n("Unsqueeze", ["b_hi", "minus_1"], ["b_hi_1"]),
        n("Concat", ["b_lo_1", "b_hi_1"], ["b_pairs"], axis=-1),
        n("Concat", ["n_1d", "nb_block"], ["w_blocks_shape"], axis=0),
        n("Reshape", ["b_pairs", "w_blocks_shape"], ["nibbles"]), n("Cast", ["nibbles"], ["nib_f"], to=1),
        n("Sub", ["nib_f", "eight"], ["w_int"]), n("Reshape", ["scales", "n_nb"], ["scales_r"]),
        n("Unsqueeze", ["scales_r", "minus_1"], ["scales_1"]), n("Mul", ["w_int", "scales_1"], ["w_blocks"]),
        n("Concat", ["n_1d", "minus_1"], ["w_shape"], axis=0), n("Reshape", ["w_blocks", "w_shape"], ["w"]),
        n("Transpose", ["w"], ["w_t"], perm=[1, 0]), n("MatMul", ["a_int8", "w_t"], [out]),
    ]
    return nodes


OP = OpDef("MatMulQ4A8", "y [..., N] = a's int8 blocks (per weight block) x int4 weights (MatMulNBits' symmetric "
           "format)", inputs=(Port("a", "float", 3), Port("b", "uint8", 3), Port("scales", "float", 2)),
           outputs=(Port("y", "float", 3),),
           attributes=(Attr("K", "int", "inputs"), Attr("N", "int", "outputs"),
                       Attr("block_size", "int", "inputs per block (a multiple of 8 dividing K)")),
           body=body, reference=reference, shape=lambda d: {"y": d["a"][:-1] + [ANY]})


def to_nbits(node) -> None:
    """A MatMulQ4A8 node made MatMulNBits again, in place, with float32 activations (accuracy_level 0): what the
    parity harness's float-activation runs compute (export.rewrites.float_activations)."""
    attrs = {a.name: a.i for a in node.attribute}
    node.op_type, node.domain = "MatMulNBits", "com.microsoft"
    del node.attribute[:]
    node.attribute.extend([H.make_attribute("K", attrs["K"]), H.make_attribute("N", attrs["N"]),
                           H.make_attribute("bits", 4), H.make_attribute("block_size", attrs["block_size"]),
                           H.make_attribute("accuracy_level", 0)])


GATED = OpDef("MatMulQ4A8Gated", "y [..., N / 2] = silu(p[..., :N / 2]) * p[..., N / 2:], p = MatMulQ4A8's product "
              "over a gated MLP's stacked [gate; up] int4 weights", inputs=OP.inputs, outputs=OP.outputs,
              attributes=(Attr("K", "int", "inputs"),
                          Attr("N", "int", "the product's columns: gate's, then up's (even)"),
                          Attr("block_size", "int", "inputs per block (a multiple of 8 dividing K)")),
              body=gated_body, reference=gated_reference, shape=lambda d: {"y": d["a"][:-1] + [ANY]})


def to_nbits_gated(graph, index: int) -> None:
    """The MatMulQ4A8Gated node graph.node[index] as MatMulNBits at accuracy_level 0 (to_nbits) and the gate in
    standard ops after it, writing the node's output (export.rewrites.float_activations)."""
    node = graph.node[index]
    attrs = {a.name: a.i for a in node.attribute}
    out, name = node.output[0], node.name
    product = f"{name}/product"
    del node.output[:]
    node.output.append(product)
    to_nbits(node)
    half = f"{name}/halves"
    gate = [H.make_node("Constant", [], [half], name=half,
                        value=H.make_tensor(half, TensorProto.INT64, [2], [attrs["N"] // 2] * 2)),
            *_gate(product, half, out, f"{name}/")]
    for i, extra in enumerate(gate):
        graph.node.insert(index + 1 + i, extra)
