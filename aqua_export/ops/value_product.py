"""ValueProduct: the value product of TensorRT builds' separate attention nodes, reading the filled slots in place.

    probs [B, Hkv, g, T, L]   value_cache [B, Hkv, C, rv] (C >= L)   ->   out [B, Hkv, g, T, rv] = probs @ V[:L]
"""

from __future__ import annotations

import torch
from onnx import helper as H

from .spec import DOMAIN
from .table import OpDef, Port


def reference(probs: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    """probs @ V[:, :, :L] in float64, in probs' dtype."""
    length = probs.shape[-1]
    return (probs.double() @ value_cache[:, :, None, :length].double()).to(probs.dtype)


def body(opset: int, projected: bool = False):
    """The portable body: Slice the L filled slots (a copy), Unsqueeze, MatMul."""
    n = [H.make_node("Shape", ["probs"], ["len"], start=4, end=5),
         H.make_node("Constant", [], ["zero_1"], value_ints=[0]),
         H.make_node("Constant", [], ["axis_2"], value_ints=[2]),
         H.make_node("Slice", ["value_cache", "zero_1", "len", "axis_2"], ["filled"]),
         H.make_node("Unsqueeze", ["filled", "axis_2"], ["filled_g"]),
         H.make_node("MatMul", ["probs", "filled_g"], ["out"])]
    return H.make_function(DOMAIN, OP.name, ["probs", "value_cache"], ["out"], n, [H.make_opsetid("", opset)])


OP = OpDef("ValueProduct", "out = probs @ value_cache[:, :, :L] with L = probs.shape[4]: the filled slots read in place",
           inputs=(Port("probs", rank=5), Port("value_cache")), outputs=(Port("out", rank=5),),
           body=body, reference=reference, shape=lambda d: {"out": d["probs"][:4] + d["value_cache"][3:]})
