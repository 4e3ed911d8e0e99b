"""KeyCacheUpdate and ValueCacheUpdate: the new tokens written into a cache buffer (in place when past and present
are one buffer: the native kernels; the function body copies).

    past [B, Hkv, C, r] (keys: memory dim-major [B, Hkv, r, C])   new [B, Hkv, S, r]   total_length [1]
        -> present [B, Hkv, max(C, L), r] = past with new at slots L-S .. L-1
"""

from __future__ import annotations

import torch
from onnx import helper as H

from .spec import DOMAIN
from .table import ANY, OpDef, Port
from .topk_gather_dot import LENGTH


def _reference(key: bool):
    def reference(past: torch.Tensor, new: torch.Tensor, total_length) -> torch.Tensor:
        """present as the node writes it, declared [B, Hkv, max(C, L), r] (keys: that shape over dim-major memory)."""
        b, h, c, r = past.shape
        total, s = int(total_length), new.shape[2]
        slots = max(c, total)
        if key:
            mem = torch.zeros(b, h, r, slots, dtype=past.dtype)
            mem[..., :c] = past.reshape(b, h, r, c)
            mem[..., total - s:total] = new.transpose(-1, -2)
            return mem.reshape(b, h, slots, r)
        out = torch.zeros(b, h, slots, r, dtype=past.dtype)
        out[:, :, :c] = past
        out[:, :, total - s:total] = new
        return out
    return reference


def _body(op: str):
    key = op == "KeyCacheUpdate"

    def body(opset: int, projected: bool = False):
        """The portable body (copies the past: O(C) per step, where the native kernel writes in place).

            past [B,H,C,r] --(keys: Reshape to the dim-major [B,H,r,C])--> Slice(slots :L-S) --Concat(new)-->
            Pad(zeros to max(C, L) slots) --Reshape [B,H,max(C,L),r]--> present
        """
        ax = 3 if key else 2  # the slot axis of the memory layout
        n = [
            H.make_node("Shape", ["past"], ["shape"]),
            H.make_node("Shape", ["past"], ["bh"], start=0, end=2),
            H.make_node("Shape", ["past"], ["c"], start=2, end=3),
            H.make_node("Shape", ["past"], ["r"], start=3, end=4),
            H.make_node("Shape", ["new"], ["s"], start=2, end=3),
            H.make_node("Sub", ["total_length", "s"], ["p"]),
            H.make_node("Constant", [], ["zero_1"], value_ints=[0]),
            H.make_node("Constant", [], ["axis"], value_ints=[ax]),
            H.make_node("Constant", [], ["tail_len"], value_ints=[3 - ax]),
            H.make_node("Max", ["c", "total_length"], ["out_len"]),
            H.make_node("Sub", ["out_len", "total_length"], ["extra"]),
        ]
        if key:
            n += [H.make_node("Concat", ["bh", "r", "c"], ["rows_shape"], axis=0),
                  H.make_node("Reshape", ["past", "rows_shape"], ["memory"], allowzero=1),  # an empty past: C = 0
                  H.make_node("Transpose", ["new"], ["fresh"], perm=[0, 1, 3, 2])]
        else:
            n += [H.make_node("Identity", ["past"], ["memory"]), H.make_node("Identity", ["new"], ["fresh"])]
        n += [
            H.make_node("Slice", ["memory", "zero_1", "p", "axis"], ["old"]),
            H.make_node("Concat", ["old", "fresh"], ["joined"], axis=ax),
            H.make_node("Constant", [], ["pads_head"], value_ints=[0] * (4 + ax)),  # begins, then ends to the slot axis
            H.make_node("Constant", [], ["pads_tail"], value_ints=[0] * (3 - ax + 1)),
            H.make_node("Slice", ["pads_tail", "zero_1", "tail_len"], ["pads_tail_n"]),
            H.make_node("Concat", ["pads_head", "extra", "pads_tail_n"], ["pads"], axis=0),
            H.make_node("Pad", ["joined", "pads"], ["padded"]),
            # keys: back to the declared shape; values: the same shape, said again, so that shape inference (which
            # cannot follow Pad's computed pads) knows present's B, Hkv and r from the past's
            H.make_node("Concat", ["bh", "out_len", "r"], ["out_shape"], axis=0),
            H.make_node("Reshape", ["padded", "out_shape"], ["present"], allowzero=1),
        ]
        return H.make_function(DOMAIN, op, ["past", "new", "total_length"], ["present"], n, [H.make_opsetid("", opset)])
    return body


def _op(name: str, layout: str) -> OpDef:
    return OpDef(name, f"present = past with new written at slots L-S..L-1, max(C, L) slots; memory {layout}",
                 inputs=(Port("past", "C"), Port("new", "C"), LENGTH), outputs=(Port("present", "C"),),
                 body=_body(name), reference=_reference(name == "KeyCacheUpdate"),
                 shape=lambda d: {"present": d["past"][:2] + [ANY] + d["past"][3:]})


KEY = _op("KeyCacheUpdate", "dim-major [r, C] per head")
VALUE = _op("ValueCacheUpdate", "token-major [C, r] per head")
