"""Exact weight folds (docs/design.md, What folds). Each takes and returns plain tensors and asserts shapes.

Notation: Hkv KV heads, H = g * Hkv query heads, d head_dim, D hidden size.
"""

from __future__ import annotations

import torch


def fold_value(weight: torch.Tensor, bias: torch.Tensor | None, p_v: torch.Tensor):
    """W_V [Hkv*d, D], b_V [Hkv*d], P_v [Hkv, d, d] -> (W_V', b_V') producing v' = P_v^T v per KV head."""
    hkv, d, d2 = p_v.shape
    assert d == d2 and weight.shape[0] == hkv * d, (weight.shape, p_v.shape)
    w = weight.reshape(hkv, d, -1)
    w2 = (p_v.transpose(1, 2).to(w.dtype) @ w).reshape(hkv * d, -1)
    b2 = None
    if bias is not None:
        assert bias.shape == (hkv * d,), bias.shape
        b2 = (p_v.transpose(1, 2).to(bias.dtype) @ bias.reshape(hkv, d, 1)).reshape(hkv * d)
    return w2, b2


def fold_output(weight: torch.Tensor, p_v: torch.Tensor, group: int) -> torch.Tensor:
    """W_O [D, H*d], P_v [Hkv, d, d], g -> W_O' taking per-head inputs in P_v's basis (o = W_O' (P_v^T a))."""
    hkv, d, _ = p_v.shape
    out_dim, in_dim = weight.shape
    assert in_dim == hkv * group * d, (weight.shape, p_v.shape, group)
    w = weight.reshape(out_dim, hkv, group, d)
    # W_O[:, head] @ P_v[kv(head)]: columns of the folded block act on P_v-basis coordinates.
    w2 = torch.einsum("ohgd,hde->ohge", w, p_v.to(w.dtype))
    return w2.reshape(out_dim, in_dim)


def fold_scale_into_query(weight: torch.Tensor, bias: torch.Tensor | None, scale: float):
    """W_Q [H*d, D] -> scale * W_Q: RoPE is linear, so scaling before or after it is the same."""
    return weight * scale, (bias * scale if bias is not None else None)
