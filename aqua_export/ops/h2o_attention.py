"""H2OAttention: AQUA-H2O attention with heavy-hitter eviction inside the graph, on fixed-capacity slot buffers
(contract.Contract, The H2O state). Native kernel plugins/ort/h2o_attention.cc, Triton
kernels/triton/h2o_attention.py; the budget and keep rule are rules.budget / rules.h2o_keep.

Per (batch, kv head), one new token at a time (so a T-token prefill evicts exactly as T one-token forwards):

    real token? --write k^, v into the first free slot s; token[s] = position, heavy[s] = 0
    q^ --selection (k, rule)--> scores over K^[:, live slots] --softcap, softmax over live slots--> w [g, C]
    out = w @ V
    real token? --heavy += sum_g w; n += 1; budget = max(1, ceil(ratio n))
                --live > budget: free argmin heavy over live slots outside the floor(budget / 2) most recent
                  real tokens (ties: the later token)
"""

from __future__ import annotations

import onnx
import torch
from onnx import TensorProto
from onnx import helper as H

from . import rules
from .aqua_attention import SOFTCAP_ATTR
from .nodes import const, projection_nodes, ref_constant, selection_nodes
from .rules import HIDDEN, budget, slots_needed
from .spec import DOMAIN, FREE, PROJECTION
from .table import ANY, PLUGIN_ATTRS, Attr, OpDef, Port
from .topk_gather_dot import K_ATTR, RULE_ATTR

INPUTS = ("query_hat", "key_new", "value_new", "past_key", "past_value", "past_heavy", "past_token", "attention_mask")
OUTPUTS = ("out", "present_key", "present_value", "present_heavy", "present_token")
# (element type, rank) of the ports that are not the float type T of rank 4 ([B, Hkv, slots, r])
PORTS = {"query_hat": ("T", 5), "out": ("T", 5), "past_heavy": ("float", 3), "present_heavy": ("float", 3),
         "past_token": ("int64", 3), "present_token": ("int64", 3), "attention_mask": ("int64", 2)}


def reference(q, key_new, value_new, past_key, past_value, past_heavy, past_token, mask, projection=None, *, k: int,
              rule: int = 0, softcap: float = 0.0, ratio: float = 0.5):
    """The op in PyTorch, float64 arithmetic (tests). Shapes as the node's (module docstring of
    plugins/ort/h2o_attention.cc); returns (out, present_key, present_value, present_heavy, present_token).
    With ``projection`` P [Hkv, d, r] the first input is the query q [B,Hkv,g,T,d] and q^ = q P."""
    dt = q.dtype
    if projection is not None:
        q = q.double() @ projection.double()[:, None]
    b, hkv, g, t, r = q.shape
    rv = value_new.shape[-1]  # V's width (r unless AQUA-Memory cuts K^ and V apart)
    c = past_key.shape[2]
    lens = mask.shape[1]
    real = mask != 0
    cap = max(c, slots_needed(ratio, real.sum(1).numpy()))
    kr = torch.zeros(b, hkv, r, cap, dtype=torch.float64)
    kr[..., :c] = past_key.reshape(b, hkv, r, c).double()
    vv = torch.zeros(b, hkv, cap, rv, dtype=torch.float64)
    vv[:, :, :c] = past_value.double()
    heavy = torch.zeros(b, hkv, cap, dtype=torch.float64)
    heavy[..., :c] = past_heavy.double()
    token = torch.full((b, hkv, cap), FREE, dtype=torch.int64)
    token[..., :c] = past_token
    qs = rules.keep_selected(q, k, rule).double()
    before = torch.cat([torch.zeros(b, 1, dtype=torch.int64), real.long().cumsum(1)], 1)
    out = torch.zeros(b, hkv, g, t, rv, dtype=torch.float64)
    first = lens - t
    for bb in range(b):
        for h in range(hkv):
            n = int(before[bb, first])
            for tt in range(t):
                pos = first + tt
                tok = token[bb, h]
                if real[bb, pos]:
                    s = int((tok == FREE).nonzero()[0])
                    kr[bb, h, :, s] = key_new[bb, h, tt].double()
                    vv[bb, h, s] = value_new[bb, h, tt].double()
                    tok[s], heavy[bb, h, s] = pos, 0.0
                live = tok >= 0
                sc = qs[bb, h, :, tt] @ kr[bb, h]  # [g, cap]
                if softcap:
                    sc = torch.tanh(sc / softcap) * softcap
                w = torch.softmax(sc.masked_fill(~live, -torch.inf), -1).nan_to_num(0.0) * live
                out[bb, h, :, tt] = w @ vv[bb, h]
                if real[bb, pos]:
                    heavy[bb, h] += w.sum(0)
                    n += 1
                    keep = int(budget(ratio, n))
                    if int(live.sum()) > keep:
                        recent = n - before[bb, tok.clamp_min(0)] <= keep // 2
                        cand = (live & ~recent).nonzero().flatten().tolist()
                        v = min(cand, key=lambda i: (float(heavy[bb, h, i]), -int(tok[i])))
                        tok[v] = FREE
    return (out.to(dt), kr.to(dt).reshape(b, hkv, cap, r), vv.to(dt), heavy.float(), token)


CARRIED = ("K", "V", "heavy", "token")  # per iteration: the slot buffers
FIXED = ("q_sel", "key_new", "value_new", "real", "before", "first", "ratio_d", "cap")  # carried unchanged


def _step_graph():
    """The Loop body: one new token (iteration ``it``) for every (batch, kv head). No outer-scope reads and no
    attribute references (both are carried in), so any runtime inlining the function runs it as is."""
    B, I64, F, D = TensorProto.BOOL, TensorProto.INT64, TensorProto.FLOAT, TensorProto.DOUBLE
    n = H.make_node
    nodes = [
        const("ax0", [0]), const("ax1", [1]), const("ax2", [2]), const("ax3", [3]), const("ax23", [2, 3]),
        const("free", FREE), const("zero_i", 0), const("one_i", 1), const("two_i", 2),
        const("zero_f", 0.0), const("hidden", HIDDEN), const("top_f", float(torch.finfo(torch.float32).max)),
        const("eps_d", 1e-9, D), const("slack_d", 1e-6, D), const("minus_one_d", -1.0, D), const("flat", [0, -1]),
        n("Unsqueeze", ["it", "ax0"], ["it1"]),
        n("Add", ["first_in", "it1"], ["pos"]),
        n("Gather", ["q_sel_in", "it1"], ["q_t"], axis=3),  # [B,H,g,1,r]
        n("Gather", ["key_new_in", "it1"], ["k_t"], axis=2),  # [B,H,1,r]
        n("Gather", ["value_new_in", "it1"], ["v_t"], axis=2),
        n("Gather", ["real_in", "pos"], ["real_i"], axis=1),  # [B,1]
        n("Cast", ["real_i"], ["real_b"], to=B),
        n("Unsqueeze", ["real_b", "ax2"], ["real3"]),  # [B,1,1]
        # the new token into the first free slot
        n("Equal", ["token_in", "free"], ["is_free"]),
        n("Cast", ["is_free"], ["is_free_i"], to=TensorProto.INT32),
        n("ArgMax", ["is_free_i"], ["slot"], axis=2, keepdims=1),  # [B,H,1]: the first free
        n("Shape", ["token_in"], ["c_1d"], start=2, end=3),
        n("Squeeze", ["c_1d"], ["c_s"]),
        n("Range", ["zero_i", "c_s", "one_i"], ["slots"]),
        n("Equal", ["slots", "slot"], ["at_slot"]),
        n("And", ["at_slot", "real3"], ["write"]),  # [B,H,C]
        n("Unsqueeze", ["write", "ax2"], ["write_k"]),
        n("Transpose", ["k_t"], ["k_col"], perm=[0, 1, 3, 2]),
        n("Where", ["write_k", "k_col", "K_in"], ["K_w"]),
        n("Unsqueeze", ["write", "ax3"], ["write_v"]),
        n("Where", ["write_v", "v_t", "V_in"], ["V_out"]),
        n("Where", ["write", "pos", "token_in"], ["token_w"]),
        n("Where", ["write", "zero_f", "heavy_in"], ["heavy_w"]),
        # scores over the live slots, softmax, value product
        n("GreaterOrEqual", ["token_w", "zero_i"], ["live"]),
        n("Unsqueeze", ["K_w", "ax2"], ["K_g"]),
        n("MatMul", ["q_t", "K_g"], ["s_t"]),
        n("Cast", ["s_t"], ["s"], to=F),
        n("Div", ["s", "cap_in"], ["s_scaled"]), n("Tanh", ["s_scaled"], ["s_tanh"]),
        n("Mul", ["s_tanh", "cap_in"], ["s_capped"]), n("Greater", ["cap_in", "zero_f"], ["has_cap"]),
        n("Where", ["has_cap", "s_capped", "s"], ["s_c"]),
        n("Unsqueeze", ["live", "ax23"], ["live5"]),
        n("Where", ["live5", "s_c", "hidden"], ["s_m"]),
        n("Softmax", ["s_m"], ["p"], axis=-1),
        n("Where", ["live5", "p", "zero_f"], ["w"]),  # a query with no live slot: all 0
        n("CastLike", ["w", "q_t"], ["w_t"]),
        n("Unsqueeze", ["V_out", "ax2"], ["V_g"]),
        n("MatMul", ["w_t", "V_g"], ["o5"]),
        n("Transpose", ["o5"], ["o"], perm=[3, 0, 1, 2, 4]),  # [1,B,H,g,r]: see the Loop's Reshape
        # heavy hitters and eviction
        n("ReduceSum", ["w", "ax23"], ["w_sum"], keepdims=0),
        n("Add", ["heavy_w", "w_sum"], ["heavy_add"]),
        n("Where", ["real3", "heavy_add", "heavy_w"], ["heavy_out"]),
        n("Gather", ["before_in", "pos"], ["n_before"], axis=1),
        n("Add", ["n_before", "real_i"], ["n_seen"]),  # [B,1]
        n("Cast", ["n_seen"], ["n_d"], to=D), n("Mul", ["n_d", "ratio_d_in"], ["rn"]),
        n("Mul", ["n_d", "slack_d"], ["slack"]), n("Sub", ["rn", "slack"], ["rn_s"]),
        n("Sub", ["rn_s", "eps_d"], ["rn_eps"]), n("Ceil", ["rn_eps"], ["rn_up"]),
        n("Cast", ["rn_up"], ["rn_i"], to=I64), n("Max", ["rn_i", "one_i"], ["keep"]),
        n("Div", ["keep", "two_i"], ["n_recent"]),
        n("Max", ["token_w", "zero_i"], ["token_c"]),
        n("Reshape", ["token_c", "flat"], ["token_flat"]),
        n("GatherElements", ["before_in", "token_flat"], ["bef_flat"], axis=1),
        n("Shape", ["token_w"], ["token_shape"]),
        n("Reshape", ["bef_flat", "token_shape"], ["bef"]),
        n("Unsqueeze", ["n_seen", "ax2"], ["n3"]),
        n("Sub", ["n3", "bef"], ["since"]),  # real tokens from the slot's to the current one
        n("Unsqueeze", ["n_recent", "ax2"], ["n_recent3"]),
        n("LessOrEqual", ["since", "n_recent3"], ["recent"]),
        n("Not", ["recent"], ["old"]), n("And", ["live", "old"], ["cand"]),
        n("Cast", ["live"], ["live_i"], to=I64),
        n("ReduceSum", ["live_i", "ax2"], ["n_live"], keepdims=1),
        n("Unsqueeze", ["keep", "ax2"], ["keep3"]),
        n("Greater", ["n_live", "keep3"], ["too_many"]),
        n("And", ["too_many", "real3"], ["evict_row"]),
        n("Where", ["cand", "heavy_out", "top_f"], ["key"]),
        n("ReduceMin", ["key", "ax2"], ["key_min"], keepdims=1),
        n("Equal", ["key", "key_min"], ["at_min"]), n("And", ["cand", "at_min"], ["tie"]),
        n("Cast", ["token_w"], ["token_d"], to=D),
        n("Where", ["tie", "token_d", "minus_one_d"], ["tie_token"]),
        n("ArgMax", ["tie_token"], ["victim"], axis=2, keepdims=1),  # the later token of a tie
        n("Equal", ["slots", "victim"], ["at_victim"]),
        n("And", ["at_victim", "evict_row"], ["evict"]),
        n("Where", ["evict", "free", "token_w"], ["token_out"]),
        n("Identity", ["cond_in"], ["cond_out"]),
        n("Identity", ["K_w"], ["K_out"]),
    ] + [n("Identity", [f"{f}_in"], [f"{f}_out"]) for f in FIXED]
    vi = H.make_tensor_value_info
    untyped = [H.make_value_info(f"{x}_in", onnx.TypeProto()) for x in CARRIED + FIXED]  # the Loop's inputs type them
    ins = [vi("it", I64, []), vi("cond_in", B, [])] + untyped
    outs = [vi("cond_out", B, [])] + [H.make_value_info(f"{x}_out", onnx.TypeProto()) for x in CARRIED + FIXED] \
        + [H.make_value_info("o", onnx.TypeProto())]
    graph = H.make_graph(nodes, "h2o_step", ins, outs)
    # a subgraph may not shadow a name of the scope around it: every name here gets the step's prefix
    for node in graph.node:
        node.input[:] = [f"step/{x}" if x else x for x in node.input]
        node.output[:] = [f"step/{x}" for x in node.output]
    for v in list(graph.input) + list(graph.output):
        v.name = f"step/{v.name}"
    return graph


def body(opset: int, projected: bool = False):
    """The portable body of H2OAttention (copies every slot buffer once per new token: slower than the native
    kernel, which updates them in place, but any ONNX Runtime runs it). projected: the form whose nodes take P
    (aqua_attention.body says why a graph carries one form).

        (projected: query --MatMul Unsqueeze(projection, 1)-->) query_hat --selection (k, rule)--> q_sel
        past_* --widen to C' slots (keys as their dim-major [B,H,r,C] view)--> Loop over the T new tokens
        (_step_graph) --> a [1,B,H,g,r] per token --Reshape--> [T,B,H,g,r] --Transpose--> [B,H,g,T,r];
        present_* (keys back to [B,H,C',r])
    """
    I64, D = TensorProto.INT64, TensorProto.DOUBLE
    n = H.make_node
    nodes = projection_nodes() * projected + selection_nodes() + [
        ref_constant("cap", "softcap", "value_float"), ref_constant("ratio", "ratio", "value_float"),
        const("h_ax1", [1]), const("h_ax1_s", 1),
        const("h_one", 1), const("h_eps", 1e-9, D), const("h_slack", 1e-6, D), const("h_zeros6", [0] * 6),
        const("h_zeros5", [0] * 5), const("h_zeros7", [0] * 7), const("h_zeros1", [0]),
        const("h_free", FREE), const("h_zero_f", 0.0),
        n("Cast", ["ratio"], ["ratio_d"], to=D),
        n("Cast", ["attention_mask"], ["mask_b"], to=TensorProto.BOOL),
        n("Cast", ["mask_b"], ["real"], to=I64),
        n("CumSum", ["real", "h_ax1_s"], ["before"], exclusive=1),  # axis: rank 0, as ONNX says
        n("Shape", ["attention_mask"], ["len_1d"], start=1, end=2),
        n("Shape", ["key_new"], ["t_1d"], start=2, end=3),
        n("Sub", ["len_1d", "t_1d"], ["first"]),
        n("Squeeze", ["t_1d"], ["t_s"]),
        # C' = max(C, need): need = max over rows of min(n, budget(n) + 1)
        n("ReduceSum", ["real", "h_ax1"], ["n_row"], keepdims=0),
        n("Cast", ["n_row"], ["n_row_d"], to=D), n("Mul", ["n_row_d", "ratio_d"], ["rn"]),
        n("Mul", ["n_row_d", "h_slack"], ["slack"]), n("Sub", ["rn", "slack"], ["rn_s"]),
        n("Sub", ["rn_s", "h_eps"], ["rn_eps"]), n("Ceil", ["rn_eps"], ["rn_up"]), n("Cast", ["rn_up"], ["rn_i"], to=I64),
        n("Max", ["rn_i", "h_one"], ["h_keep"]), n("Add", ["h_keep", "h_one"], ["h_keep1"]),
        n("Min", ["n_row", "h_keep1"], ["need_row"]),
        n("ReduceMax", ["need_row"], ["need"], keepdims=1),
        n("Shape", ["past_key"], ["bh"], start=0, end=2),
        n("Shape", ["past_key"], ["c_1d"], start=2, end=3),
        n("Shape", ["past_key"], ["h_r"], start=3, end=4),
        n("Max", ["c_1d", "need"], ["cap_1d"]),
        n("Sub", ["cap_1d", "c_1d"], ["extra"]),
        n("Concat", ["bh", "h_r", "c_1d"], ["rows_shape"], axis=0),
        n("Reshape", ["past_key", "rows_shape"], ["key_rows"], allowzero=1),
        n("Concat", ["h_zeros7", "extra"], ["pads_k"], axis=0),
        n("Pad", ["key_rows", "pads_k"], ["K0"]),
        n("Concat", ["h_zeros6", "extra", "h_zeros1"], ["pads_v"], axis=0),
        n("Pad", ["past_value", "pads_v"], ["V0"]),
        n("Concat", ["h_zeros5", "extra"], ["pads_s"], axis=0),
        n("Pad", ["past_heavy", "pads_s", "h_zero_f"], ["heavy0"]),
        n("Pad", ["past_token", "pads_s", "h_free"], ["token0"]),
        n("Identity", ["q_selected"], ["q_sel"]),
        const("h_go", True, TensorProto.BOOL),  # an explicit condition: ONNX's reference Loop runs none without one
        n("Loop", ["t_s", "h_go"] + ["K0", "V0", "heavy0", "token0"] + list(FIXED),
          ["K_f", "present_value", "present_heavy", "present_token"] + [f"{f}_f" for f in FIXED] + ["o_seq"],
          body=_step_graph()),
        # ONNX's Loop spec reads as stacking the steps' [1,B,H,g,r] (ONNX Runtime: [T,1,B,H,g,r]) or concatenating
        # them (onnx.reference: [T,B,H,g,r]); one Reshape makes both [T,B,H,g,r]
        const("h_minus1", [-1]),
        n("Shape", ["q_sel"], ["bhg"], start=0, end=3),
        n("Shape", ["past_value"], ["h_rv"], start=3, end=4),
        n("Concat", ["h_minus1", "bhg", "h_rv"], ["o_shape"], axis=0),
        n("Reshape", ["o_seq", "o_shape"], ["o_tbhgr"]),
        n("Transpose", ["o_tbhgr"], ["out"], perm=[1, 2, 3, 0, 4]),
        n("Concat", ["bh", "cap_1d", "h_r"], ["key_shape"], axis=0),
        n("Reshape", ["K_f", "key_shape"], ["present_key"], allowzero=1),
    ]
    inputs = ["query" if projected else INPUTS[0]] + list(INPUTS[1:]) + [PROJECTION] * projected
    return H.make_function(DOMAIN, OP.name, inputs, list(OUTPUTS), nodes, [H.make_opsetid("", opset)],
                           attributes=OP.attribute_names)


OP = OpDef("H2OAttention",
           "AQUA-H2O attention over fixed-capacity slots with heavy-hitter eviction, one new token at a time",
           inputs=tuple(Port(n, *PORTS.get(n, ("T", 4))) for n in INPUTS),
           outputs=tuple(Port(n, *PORTS.get(n, ("T", 4))) for n in OUTPUTS),
           attributes=(K_ATTR, RULE_ATTR, SOFTCAP_ATTR, Attr("ratio", "float", "share of a sequence's real tokens kept"),
                       *PLUGIN_ATTRS),
           body=body, reference=reference, projectable=True,
           shape=lambda d: {"out": d["query_hat"][:4] + d["value_new"][3:],
                            **{f"present_{k}": d[f"past_{k}"][:2] + [ANY] + d[f"past_{k}"][3:]
                               for k in ("key", "value", "heavy", "token")}})
