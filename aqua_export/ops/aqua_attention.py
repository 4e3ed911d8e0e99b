"""AquaAttention: the fused attention node, one pass over the cache (native kernel plugins/ort/aqua_attention.cc,
Triton kernels/triton/aqua_attention.py).

    query_hat [B, Hkv, g, T, r] (or the query q [B, Hkv, g, T, d] and projection P [Hkv, d, r]: q^ = q P)
    key_cache [B, Hkv, r, C] (dim-major K^)   value_cache [B, Hkv, C, rv]   total_length [1]   mask [B|1, 1, 1, T, L]
        -> out [B, Hkv, g, T, rv] = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L]
"""

from __future__ import annotations

import torch
from onnx import TensorProto
from onnx import helper as H

from . import rules
from .nodes import projection_nodes, ref_constant, score_nodes
from .spec import DOMAIN, PROJECTION
from .table import PLUGIN_ATTRS, Attr, OpDef, Port
from .topk_gather_dot import K_ATTR, LENGTH, RULE_ATTR

SOFTCAP_ATTR = Attr("softcap", "float", "tanh soft-cap of the scores, 0 = none", required=False, default=0.0)


def reference(query_hat, key_cache, value_cache, total_length, mask, projection: torch.Tensor | None = None, *,
              k: int, rule: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The node in PyTorch, scores and softmax in float64; mask float32 (0 = attend, very negative = hidden).
    Returns [B, Hkv, g, T, rv] in query_hat's dtype."""
    total = int(total_length)
    if projection is not None:
        query_hat = query_hat @ projection[:, None].to(query_hat.dtype)
    s = (rules.keep_selected(query_hat, k, rule) @ key_cache[..., :total].unsqueeze(2)).to(torch.float64)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    w = torch.softmax(s + mask.to(torch.float64), dim=-1)
    return (w @ value_cache[:, :, None, :total].to(torch.float64)).to(query_hat.dtype)


def body(opset: int, projected: bool = False):
    """The portable body (materialises the [B,Hkv,g,T,L] scores the native kernel never writes).

        (projected: query --MatMul Unsqueeze(projection, 1)-->) query_hat --selection--> q_selected
        --MatMul K^[:, :L]--> scores --Cast float32--> softcap? --+ mask--> Softmax --CastLike--> MatMul V[:L] --> out

    An ONNX function cannot test whether an optional input is present, so a graph carries the body of the form
    its nodes use: every attention node of one graph projects, or none does (export.decoder_graph.Plan).
    """
    nodes = projection_nodes() * projected + score_nodes("scores_t") + [
        H.make_node("Cast", ["scores_t"], ["scores"], to=TensorProto.FLOAT),
        ref_constant("cap", "softcap", "value_float"),
        H.make_node("Div", ["scores", "cap"], ["scaled"]),
        H.make_node("Tanh", ["scaled"], ["squashed"]),
        H.make_node("Mul", ["squashed", "cap"], ["capped"]),
        H.make_node("Constant", [], ["zero_f"], value=H.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0])),
        H.make_node("Greater", ["cap", "zero_f"], ["has_cap"]),
        H.make_node("Where", ["has_cap", "capped", "scores"], ["logits_raw"]),
        H.make_node("Add", ["logits_raw", "mask"], ["logits"]),
        H.make_node("Softmax", ["logits"], ["probs_f"], axis=-1),
        H.make_node("CastLike", ["probs_f", "query_hat"], ["probs"]),
        H.make_node("Slice", ["value_cache", "zero_1", "total_length", "axis_2"], ["value_l"]),
        H.make_node("Unsqueeze", ["value_l", "axis_2"], ["value_g"]),
        H.make_node("MatMul", ["probs", "value_g"], ["out"]),
    ]
    inputs = ["query" if projected else "query_hat", *OP.input_names[1:]]
    return H.make_function(DOMAIN, OP.name, inputs + [PROJECTION] * projected, ["out"], nodes,
                           [H.make_opsetid("", opset)], attributes=OP.attribute_names)


OP = OpDef("AquaAttention",
           "out = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L], one pass over the cache; K^ dim-major",
           inputs=(Port("query_hat", rank=5), Port("key_cache"), Port("value_cache"), LENGTH,
                   Port("mask", "float", 5)),
           outputs=(Port("out", rank=5),), attributes=(K_ATTR, RULE_ATTR, SOFTCAP_ATTR, *PLUGIN_ATTRS),
           body=body, reference=reference, projectable=True)
