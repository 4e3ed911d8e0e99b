"""Exact weight folds (docs/design.md, What folds). Each takes and returns plain tensors and asserts shapes.

Notation: Hkv KV heads, H = g * Hkv query heads, d head_dim, D hidden size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import AquaConfig
from .projection import Projection


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


def attention_projections(w: dict, P: tuple, P_v: torch.Tensor, scaling: float, heads: int, rv: int,
                          rotary: bool) -> dict:
    """A layer's attention projections as the export's linear layers compute them, in float32:
    {"q" | "k" | "v": (W [out, D], b or None), "o": (W_O' [D, heads * rv], None)}.

    w: the layer's tensors by role (Adapter.layer_weights); P: Bases (selection_bases);
    P_v [Hkv, d, d]. The attention scale goes into W_Q, or into q_norm's weight when a norm follows W_Q (it would
    undo it: decoder_graph applies it there); v is P_v^T v sliced to rv per KV head, W_O takes those inputs; without
    a rotary embedding P_q / P_k fold into W_Q / W_K too (q^, k^ come out of the projections, r wide)."""
    f32 = {k: (None if v is None else v.to(torch.float32)) for k, v in w.items()
           if k.startswith(("q_proj", "k_proj", "v_proj", "o_proj"))}
    hkv, d, _ = P_v.shape
    g = heads // hkv
    wq, bq = (f32["q_proj"], f32.get("q_proj_bias")) if "q_norm" in w else \
        fold_scale_into_query(f32["q_proj"], f32.get("q_proj_bias"), scaling)
    wk, bk = f32["k_proj"], f32.get("k_proj_bias")
    wv, bv = fold_value(f32["v_proj"], f32.get("v_proj_bias"), P_v)
    keep_v = torch.arange(hkv * d).reshape(hkv, d)[:, :rv].reshape(-1)
    wo = fold_output(f32["o_proj"], P_v, g)[:, torch.arange(heads * d).reshape(heads, d)[:, :rv].reshape(-1)]
    if not rotary:
        P_q, P_k = P.query.to(torch.float32), P.key.to(torch.float32)
        r = P_q.shape[-1]
        bq = None if bq is None else torch.einsum("kdr,kgd->kgr", P_q, bq.reshape(hkv, g, d)).reshape(-1)
        wq = torch.einsum("kdr,kgdD->kgrD", P_q, wq.reshape(hkv, g, d, -1)).reshape(hkv * g * r, -1)
        bk = None if bk is None else torch.einsum("kdr,kd->kr", P_k, bk.reshape(hkv, d)).reshape(-1)
        wk = torch.einsum("kdr,kdD->krD", P_k, wk.reshape(hkv, d, -1)).reshape(hkv * r, -1)
    return {"q": (wq, bq), "k": (wk, bk), "v": (wv[keep_v], None if bv is None else bv[keep_v]), "o": (wo, None)}


# What a weighted rule's int8 cache holds: k^ / w^INT8_KEY_SPLIT, the node dividing those rows by w^(1 - split) (its
# key_weights) so that it scores k^ / w as the float caches' fold does. 1 would be that fold (K^'s coordinates evened
# out before the one scale per token), 0 k^ itself. The embedded model's int4 token folder against its float32
# cache (docs/reference.md): 512-token windows +0.35% / +0.52% / -0.00% and an 8k window +2.35% / +0.26% / +0.32%
# for 1 / 0 / 0.5.
INT8_KEY_SPLIT = 0.5


class Bases(NamedTuple):
    """What a layer's attention folds in: query [Hkv, d, r] and key [Hkv, d, r] bases, and key_weights [Hkv, r], the
    factor AquaAttention divides K^'s rows by (None: the cache holds what the node scores with)."""
    query: torch.Tensor
    key: torch.Tensor
    key_weights: torch.Tensor | None = None


def selection_bases(P: torch.Tensor, key_rms: torch.Tensor, r: int, config: AquaConfig,
                    cache_dtype: str = "float32") -> Bases:
    """P [Hkv, d, d], key_rms [Hkv, d] -> Bases, each basis [Hkv, d, r].

    The weighted rules rank |q^_i| * w_i with w = rms(k^_i). Scaling q^ by w and k^ by 1/w leaves every
    score q^ . k^ (and any subset of its terms) unchanged and turns that rank into plain |q^'_i|, so the
    nodes and kernels only know magnitude and group rules; a float cache then holds k^ / w. An int8 cache holds
    k^ / w^INT8_KEY_SPLIT and the node's key_weights w^(1 - split) bring it to k^ / w: its one scale per token then
    spends its codes closer to where q^ . k^ has its energy (INT8_KEY_SPLIT's figures). w is floored at 1e-6 of its
    largest value so a dead coordinate does not divide by zero (such a coordinate is never selected by the rule
    anyway).
    """
    P_r = P[:, :, :r].to(torch.float32)
    if not config.weighted_selection:
        return Bases(P_r, P_r)
    w = selection_weights(key_rms, r)
    if cache_dtype == "int8":
        return Bases(P_r * w[:, None, :], P_r / w[:, None, :] ** INT8_KEY_SPLIT, w ** (1 - INT8_KEY_SPLIT))
    return Bases(P_r * w[:, None, :], P_r / w[:, None, :])


def selection_weights(key_rms: torch.Tensor, r: int) -> torch.Tensor:
    """key_rms [Hkv, d] -> w [Hkv, r] (float32): the weighted rules' factor per coordinate, floored at 1e-6 of its
    largest value (selection_bases)."""
    w = key_rms[:, :r].to(torch.float32)
    return torch.maximum(w, 1e-6 * w.amax(-1, keepdim=True))


def layer_bases(projection: Projection, config: AquaConfig, contract, i: int, head_dim: int) -> tuple:
    """(Bases, P_v) that layer i of an export (its contract.Contract) folds in: the
    calibrated ones, or the identity when nothing is selected or sliced (at k = r without slicing P and P_v cancel exactly, so the dense graph has no
    projection MatMul and its weights are the checkpoint's)."""
    ct = contract
    if ct.selected == ct.widths == ct.value_widths == (head_dim,) * ct.layers:
        eye = torch.eye(head_dim).expand(ct.kv_heads, head_dim, head_dim)
        return Bases(eye, eye), eye
    return (selection_bases(projection.P[i], projection.key_rms[i], ct.widths[i], config, ct.cache_dtype),
            projection.P_v[i])
