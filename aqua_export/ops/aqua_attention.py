"""AquaAttention: the fused attention node, one pass over the cache (native kernel plugins/ort/aqua_attention.cc,
Triton kernels/triton/aqua_attention.py).

    query_hat [B, Hkv, g, T, r] (or the query q [B, Hkv, g, T, d] and projection P [Hkv, d, r]: q^ = q P)
    key_cache [B, Hkv, r, C] (dim-major K^)   value_cache [B, Hkv, C, rv]   total_length [1]   attention_mask [B, L]
    (both caches of the query's float type, or float16 under a float32 query: the contract's cache_dtype)
        -> out [B, Hkv, g, T, rv] = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L]
    mask: the query at position p = L - T + t sees key j <= p with attention_mask 1 (and j > p - sliding_window
    when that attribute is > 0): ops.rules.visible. The node reads the [B, L] mask, never a [T, L] tensor.

Token selection (attributes token_ratio < 1 or token_budget > 0; ops.rules): a decode step (T = 1) scores pages with
q^[I] . K^[I, :L], keeps the pages rules.select_pages chooses and attends over their tokens with all r coordinates;
a prompt (T > 1) attends every token with all r coordinates. A graph of token selection carries that form of the
body (body(tokens=True)), every other graph the plain one.

Sparse prefill (attributes prefill_threshold < 1, prefill_stride, prefill_k_ratio; ops.rules.prefill_chosen): the
rows of a prompt's sparse query blocks attend only the key blocks their estimate keeps; decode steps, a short call and
a call's last rows attend as without it. A graph of sparse prefill carries that form of the body (body(prefill=True)).

Shared k (attribute head_prices [Hkv]; allocate.head_prices): per token the layer's heads share Hkv g k coordinates,
ranked by selection score times the head's price (ops.rules, pooled); the body's "pooled" form.
"""

from __future__ import annotations

import math

import torch
from onnx import TensorProto
from onnx import helper as H

from . import rules
from .prefill import ATTRS as PREFILL_ATTRS
from .prefill import choice as prefill_choice
from .prefill import nodes as prefill_nodes
from .nodes import const, int8_value_nodes, mask_nodes, projection_nodes, ref_constant, score_nodes
from .spec import DOMAIN, PAGE, PROJECTION, reads_a_share
from .table import PLUGIN_ATTRS, Attr, OpDef, Port
from .topk_gather_dot import K_ATTR, LENGTH, RULE_ATTR

SOFTCAP_ATTR = Attr("softcap", "float", "tanh soft-cap of the scores, 0 = none", required=False, default=0.0)
WINDOW_ATTR = Attr("sliding_window", "int", "a query sees the keys less than this many positions before it, 0 = all",
                   required=False, default=0)
PRICES_ATTR = Attr("head_prices", "floats", "[Hkv]: the heads share the layer's k per token, each head's selection "
                   "scores times its price (ops.rules, pooled); absent: each row keeps its own k", required=False)
SCALED_ATTR = Attr("cache_scales", "int", "1: the caches are int8, each token's K^ column and V row ending in the "
                   "code of its scale (ops.rules.int8_rows; contract cache_dtype int8)",
                   required=False)
KEYED_ATTR = Attr("key_weights", "floats", "[Hkv * r]: the node scores K^'s rows divided by these (a weighted "
                  "rule's int8 cache, fold.selection_bases); absent: K^ is what the node scores with",
                  required=False)
BF16_ATTR = Attr("prompt_bf16", "int", "1: a prompt's two products (T >= 16) in bfloat16 where the CPU has "
                 "AVX512_BF16 (settings/precision.py); the function body and other CPUs compute them in float32",
                 required=False, default=0)
TOKEN_ATTRS = (Attr("token_ratio", "float", "token selection: share of the visible tokens a decode step attends",
                    required=False),
               Attr("token_budget", "int", "token selection: tokens a decode step attends (0: by token_ratio)",
                    required=False),
               Attr("token_sink", "int", "token selection: the first visible tokens always kept", required=False),
               Attr("token_window", "int", "token selection: the last visible tokens always kept", required=False))


def reference(query_hat, key_cache, value_cache, total_length, attention_mask, projection: torch.Tensor | None = None,
              *, k: int, rule: int = 0, softcap: float = 0.0, sliding_window: int = 0, token_ratio: float = 1.0,
              token_budget: int = 0, token_sink: int = 0, token_window: int = 0, head_prices=None,
              key_weights=None, prefill_threshold: float = 1.0, prefill_stride: int = 1, prefill_k_ratio: float = 1.0,
              **plugin) -> torch.Tensor:
    """The node in PyTorch, scores and softmax in float64; attention_mask [B, L] (rules.visible); head_prices [Hkv]
    or None (shared k); int8 caches (cache_scales) are read as rules.int8_values; key_weights [Hkv * r] divide K^'s
    rows; prefill_*: sparse prefill (ops.prefill.choice). Returns [B, Hkv, g, T, rv] in query_hat's dtype."""
    if key_cache.dtype == torch.int8:
        key_cache = rules.int8_values(key_cache.transpose(-1, -2)).transpose(-1, -2).to(query_hat.dtype)
        value_cache = rules.int8_values(value_cache).to(query_hat.dtype)
    if key_weights is not None:
        w = torch.as_tensor(key_weights, dtype=torch.float64).reshape(key_cache.shape[1], key_cache.shape[2], 1)
        key_cache = (key_cache.to(torch.float64) / w).to(query_hat.dtype)
    plugin.pop("cache_scales", None)
    total = int(total_length)
    mask = rules.additive_mask(torch.as_tensor(attention_mask), query_hat.shape[3], sliding_window)
    if projection is not None:
        query_hat = query_hat @ projection[:, None].to(query_hat.dtype)
    keys = key_cache[..., :total].unsqueeze(2)
    s = (rules.keep_selected(query_hat, k, rule, head_prices) @ keys).to(torch.float64)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = mask.to(torch.float64)
    if reads_a_share(token_ratio, token_budget):
        s, mask = _selected(query_hat, keys, s, mask, softcap, token_ratio, token_budget, token_sink, token_window)
    if prefill_threshold < 1.0:
        chosen = prefill_choice(query_hat, keys, mask, attention_mask, softcap, prefill_threshold, prefill_stride,
                                prefill_k_ratio)
        mask = torch.where(chosen[:, :, None], mask, torch.full_like(mask, rules.HIDDEN))
    w = torch.softmax(s + mask, dim=-1) * (mask > rules.MASKED).any(-1, keepdim=True)  # a row seeing nothing: 0
    return (w @ value_cache[:, :, None, :total].to(torch.float64)).to(query_hat.dtype)


def _selected(query_hat, keys, approx, mask, softcap, ratio, budget, sink, window):
    """Token selection (the module docstring): the exact scores, and the mask hiding a decode step's unchosen
    pages (ops.rules)."""
    s = (query_hat @ keys).to(torch.float64)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if query_hat.shape[3] != 1:
        return s, mask
    b, hkv, g, t, length = approx.shape
    visible = (mask > rules.MASKED).expand(b, 1, 1, t, length)[:, :, 0].expand(b, hkv, t, length)  # [B, Hkv, T, L]
    score = rules.page_scores(approx.transpose(2, 3), visible)  # [B, Hkv, T, P]
    forced = rules.forced_pages(visible, sink, window)
    pages = rules.select_pages(score, forced, rules.tokens_attended(visible, ratio, budget))
    chosen = rules.page_tokens(pages, visible)[:, :, None]  # [B, Hkv, 1, T, L]
    return s, torch.where(chosen, mask, torch.full_like(mask, rules.HIDDEN))


BASE_ATTRS = ["k", "rule", "softcap", "sliding_window", "plugin_namespace", "plugin_version"]


def body(opset: int, projected: bool = False, tokens: bool = False, pooled: bool = False, scaled: bool = False,
         keyed: bool = False, prefill: bool = False):
    """The portable body (materialises the [B,Hkv,g,T,L] scores the native kernel never writes).

        (projected: query --MatMul Unsqueeze(projection, 1)-->) query_hat --selection--> q_selected
        --MatMul K^[:, :L]--> scores --Cast float32--> softcap? --+ mask--> Softmax --CastLike--> MatMul V[:L] --> out
        attention_mask [B, L] --nodes.mask_nodes--> mask [B, 1, 1, T, L] (materialised here, never by the kernels)
    (K^ and V cast like the query: a float16 cache under a float32 graph)

    tokens: the token-selection form (_token_nodes): the softmax takes the exact scores, a decode step's unchosen
    pages hidden. A query row that sees no key outputs zeros (as the kernels: a padding token of a prompt). An ONNX
    function cannot test whether an optional input is present, so a graph carries the body of the form its nodes
    use: every attention node of one graph projects, or none does (export.decoder_graph.Plan).
    pooled: the heads share the layer's k (attribute head_prices; nodes.pool_nodes). scaled: int8 caches (attribute
    cache_scales; nodes.int8_value_nodes). keyed: K^'s rows divided by the attribute key_weights (nodes.score_nodes).
    prefill: sparse prefill (ops.prefill.nodes: a masked dense product, the choice made as rules.prefill_chosen).
    """
    head = projection_nodes() * projected + mask_nodes() + score_nodes("scores_t", pooled, scaled, keyed) + [
        H.make_node("Cast", ["scores_t"], ["scores"], to=TensorProto.FLOAT),
        ref_constant("cap", "softcap", "value_float"),
        H.make_node("Div", ["scores", "cap"], ["scaled"]),
        H.make_node("Tanh", ["scaled"], ["squashed"]),
        H.make_node("Mul", ["squashed", "cap"], ["capped"]),
        H.make_node("Constant", [], ["zero_f"], value=H.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0])),
        H.make_node("Greater", ["cap", "zero_f"], ["has_cap"]),
        H.make_node("Where", ["has_cap", "capped", "scores"], ["logits_raw"]),
    ]
    tail = [
        H.make_node("Softmax", ["logits"], ["probs_all"], axis=-1),
        # a row that sees no key (padding in a prompt) outputs zeros, as the kernels' do
        const("seen_floor", rules.MASKED), const("seen_axis", [-1]),
        H.make_node("Greater", ["mask", "seen_floor"], ["seen_b"]), H.make_node("Cast", ["seen_b"], ["seen_f"], to=1),
        H.make_node("ReduceMax", ["seen_f", "seen_axis"], ["seen_any"], keepdims=1),
        H.make_node("Mul", ["probs_all", "seen_any"], ["probs_f"]),
        H.make_node("CastLike", ["probs_f", "query_hat"], ["probs"]),
        H.make_node("Slice", ["value_cache", "zero_1", "total_length", "axis_2"], ["value_s"]),
        *(int8_value_nodes("value_s", "value_l", "vq_", "query_hat", -1) if scaled else
          [H.make_node("CastLike", ["value_s", "query_hat"], ["value_l"])]),
        H.make_node("Unsqueeze", ["value_l", "axis_2"], ["value_g"]),
        H.make_node("MatMul", ["probs", "value_g"], ["out"]),
    ]
    middle = _token_nodes() if tokens else [H.make_node("Add", ["logits_raw", "mask"], ["logits"])]
    if prefill:  # the mask the softmax adds hides each sparse row's unkept key blocks
        for node in middle:
            node.input[:] = ["pf_mask" if x == "mask" else x for x in node.input]
        middle = prefill_nodes() + middle
    inputs = ["query" if projected else "query_hat", *OP.input_names[1:]]
    return H.make_function(DOMAIN, OP.name, inputs + [PROJECTION] * projected, ["out"], head + middle + tail,
                           [H.make_opsetid("", opset)],
                           attributes=BASE_ATTRS + [a.name for a in TOKEN_ATTRS] * tokens + [PRICES_ATTR.name] * pooled
                           + [SCALED_ATTR.name] * scaled + [KEYED_ATTR.name] * keyed
                           + [a.name for a in PREFILL_ATTRS] * prefill)


def _token_nodes() -> list:
    """logits_raw (the approximate scores, soft-capped, float32), query_hat, key_cache_g, mask -> logits: the exact
    scores plus the mask, a decode step's unchosen pages hidden (ops.rules; page_order: the pages ranked, what the
    parity harness reads).

        exact = softcap(q^ . K^[:, :L])            visible = mask > MASKED
        page score = max over the group's rows and the page's tokens of the visible approximate scores
        forced = pages of the first token_sink / last token_window visible tokens
        want = max(ceil(attended / PAGE), forced pages), attended = budget(ratio, n) or token_budget, at most n
        chosen = rank(forced first, then by score; ties: lower page) < want   (decode steps: T = 1; prompts: all)
    """
    n, c = H.make_node, const
    f, i64, d = TensorProto.FLOAT, TensorProto.INT64, TensorProto.DOUBLE
    return [
        # the exact scores, soft-capped as the approximate ones
        n("MatMul", ["query_hat", "key_cache_g"], ["exact_t"]), n("Cast", ["exact_t"], ["exact"], to=f),
        n("Div", ["exact", "cap"], ["exact_scaled"]), n("Tanh", ["exact_scaled"], ["exact_squashed"]),
        n("Mul", ["exact_squashed", "cap"], ["exact_capped"]),
        n("Where", ["has_cap", "exact_capped", "exact"], ["exact_raw"]),
        # each page's best approximate score over the group's rows and its visible tokens
        c("tk_masked", rules.MASKED, f), c("tk_neg_inf", -math.inf, f), c("tk_pos_inf", math.inf, f),
        c("tk_hidden", rules.HIDDEN, f), c("tk_page", PAGE), c("tk_page_1d", [PAGE]), c("tk_zero", 0),
        c("tk_one", 1), c("tk_axis_g", [2]), c("tk_axis_l", [4]), c("tk_last", [-1]), c("tk_minus_one", [-1]),
        c("tk_four_s", 4),
        n("Greater", ["mask", "tk_masked"], ["visible"]),
        n("Where", ["visible", "logits_raw", "tk_neg_inf"], ["approx_visible"]),
        n("ReduceMax", ["approx_visible", "tk_axis_g"], ["row_best"], keepdims=1),
        n("Shape", ["logits_raw"], ["tk_len"], start=4, end=5),
        n("Mod", ["tk_len", "tk_page_1d"], ["tk_len_mod"]), n("Sub", ["tk_page_1d", "tk_len_mod"], ["tk_short"]),
        n("Mod", ["tk_short", "tk_page_1d"], ["tk_pad"]),
        # pages count from the first visible slot (rules.page_origin): slot origin + j read at j, -inf past the end
        n("Cast", ["visible"], ["tk_vis_f"], to=f), n("ArgMax", ["tk_vis_f"], ["tk_origin"], axis=4, keepdims=1),
        n("Add", ["tk_len", "tk_pad"], ["tk_len_p"]), n("Squeeze", ["tk_len_p"], ["tk_len_p_s"]),
        n("Range", ["tk_zero", "tk_len_p_s", "tk_one"], ["tk_rel"]), n("Add", ["tk_rel", "tk_origin"], ["tk_at"]),
        n("Sub", ["tk_len", "tk_one"], ["tk_len_less"]), n("Min", ["tk_at", "tk_len_less"], ["tk_at_c"]),
        n("Less", ["tk_at", "tk_len"], ["tk_in"]),
        n("Shape", ["row_best"], ["tk_lead"], start=0, end=4),
        n("Concat", ["tk_lead", "tk_len_p"], ["tk_row_p_shape"], axis=0),
        n("Expand", ["tk_at_c", "tk_row_p_shape"], ["tk_at_row"]),
        n("GatherElements", ["row_best", "tk_at_row"], ["tk_row_shift"], axis=4),
        n("Where", ["tk_in", "tk_row_shift", "tk_neg_inf"], ["row_padded"]),
        n("Concat", ["tk_lead", "tk_minus_one", "tk_page_1d"], ["tk_paged_shape"], axis=0),
        n("Reshape", ["row_padded", "tk_paged_shape"], ["row_pages"]),
        n("ReduceMax", ["row_pages", "tk_last"], ["page_score"], keepdims=0),
        # the forced pages (first token_sink, last token_window visible tokens) and the tokens attended
        ref_constant("tk_sink", "token_sink", "value_int"), ref_constant("tk_window", "token_window", "value_int"),
        ref_constant("tk_ratio_f", "token_ratio", "value_float"),
        ref_constant("tk_budget", "token_budget", "value_int"),
        n("Cast", ["visible"], ["visible_i"], to=i64),
        n("CumSum", ["visible_i", "tk_four_s"], ["tk_count"]),
        n("ReduceSum", ["visible_i", "tk_axis_l"], ["tk_total"], keepdims=1),
        n("LessOrEqual", ["tk_count", "tk_sink"], ["near_start"]),
        n("Sub", ["tk_total", "tk_count"], ["tk_after"]), n("Less", ["tk_after", "tk_window"], ["near_end"]),
        n("Or", ["near_start", "near_end"], ["near"]), n("And", ["visible", "near"], ["forced_tok"]),
        n("Cast", ["forced_tok"], ["forced_tok_i"], to=i64),
        n("Shape", ["forced_tok_i"], ["tk_mask_lead"], start=0, end=4),
        n("Concat", ["tk_mask_lead", "tk_len_p"], ["tk_mask_p_shape"], axis=0),
        n("Expand", ["tk_at_c", "tk_mask_p_shape"], ["tk_at_mask"]),
        n("GatherElements", ["forced_tok_i", "tk_at_mask"], ["tk_forced_shift"], axis=4),
        n("Where", ["tk_in", "tk_forced_shift", "tk_zero"], ["forced_padded"]),
        n("Concat", ["tk_mask_lead", "tk_minus_one", "tk_page_1d"], ["tk_mask_paged"], axis=0),
        n("Reshape", ["forced_padded", "tk_mask_paged"], ["forced_pages_t"]),
        n("ReduceMax", ["forced_pages_t", "tk_last"], ["forced_i"], keepdims=0),
        n("Cast", ["forced_i"], ["forced"], to=TensorProto.BOOL),
        n("ReduceSum", ["forced_i", "tk_last"], ["tk_n_forced"], keepdims=1),
        # attended = min(n, token_budget or max(1, ceil(ratio n - 1e-6 n - 1e-9))): rules.budget's slack
        c("tk_slack", 1e-6, d), c("tk_eps", 1e-9, d),
        n("Cast", ["tk_ratio_f"], ["tk_ratio"], to=d), n("Cast", ["tk_total"], ["tk_total_d"], to=d),
        n("Mul", ["tk_total_d", "tk_ratio"], ["tk_rn"]), n("Mul", ["tk_total_d", "tk_slack"], ["tk_rn_slack"]),
        n("Sub", ["tk_rn", "tk_rn_slack"], ["tk_rn_s"]), n("Sub", ["tk_rn_s", "tk_eps"], ["tk_rn_e"]),
        n("Ceil", ["tk_rn_e"], ["tk_rn_up"]), n("Cast", ["tk_rn_up"], ["tk_rn_i"], to=i64),
        n("Max", ["tk_rn_i", "tk_one"], ["tk_by_ratio"]), n("Greater", ["tk_budget", "tk_zero"], ["tk_fixed"]),
        n("Where", ["tk_fixed", "tk_budget", "tk_by_ratio"], ["tk_wanted"]),
        n("Min", ["tk_wanted", "tk_total"], ["tk_attended"]),
        c("tk_page_less_one", PAGE - 1), n("Add", ["tk_attended", "tk_page_less_one"], ["tk_att_up"]),
        n("Div", ["tk_att_up", "tk_page"], ["tk_want_pages"]),
        n("Max", ["tk_want_pages", "tk_n_forced"], ["tk_want"]),
        # rank the pages (forced first, then by score; TopK's ties: the lower index) and keep the first `want`
        n("Where", ["forced", "tk_pos_inf", "page_score"], ["page_key"]),
        n("Shape", ["page_key"], ["tk_n_pages"], start=4, end=5),
        n("TopK", ["page_key", "tk_n_pages"], ["page_top", "page_order"], axis=-1, largest=1, sorted=1),
        n("Squeeze", ["tk_n_pages"], ["tk_n_pages_s"]),
        n("Range", ["tk_zero", "tk_n_pages_s", "tk_one"], ["tk_ramp"]),
        n("Shape", ["page_order"], ["tk_order_shape"]), n("Expand", ["tk_ramp", "tk_order_shape"], ["tk_ramps"]),
        n("ScatterElements", ["tk_ramps", "page_order", "tk_ramps"], ["page_rank"], axis=-1),
        n("Less", ["page_rank", "tk_want"], ["tk_in_rank"]),
        n("Greater", ["page_key", "tk_neg_inf"], ["tk_any"]), n("And", ["tk_in_rank", "tk_any"], ["page_chosen"]),
        # the chosen pages' tokens; a prompt (T > 1) keeps every token
        n("Unsqueeze", ["page_chosen", "tk_last"], ["tk_chosen_col"]),
        n("Shape", ["page_chosen"], ["tk_chosen_shape"]),
        n("Concat", ["tk_chosen_shape", "tk_page_1d"], ["tk_chosen_wide"], axis=0),
        n("Expand", ["tk_chosen_col", "tk_chosen_wide"], ["tk_chosen_pages"]),
        n("Concat", ["tk_lead", "tk_minus_one"], ["tk_flat_shape"], axis=0),
        n("Reshape", ["tk_chosen_pages", "tk_flat_shape"], ["tk_chosen_flat"]),
        # back to slots: slot j holds page slot j - origin's choice (none before the origin)
        n("Squeeze", ["tk_len"], ["tk_len_s"]), n("Range", ["tk_zero", "tk_len_s", "tk_one"], ["tk_slots"]),
        n("Sub", ["tk_slots", "tk_origin"], ["tk_back"]), n("Max", ["tk_back", "tk_zero"], ["tk_back_c"]),
        n("Concat", ["tk_lead", "tk_len"], ["tk_row_shape"], axis=0),
        n("Expand", ["tk_back_c", "tk_row_shape"], ["tk_back_row"]),
        n("GatherElements", ["tk_chosen_flat", "tk_back_row"], ["tk_chosen_rel"], axis=4),
        n("GreaterOrEqual", ["tk_back", "tk_zero"], ["tk_from_origin"]),
        n("And", ["tk_chosen_rel", "tk_from_origin"], ["chosen_tok"]),
        n("Shape", ["query_hat"], ["tk_t"], start=3, end=4), n("Squeeze", ["tk_t"], ["tk_t_s"]),
        n("Equal", ["tk_t_s", "tk_one"], ["tk_decode"]), n("Not", ["tk_decode"], ["tk_prompt"]),
        n("Or", ["chosen_tok", "tk_prompt"], ["tk_keep"]),
        n("Where", ["tk_keep", "mask", "tk_hidden"], ["tk_mask"]),
        n("Add", ["exact_raw", "tk_mask"], ["logits"]),
    ]


OP = OpDef("AquaAttention",
           "out = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L], one pass over the cache; K^ dim-major",
           inputs=(Port("query_hat", rank=5), Port("key_cache", "C"), Port("value_cache", "C"), LENGTH,
                   Port("attention_mask", "int64", 2)),
           outputs=(Port("out", rank=5),),
           attributes=(K_ATTR, RULE_ATTR, SOFTCAP_ATTR, WINDOW_ATTR, *PLUGIN_ATTRS, *TOKEN_ATTRS, PRICES_ATTR,
                       SCALED_ATTR, KEYED_ATTR, *PREFILL_ATTRS, BF16_ATTR),
           body=body, reference=reference, projectable=True,
           forms=(("tokens", tuple(a.name for a in TOKEN_ATTRS)), ("pooled", (PRICES_ATTR.name,)),
                  ("scaled", (SCALED_ATTR.name,)), ("keyed", (KEYED_ATTR.name,)),
                  ("prefill", tuple(a.name for a in PREFILL_ATTRS))),
           shape=lambda d: {"out": d["query_hat"][:4] + d["value_cache"][3:]})
