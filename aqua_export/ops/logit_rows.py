"""LogitRows: the logits of a forward as [B, T, V] with only the rows generation reads computed (the graph's head
runs on those rows alone: a prompt's other positions cost neither the output layer's product nor its memory).

    rows [B, K, V]   index [B, K] int64 (positions in 0..T-1)   length [1] int64 (T)
        -> logits [B, T, V]: logits[b, index[b, k]] = rows[b, k]

The graph passes each sequence's last real token (K = 1), or every position when its all_logits input is 1
(perplexity, lm-eval, parity: K = T). The native kernel writes the K rows and leaves the others as the allocator
gave them: a prompt of 8,000 tokens and a 49,152-token vocabulary allocates 1.6 GB of logits (onnxruntime-genai
binds such a buffer itself) of which one row per sequence is touched, so the rest is never made resident. Those
rows are unspecified; the function body writes zeros there (ScatterND into zeros: the whole tensor).
"""

from __future__ import annotations

import torch
from onnx import TensorProto
from onnx import helper as H

from .nodes import const
from .spec import DOMAIN
from .table import ANY, OpDef, Port


def reference(rows: torch.Tensor, index: torch.Tensor, length) -> torch.Tensor:
    """The rows at their positions, zeros elsewhere (the body's choice for the unspecified rows)."""
    b, _, v = rows.shape
    out = torch.zeros(b, int(length), v, dtype=rows.dtype)
    out.scatter_(1, index.long()[..., None].expand(rows.shape), rows)
    return out


def body(opset: int, projected: bool = False):
    """zeros [B, T, V] --ScatterND(indices [B, K, 2] = (b, index[b, k]), rows)--> logits."""
    n = H.make_node
    nodes = [
        const("lr_zero", 0), const("lr_one", 1), const("lr_axis_2", [2]), const("lr_axis_1", [1]),
        n("Shape", ["rows"], ["lr_b"], start=0, end=1), n("Shape", ["rows"], ["lr_v"], start=2, end=3),
        n("Concat", ["lr_b", "length", "lr_v"], ["lr_shape"], axis=0),
        n("ConstantOfShape", ["lr_shape"], ["lr_zeros_f"], value=H.make_tensor("lr_z", TensorProto.FLOAT, [1], [0.0])),
        n("CastLike", ["lr_zeros_f", "rows"], ["lr_zeros"]),
        n("Squeeze", ["lr_b"], ["lr_b_s"]), n("Range", ["lr_zero", "lr_b_s", "lr_one"], ["lr_batch"]),
        n("Unsqueeze", ["lr_batch", "lr_axis_1"], ["lr_batch_col"]),  # [B, 1]
        n("Shape", ["index"], ["lr_index_shape"]), n("Expand", ["lr_batch_col", "lr_index_shape"], ["lr_batch_bk"]),
        n("Unsqueeze", ["lr_batch_bk", "lr_axis_2"], ["lr_b3"]), n("Unsqueeze", ["index", "lr_axis_2"], ["lr_i3"]),
        n("Concat", ["lr_b3", "lr_i3"], ["lr_at"], axis=2),  # [B, K, 2]
        n("ScatterND", ["lr_zeros", "lr_at", "rows"], ["logits"]),
    ]
    return H.make_function(DOMAIN, OP.name, ["rows", "index", "length"], ["logits"], nodes,
                           [H.make_opsetid("", opset)])


OP = OpDef("LogitRows", "logits [B, T, V] with rows[b, k] at position index[b, k]; the other rows unspecified",
           inputs=(Port("rows", rank=3), Port("index", "int64", 2), Port("length", "int64", 1)),
           outputs=(Port("logits", rank=3),), body=body, reference=reference,
           shape=lambda d: {"logits": d["rows"][:1] + [ANY] + d["rows"][2:]})
