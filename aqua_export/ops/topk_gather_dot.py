"""TopKGatherDot: the selected scores, q^[I] . K^[I, :L] per query row (TensorRT builds keep attention's scores,
softmax and value product as separate nodes; the fused node is aqua_attention).

    query_hat [B, Hkv, g, T, r]   key_cache [B, Hkv, r, S] (dim-major K^)   total_length [1]
        -> scores [B, Hkv, g, T, L]   (I: the rule's k coordinates of each row, rules.keep_selected)
"""

from __future__ import annotations

import torch
from onnx import helper as H

from . import rules
from .nodes import score_nodes
from .spec import DOMAIN, MAGNITUDE, RULE_DOC
from .table import ANY, PLUGIN_ATTRS, Attr, OpDef, Port

K_ATTR = Attr("k", "int", "coordinates kept per query")
RULE_ATTR = Attr("rule", "int", RULE_DOC, required=False, default=MAGNITUDE)
LENGTH = Port("total_length", "int64", 1)


def reference(query_hat: torch.Tensor, key_cache: torch.Tensor, total_length=None, *, k: int,
              rule: int = 0) -> torch.Tensor:
    """scores = q^[I] . K^[I, :L] (L = total_length, all of S when None), in query_hat's dtype."""
    length = key_cache.shape[-1] if total_length is None else int(total_length)
    return rules.keep_selected(query_hat, k, rule) @ key_cache[..., :length].unsqueeze(2)


def body(opset: int, projected: bool = False):
    """The portable body as an ONNX local function of standard ops (never projected).

        query_hat --selection (rule, k)--> q_selected --MatMul--> Unsqueeze(Slice(key_cache, :total_length), 2)
    """
    return H.make_function(DOMAIN, OP.name, list(OP.input_names), ["scores"], score_nodes("scores"),
                           [H.make_opsetid("", opset)], attributes=OP.attribute_names)


OP = OpDef("TopKGatherDot",
           "scores = q^[I] . K^[I, :L] with I = top-k |q^| per query row (ties: lower index); K^ dim-major",
           inputs=(Port("query_hat", rank=5), Port("key_cache"), LENGTH), outputs=(Port("scores", rank=5),),
           attributes=(K_ATTR, RULE_ATTR, *PLUGIN_ATTRS), body=body, reference=reference,
           shape=lambda d: {"scores": d["query_hat"][:4] + [ANY]})
