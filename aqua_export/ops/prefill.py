"""Sparse prefill on AquaAttention (attributes prefill_threshold < 1, prefill_stride, prefill_k_ratio; the rule is
ops.rules.prefill_chosen): the node's attributes, the choice as the reference node makes it, and the function body's
nodes (a masked dense product). The native kernel (plugins/ort/aqua_prompt.cc choose_blocks) skips the blocks' products
instead; the Triton kernels walk each query block's kept pages (kernels/triton/prefill.py)."""

from __future__ import annotations

import math

import torch
from onnx import TensorProto
from onnx import helper as H

from . import rules
from .nodes import const, ref_constant
from .spec import MAGNITUDE, PREFILL_BLOCK, PREFILL_TAIL
from .table import Attr

ATTRS = (Attr("prefill_threshold", "float", "sparse prefill: estimated mass each prompt block's kept key blocks reach",
              required=False),
         Attr("prefill_stride", "int", "sparse prefill: every this many rows estimate", required=False),
         Attr("prefill_k_ratio", "float", "sparse prefill: share of r the estimate scores with", required=False))


def choice(query_hat, keys, mask, attention_mask, softcap, threshold, stride, k_ratio) -> torch.Tensor:
    """Sparse prefill's choice (rules.prefill_chosen) as the node makes it: query_hat [B, Hkv, g, T, r], keys
    [B, Hkv, 1, r, L] (as scored), mask [B, 1|Hkv, 1, T, L] (additive) -> [B, Hkv, T, L] bool."""
    b, hkv, g, t, r = query_hat.shape
    length = keys.shape[-1]
    est = (rules.keep_selected(query_hat.double(), rules.estimate_k(r, k_ratio), MAGNITUDE) @ keys.double())
    if softcap:
        est = torch.tanh(est / softcap) * softcap
    visible = (mask[:, :, 0] > rules.MASKED).expand(b, hkv, t, length)
    real = torch.as_tensor(attention_mask).bool()[:, length - t:].expand(b, t)
    return rules.prefill_chosen(est, visible, real, torch.arange(length - t, length), length - t, length, threshold,
                                stride)


def nodes() -> list:
    """query_hat, magnitude, r_scalar, key_cache_g, mask [B,1,1,T,L], the mask nodes' positions -> pf_mask
    [B,Hkv,1,T,L]: mask with the unkept key blocks of each sparse row hidden (rules.prefill_chosen).

        est = softcap(q^[top k' of |q^|] . K^)   p = softmax over the visible keys (0 where none)
        sampled [B,T] = sparse row, p mod stride = stride - 1, real   onehot [T,NB]: each row's query block
        mass [B,Hkv,NBq,NBk] = onehot^T (sum_g p * sampled, summed per key block) / (sampled rows of the block * g)
        forced = diagonal | first block a sampled row sees   order = TopK(forced ? inf : mass)
        kept = forced | mass before it in that order < threshold - 1e-6 (| no row sampled)
    """
    n, c = H.make_node, const
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    return [
        # the estimate's coordinates: k' = clamp(floor(ratio r + 0.5), 1, r) of |q^|
        ref_constant("pf_ratio", "prefill_k_ratio", "value_float"), ref_constant("pf_threshold", "prefill_threshold",
                                                                               "value_float"),
        ref_constant("pf_stride", "prefill_stride", "value_int"),
        c("pf_half", 0.5, TensorProto.DOUBLE), c("pf_one", 1), c("pf_zero", 0), c("pf_block", PREFILL_BLOCK),
        c("pf_tail", PREFILL_TAIL),
        c("pf_one_1d", [1]), c("pf_axis_g", [2]), c("pf_axes_13", [1, 3]), c("pf_last", [-1]), c("pf_last_s", -1),
        c("pf_axis_1", [1]),
        c("pf_slack", 1e-6), c("pf_masked", rules.MASKED, f), c("pf_neg_inf", -math.inf, f),
        c("pf_pos_inf", math.inf, f), c("pf_hidden", rules.HIDDEN, f), c("pf_zero_f", 0.0), c("pf_one_f", 1.0),
        c("pf_block_1d", [PREFILL_BLOCK]),
        # in double, as rules.estimate_k and the kernel round it
        n("Cast", ["r_scalar"], ["pf_r_d"], to=TensorProto.DOUBLE), n("Cast", ["pf_ratio"], ["pf_ratio_d"],
                                                                     to=TensorProto.DOUBLE),
        n("Mul", ["pf_ratio_d", "pf_r_d"], ["pf_rk"]), n("Add", ["pf_rk", "pf_half"], ["pf_rk_h"]),
        n("Floor", ["pf_rk_h"], ["pf_rk_fl"]),
        n("Cast", ["pf_rk_fl"], ["pf_k_raw"], to=i64), n("Max", ["pf_k_raw", "pf_one"], ["pf_k_lo"]),
        n("Min", ["pf_k_lo", "r_scalar"], ["pf_k"]), n("Reshape", ["pf_k", "shape_1"], ["pf_k_1d"]),
        n("TopK", ["magnitude", "pf_k_1d"], ["pf_top", "pf_idx"], axis=-1, largest=1, sorted=1),
        n("Shape", ["pf_idx"], ["pf_idx_shape"]), n("Expand", ["one_t", "pf_idx_shape"], ["pf_ones"]),
        n("ScatterElements", ["zeros", "pf_idx", "pf_ones"], ["pf_keep"], axis=-1),
        n("Mul", ["query_hat", "pf_keep"], ["pf_q"]),
        n("MatMul", ["pf_q", "key_cache_g"], ["pf_est_t"]), n("Cast", ["pf_est_t"], ["pf_est"], to=f),
        n("Div", ["pf_est", "cap"], ["pf_est_scaled"]), n("Tanh", ["pf_est_scaled"], ["pf_est_squashed"]),
        n("Mul", ["pf_est_squashed", "cap"], ["pf_est_capped"]),
        n("Where", ["has_cap", "pf_est_capped", "pf_est"], ["pf_est_c"]),
        # each row's softmax over its visible keys, summed over the g heads
        n("Greater", ["mask", "pf_masked"], ["pf_visible"]),
        n("Where", ["pf_visible", "pf_est_c", "pf_neg_inf"], ["pf_est_v"]),
        n("Softmax", ["pf_est_v"], ["pf_p_raw"], axis=-1),
        n("Where", ["pf_visible", "pf_p_raw", "pf_zero_f"], ["pf_p"]),
        n("ReduceSum", ["pf_p", "pf_axis_g"], ["pf_p_sum"], keepdims=0),  # [B, Hkv, T, L]
        # the sparse rows (whole query blocks inside the call, before its last rows) and the sampled ones
        n("Div", ["mk_p", "pf_block"], ["pf_qb"]), n("Mul", ["pf_qb", "pf_block"], ["pf_qb_first"]),
        n("GreaterOrEqual", ["pf_qb_first", "mk_first"], ["pf_inside"]),
        n("Add", ["pf_qb_first", "pf_block"], ["pf_qb_end"]), n("Sub", ["mk_len", "pf_tail"], ["pf_tail_at"]),
        n("LessOrEqual", ["pf_qb_end", "pf_tail_at"], ["pf_before_tail"]),
        n("And", ["pf_inside", "pf_before_tail"], ["pf_sparse"]),  # [T]
        n("Mod", ["mk_p", "pf_stride"], ["pf_phase"]), n("Sub", ["pf_stride", "pf_one"], ["pf_stride_less"]),
        n("Equal", ["pf_phase", "pf_stride_less"], ["pf_on_stride"]),
        n("And", ["pf_sparse", "pf_on_stride"], ["pf_sample_t"]),
        n("Gather", ["mk_real", "mk_p"], ["pf_real"], axis=1),  # [B, T]
        n("And", ["pf_real", "pf_sample_t"], ["pf_sampled"]), n("Cast", ["pf_sampled"], ["pf_sampled_f"], to=f),
        # per key block (L padded to NB blocks) and per query block (onehot)
        n("Shape", ["pf_p_sum"], ["pf_len_1d"], start=3, end=4),
        n("Mod", ["pf_len_1d", "pf_block_1d"], ["pf_len_mod"]), n("Sub", ["pf_block_1d", "pf_len_mod"], ["pf_short"]),
        n("Mod", ["pf_short", "pf_block_1d"], ["pf_pad"]),
        n("Add", ["pf_len_1d", "pf_pad"], ["pf_len_p"]), n("Div", ["pf_len_p", "pf_block_1d"], ["pf_nb_1d"]),
        n("Squeeze", ["pf_nb_1d"], ["pf_nb"]), n("Range", ["pf_zero", "pf_nb", "pf_one"], ["pf_blocks"]),
        c("pf_pads_lead", [0, 0, 0, 0, 0, 0, 0]), n("Concat", ["pf_pads_lead", "pf_pad"], ["pf_pads"], axis=0),
        n("Unsqueeze", ["pf_sampled_f", "pf_axes_13"], ["pf_sampled_4"]),  # [B, 1, T, 1]
        n("Mul", ["pf_p_sum", "pf_sampled_4"], ["pf_p_s"]),
        n("Pad", ["pf_p_s", "pf_pads"], ["pf_p_pad"]),
        n("Shape", ["pf_p_s"], ["pf_lead"], start=0, end=3),
        n("Concat", ["pf_lead", "pf_nb_1d", "pf_block_1d"], ["pf_kb_shape"], axis=0),
        n("Reshape", ["pf_p_pad", "pf_kb_shape"], ["pf_p_kb"]),
        n("ReduceSum", ["pf_p_kb", "pf_last"], ["pf_per_row"], keepdims=0),  # [B, Hkv, T, NB]
        n("Unsqueeze", ["pf_qb", "pf_one_1d"], ["pf_qb_col"]),
        n("Equal", ["pf_qb_col", "pf_blocks"], ["pf_onehot_b"]), n("Cast", ["pf_onehot_b"], ["pf_onehot"], to=f),
        n("Transpose", ["pf_onehot"], ["pf_onehot_t"], perm=[1, 0]),  # [NB, T]
        n("MatMul", ["pf_onehot_t", "pf_per_row"], ["pf_mass_sum"]),  # [B, Hkv, NBq, NBk]
        n("MatMul", ["pf_sampled_f", "pf_onehot"], ["pf_rows"]),  # [B, NBq]
        n("Shape", ["query_hat"], ["pf_g_1d"], start=2, end=3), n("Cast", ["pf_g_1d"], ["pf_g_f"], to=f),
        n("Mul", ["pf_rows", "pf_g_f"], ["pf_count"]), n("Max", ["pf_count", "pf_one_f"], ["pf_count_c"]),
        n("Unsqueeze", ["pf_count_c", "pf_axes_13"], ["pf_count_4"]),
        n("Div", ["pf_mass_sum", "pf_count_4"], ["pf_mass"]),
        # the first block a sampled row sees: the sink
        n("Squeeze", ["pf_visible", "pf_axis_g"], ["pf_vis_4"]),  # [B, 1, T, L]
        n("Cast", ["pf_vis_4"], ["pf_vis_f"], to=f), n("Mul", ["pf_vis_f", "pf_sampled_4"], ["pf_vis_s"]),
        n("Pad", ["pf_vis_s", "pf_pads"], ["pf_vis_pad"]),
        n("Shape", ["pf_vis_s"], ["pf_vlead"], start=0, end=3),
        n("Concat", ["pf_vlead", "pf_nb_1d", "pf_block_1d"], ["pf_vkb_shape"], axis=0),
        n("Reshape", ["pf_vis_pad", "pf_vkb_shape"], ["pf_vis_kb"]),
        n("ReduceMax", ["pf_vis_kb", "pf_last"], ["pf_vis_row"], keepdims=0),
        n("MatMul", ["pf_onehot_t", "pf_vis_row"], ["pf_seen"]),  # [B, 1, NBq, NBk]: > 0 where seen
        n("Greater", ["pf_seen", "pf_zero_f"], ["pf_seen_b"]), n("Cast", ["pf_seen_b"], ["pf_seen_f"], to=f),
        n("ArgMax", ["pf_seen_f"], ["pf_sink"], axis=-1, keepdims=1),
        n("Unsqueeze", ["pf_blocks", "pf_one_1d"], ["pf_blocks_col"]),
        n("Equal", ["pf_blocks_col", "pf_blocks"], ["pf_diagonal"]),
        n("Equal", ["pf_blocks", "pf_sink"], ["pf_at_sink"]),
        n("Or", ["pf_diagonal", "pf_at_sink"], ["pf_forced_b"]),  # [B, 1, NBq, NBk]
        # blocks by mass, forced first; kept while the mass before each is below the threshold
        n("Shape", ["pf_mass"], ["pf_mass_shape"]), n("Expand", ["pf_forced_b", "pf_mass_shape"], ["pf_forced"]),
        n("Where", ["pf_forced", "pf_pos_inf", "pf_mass"], ["pf_key"]),
        n("TopK", ["pf_key", "pf_nb_1d"], ["pf_key_top", "pf_order"], axis=-1, largest=1, sorted=1),
        n("GatherElements", ["pf_mass", "pf_order"], ["pf_ranked"], axis=-1),
        n("CumSum", ["pf_ranked", "pf_last_s"], ["pf_before"], exclusive=1),  # axis: rank 0, as ONNX says
        n("Sub", ["pf_threshold", "pf_slack"], ["pf_bar"]), n("Less", ["pf_before", "pf_bar"], ["pf_under"]),
        n("GatherElements", ["pf_forced", "pf_order"], ["pf_forced_ranked"], axis=-1),
        n("Or", ["pf_under", "pf_forced_ranked"], ["pf_take"]), n("Cast", ["pf_take"], ["pf_take_f"], to=f),
        n("ConstantOfShape", ["pf_mass_shape"], ["pf_zeros"], value=H.make_tensor("pf_z", f, [1], [0.0])),
        n("ScatterElements", ["pf_zeros", "pf_order", "pf_take_f"], ["pf_kept_f"], axis=-1),
        n("Greater", ["pf_kept_f", "pf_zero_f"], ["pf_kept_b"]),
        n("Equal", ["pf_rows", "pf_zero_f"], ["pf_unsampled"]),
        n("Unsqueeze", ["pf_unsampled", "pf_axes_13"], ["pf_unsampled_4"]),
        n("Or", ["pf_kept_b", "pf_unsampled_4"], ["pf_kept"]),  # [B, Hkv, NBq, NBk]
        # back to rows and slots; the dense rows keep everything
        n("Gather", ["pf_kept", "pf_qb"], ["pf_row_blocks"], axis=2),  # [B, Hkv, T, NBk]
        n("Squeeze", ["pf_len_1d"], ["pf_len"]), n("Range", ["pf_zero", "pf_len", "pf_one"], ["pf_slots"]),
        n("Div", ["pf_slots", "pf_block"], ["pf_kb"]),
        n("Gather", ["pf_row_blocks", "pf_kb"], ["pf_row_keys"], axis=3),  # [B, Hkv, T, L]
        n("Not", ["pf_sparse"], ["pf_dense"]), n("Unsqueeze", ["pf_dense", "pf_one_1d"], ["pf_dense_col"]),
        n("Or", ["pf_row_keys", "pf_dense_col"], ["pf_keep_rows"]),
        n("Unsqueeze", ["pf_keep_rows", "pf_axis_g"], ["pf_keep_5"]),
        n("Where", ["pf_keep_5", "mask", "pf_hidden"], ["pf_mask"]),
    ]
