"""Every custom op, in the order a graph carries their function bodies; what the export and the tests iterate."""

from __future__ import annotations

from . import (aqua_attention, cache_update, h2o_attention, logit_rows, matmul_q4a8, quantize_rows, topk_gather_dot,
               value_product)
from .table import OpDef

OPS: tuple[OpDef, ...] = (topk_gather_dot.OP, aqua_attention.OP, cache_update.KEY, cache_update.VALUE,
                          value_product.OP, h2o_attention.OP, logit_rows.OP, quantize_rows.OP, matmul_q4a8.OP,
                          matmul_q4a8.GATED)
BY_NAME = {op.name: op for op in OPS}


def register_schemas() -> None:
    """Every op's schema in ONNX's registry (checkers and shape inference then know the nodes)."""
    for op in OPS:
        op.register()


def function_bodies(opset: int, projected: bool = False, tokens: bool = False, pooled: bool = False,
                    scaled: bool = False, keyed: bool = False, prefill: bool = False) -> list:
    """Every op's body: a runtime without the native library runs these (projected: the attention nodes,
    AquaAttention or H2OAttention, take P; tokens: AquaAttention selects tokens; pooled: its heads share k, every
    AquaAttention node carrying head_prices; scaled: int8 caches; keyed: every AquaAttention node carries key_weights;
    prefill: sparse prefill; aqua_attention.body says why a graph carries one form)."""
    return [op.bodied(opset, projected, tokens=tokens, pooled=pooled, scaled=scaled, keyed=keyed, prefill=prefill)
            for op in OPS]
