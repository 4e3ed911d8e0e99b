"""ONNX node groups that several function bodies share: the selection (spec's rule codes, rules' tie-break), the
query projection, the score head, constants and references to a function's attributes."""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto
from onnx import helper as H

from .spec import GROUP, PROJECTION, SCALE_CODES, STATIC, int8_scales


def ref_constant(name: str, attr: str, kind: str):
    """A Constant node whose value is the function's attribute ``attr`` (value_int / value_float)."""
    node = H.make_node("Constant", [], [name])
    node.attribute.append(AttributeProto(name=kind, ref_attr_name=attr, type=(
        AttributeProto.INT if kind == "value_int" else AttributeProto.FLOAT)))
    return node


def scale_table(name: str):
    """A Constant node holding spec.int8_scales(): the scale of each int8 row code, lowest code first."""
    table = int8_scales()
    value = H.make_tensor(name, TensorProto.FLOAT, [table.size], table.tolist())
    return H.make_node("Constant", [], [name], value=value)


def int8_value_nodes(rows: str, out: str, p: str, like: str, axis: int) -> list:
    """rows int8 whose last element along ``axis`` (-1: a V row; -2: K^'s dim-major code row) is the scale's code ->
    out, the values q s (s = spec.int8_scales()[c]) of ``like``'s type: ops.rules.int8_values."""
    n, lo = H.make_node, SCALE_CODES[0]
    return [
        const(p + "zero", [0]), const(p + "minus1", [-1]), const(p + "end", [2 ** 62]), const(p + "axis", [axis]),
        const(p + "bias", -lo), scale_table(p + "scales"),
        n("Slice", [rows, p + "zero", p + "minus1", p + "axis"], [p + "q"]),
        n("Slice", [rows, p + "minus1", p + "end", p + "axis"], [p + "c8"]),
        n("Cast", [p + "c8"], [p + "c"], to=7), n("Add", [p + "c", p + "bias"], [p + "at"]),
        n("Gather", [p + "scales", p + "at"], [p + "scale"], axis=0),
        n("Cast", [p + "q"], [p + "q_f"], to=TensorProto.FLOAT), n("Mul", [p + "q_f", p + "scale"], [p + "v"]),
        n("CastLike", [p + "v", like], [out]),
    ]


def const(name: str, value, kind=None):
    """A Constant node: an int (or list of ints) -> int64, a float -> float32, unless ``kind`` says."""
    kind = kind or (TensorProto.INT64 if isinstance(value, (int, list)) and not isinstance(value, bool) else
                    TensorProto.FLOAT)
    vals = value if isinstance(value, list) else [value]
    dims = [len(vals)] if isinstance(value, list) else []
    return H.make_node("Constant", [], [name], value=H.make_tensor(name, kind, dims, vals))


def selection_nodes(pooled: bool = False) -> list:
    """query_hat [B,Hkv,g,T,r] -> q_selected: the k coordinates the rule keeps, the others zeroed.

        score = |q^|  (rule 0)   |  ReduceSum over g of |q^|, expanded (rule 1)   |  r, r-1, ..., 1 (rule 2)
        TopK(score, k; ties -> lower index) --idx--> ScatterElements(1s into 0s) --> q^ * keep
    pooled (the node's head_prices; rules, pooled): rules 0 and 1 keep the layer's Hkv g' k best priced scores
    instead (pool_nodes); the static rule as above.
    """
    def scalar(name, value, kind=TensorProto.FLOAT):
        return H.make_node("Constant", [], [name], value=H.make_tensor(name, kind, [], [value]))

    return [
        ref_constant("k_scalar", "k", "value_int"), ref_constant("rule_scalar", "rule", "value_int"),
        H.make_node("Constant", [], ["shape_1"], value_ints=[1]),
        H.make_node("Reshape", ["k_scalar", "shape_1"], ["k_1d"]),
        H.make_node("Shape", ["query_hat"], ["q_shape"]),
        H.make_node("Abs", ["query_hat"], ["magnitude"]),
        H.make_node("Constant", [], ["axis_g"], value_ints=[2]),
        H.make_node("ReduceSum", ["magnitude", "axis_g"], ["group_sum"], keepdims=1),
        H.make_node("Expand", ["group_sum", "q_shape"], ["group_score"]),
        H.make_node("Shape", ["query_hat"], ["r_1d"], start=4, end=5),
        H.make_node("Squeeze", ["r_1d"], ["r_scalar"]),
        scalar("zero_i", 0, TensorProto.INT64), scalar("minus_one_i", -1, TensorProto.INT64),
        H.make_node("Range", ["r_scalar", "zero_i", "minus_one_i"], ["ramp_i"]),
        H.make_node("CastLike", ["ramp_i", "query_hat"], ["ramp"]),
        H.make_node("Expand", ["ramp", "q_shape"], ["static_score"]),
        scalar("rule_group", GROUP, TensorProto.INT64), scalar("rule_static", STATIC, TensorProto.INT64),
        H.make_node("Equal", ["rule_scalar", "rule_group"], ["is_group"]),
        H.make_node("Equal", ["rule_scalar", "rule_static"], ["is_static"]),
        H.make_node("Where", ["is_group", "group_score", "magnitude"], ["shared_or_own"]),
        H.make_node("Where", ["is_static", "static_score", "shared_or_own"], ["score"]),
        H.make_node("TopK", ["score", "k_1d"], ["top_values", "top_indices"], axis=-1, largest=1, sorted=1),
        scalar("zero", 0.0), H.make_node("CastLike", ["zero", "query_hat"], ["zero_t"]),
        H.make_node("Expand", ["zero_t", "q_shape"], ["zeros"]),
        H.make_node("Shape", ["top_indices"], ["i_shape"]),
        scalar("one", 1.0), H.make_node("CastLike", ["one", "query_hat"], ["one_t"]),
        H.make_node("Expand", ["one_t", "i_shape"], ["ones"]),
        H.make_node("ScatterElements", ["zeros", "top_indices", "ones"], ["keep"], axis=-1),
    ] + (pool_nodes() if pooled else []) + [
        H.make_node("Mul", ["query_hat", "pool_keep_t" if pooled else "keep"], ["q_selected"]),
    ]


def pool_nodes() -> list:
    """magnitude [B,Hkv,g,T,r], group_sum [B,Hkv,1,T,r], keep (the per-row selection), k_1d, the attribute
    head_prices [Hkv] -> pool_keep [B,Hkv,g,T,r] bool (what parity exposes) and pool_keep_t (as the query).

        priced = float32(score) * price[kv head]  --Transpose, Reshape--> [B, T, Hkv g' r] (the flat index order)
        TopK(Hkv g' k; ties -> lower index) --ScatterElements--> back to [B,Hkv,g',T,r]   (g' = g, or 1: rule 1)
        pool_keep = static ? keep : group ? expand(pooled over group_sum) : pooled over magnitude
    """
    n = H.make_node
    out = [n("Constant", [], ["pool_prices"]), const("pool_price_shape", [-1, 1, 1, 1]),
           n("Reshape", ["pool_prices", "pool_price_shape"], ["pool_price_col"]),
           const("pool_lead", [0, 0, -1])]
    out[0].attribute.append(AttributeProto(name="value_floats", ref_attr_name="head_prices",
                                           type=AttributeProto.FLOATS))
    for tag, score in (("h", "magnitude"), ("g", "group_sum")):
        x = f"pool_{tag}_"
        out += [
            n("Cast", [score], [x + "f"], to=TensorProto.FLOAT), n("Mul", [x + "f", "pool_price_col"], [x + "priced"]),
            n("Transpose", [x + "priced"], [x + "tr"], perm=[0, 3, 1, 2, 4]),  # [B, T, Hkv, g', r]
            n("Shape", [x + "tr"], [x + "shape"]), n("Reshape", [x + "tr", "pool_lead"], [x + "flat"]),
            n("Shape", [x + "tr"], [x + "hkv"], start=2, end=3), n("Shape", [x + "tr"], [x + "g"], start=3, end=4),
            n("Mul", [x + "hkv", x + "g"], [x + "rows"]), n("Mul", [x + "rows", "k_1d"], [x + "n"]),
            n("TopK", [x + "flat", x + "n"], [x + "top", x + "idx"], axis=-1, largest=1, sorted=1),
            n("Shape", [x + "flat"], [x + "flat_shape"]),
            n("ConstantOfShape", [x + "flat_shape"], [x + "zeros"],
              value=H.make_tensor(x + "z", TensorProto.FLOAT, [1], [0.0])),
            n("Shape", [x + "idx"], [x + "idx_shape"]),
            n("ConstantOfShape", [x + "idx_shape"], [x + "ones"],
              value=H.make_tensor(x + "o", TensorProto.FLOAT, [1], [1.0])),
            n("ScatterElements", [x + "zeros", x + "idx", x + "ones"], [x + "kept"], axis=-1),
            n("Reshape", [x + "kept", x + "shape"], [x + "kept_tr"]),
            n("Transpose", [x + "kept_tr"], [x + "keep"], perm=[0, 2, 3, 1, 4]),
        ]
    return out + [
        n("Expand", ["pool_g_keep", "q_shape"], ["pool_g_wide"]),
        n("Where", ["is_group", "pool_g_wide", "pool_h_keep"], ["pool_shared"]),
        n("CastLike", ["keep", "pool_shared"], ["pool_row_keep"]),
        n("Where", ["is_static", "pool_row_keep", "pool_shared"], ["pool_keep_f"]),
        n("Cast", ["pool_keep_f"], ["pool_keep"], to=TensorProto.BOOL),
        n("CastLike", ["pool_keep", "query_hat"], ["pool_keep_t"]),
    ]


def score_nodes(scores: str, pooled: bool = False, scaled: bool = False, keyed: bool = False) -> list:
    """query_hat, key_cache, total_length -> ``scores`` = q_selected @ K^[:, :, :, :total_length] (the head of the
    TopKGatherDot and AquaAttention bodies; pooled: selection_nodes'; scaled: an int8 cache, K^'s last dim-major
    row its scale codes; keyed: K^'s rows divided by the attribute key_weights [Hkv * r], key_cache_g then being
    k^ / w)."""
    return selection_nodes(pooled) + [
        H.make_node("Constant", [], ["axis_2"], value_ints=[2]),
        H.make_node("Constant", [], ["zero_1"], value_ints=[0]),
        H.make_node("Constant", [], ["axis_3"], value_ints=[3]),
        H.make_node("Slice", ["key_cache", "zero_1", "total_length", "axis_3"], ["key_cache_s"]),
    ] + (int8_value_nodes("key_cache_s", "key_cache_l", "kq_", "query_hat", -2) if scaled else [
        # a float16 cache under a float32 query (contract cache_dtype) widened; of the query's type, nothing
        # (ONNX Runtime drops a Cast to the type it has)
        H.make_node("CastLike", ["key_cache_s", "query_hat"], ["key_cache_l"])]) + _keyed_nodes() * keyed + [
        H.make_node("Unsqueeze", ["key_cache_w" if keyed else "key_cache_l", "axis_2"], ["key_cache_g"]),
        H.make_node("MatMul", ["q_selected", "key_cache_g"], [scores]),
    ]


def _keyed_nodes() -> list:
    """key_cache_l [B, Hkv, r, L], the attribute key_weights [Hkv * r] -> key_cache_w = key_cache_l / w[:, :, None]."""
    n = H.make_node
    weights = n("Constant", [], ["kw_flat"])
    weights.attribute.append(AttributeProto(name="value_floats", ref_attr_name="key_weights",
                                            type=AttributeProto.FLOATS))
    return [weights, const("kw_one", [1]), n("Shape", ["key_cache_l"], ["kw_hr"], start=1, end=3),
            n("Concat", ["kw_hr", "kw_one"], ["kw_shape"], axis=0), n("Reshape", ["kw_flat", "kw_shape"], ["kw_f"]),
            n("CastLike", ["kw_f", "key_cache_l"], ["kw"]), n("Div", ["key_cache_l", "kw"], ["key_cache_w"])]


def mask_nodes() -> list:
    """attention_mask [B, L], query_hat (its T), the attribute sliding_window -> mask [B, 1, 1, T, L] float32: 0 where
    the query at position p = L - T + t sees key j (j <= p, attention_mask 1, j > p - window when window > 0), the
    float32 minimum elsewhere (ops.rules.visible)."""
    n, f = H.make_node, TensorProto.FLOAT
    return [
        const("mk_zero", 0), const("mk_one", 1), const("mk_axis_0", [0]), const("mk_axis_1", [1]),
        const("mk_axes_12", [1, 2]), ref_constant("mk_window", "sliding_window", "value_int"),
        n("Shape", ["attention_mask"], ["mk_len_1d"], start=1, end=2), n("Squeeze", ["mk_len_1d"], ["mk_len"]),
        n("Shape", ["query_hat"], ["mk_t_1d"], start=3, end=4), n("Squeeze", ["mk_t_1d"], ["mk_t"]),
        n("Sub", ["mk_len", "mk_t"], ["mk_first"]),
        n("Range", ["mk_zero", "mk_len", "mk_one"], ["mk_j"]), n("Range", ["mk_first", "mk_len", "mk_one"], ["mk_p"]),
        n("Unsqueeze", ["mk_j", "mk_axis_0"], ["mk_j2"]), n("Unsqueeze", ["mk_p", "mk_axis_1"], ["mk_p2"]),
        n("LessOrEqual", ["mk_j2", "mk_p2"], ["mk_causal"]),  # [T, L]
        n("Sub", ["mk_p2", "mk_window"], ["mk_start"]), n("Greater", ["mk_j2", "mk_start"], ["mk_recent"]),
        n("Greater", ["mk_window", "mk_zero"], ["mk_windowed"]), n("Not", ["mk_windowed"], ["mk_unwindowed"]),
        n("Or", ["mk_recent", "mk_unwindowed"], ["mk_in_window"]),
        n("And", ["mk_causal", "mk_in_window"], ["mk_seen"]),
        n("Cast", ["attention_mask"], ["mk_real"], to=TensorProto.BOOL),
        n("Unsqueeze", ["mk_real", "mk_axis_1"], ["mk_real3"]),  # [B, 1, L]
        n("And", ["mk_seen", "mk_real3"], ["mk_ok"]),  # [B, T, L]
        H.make_node("Constant", [], ["mk_open"], value=H.make_tensor("mk_open", f, [], [0.0])),
        H.make_node("Constant", [], ["mk_shut"], value=H.make_tensor("mk_shut", f, [], [float(np.finfo(np.float32).min)])),
        n("Where", ["mk_ok", "mk_open", "mk_shut"], ["mk_add"]),
        n("Unsqueeze", ["mk_add", "mk_axes_12"], ["mask"]),
    ]


def projection_nodes() -> list:
    """query [B,Hkv,g,T,d], projection P [Hkv,d,r] -> query_hat = q P: the head of the attention bodies' projected
    form (AquaAttention, H2OAttention)."""
    return [H.make_node("Constant", [], ["proj_axis_1"], value_ints=[1]),
            H.make_node("Unsqueeze", [PROJECTION, "proj_axis_1"], ["projection_g"]),
            H.make_node("MatMul", ["query", "projection_g"], ["query_hat"])]
