"""ONNX export: the custom nodes (TopKGatherDot and the two cache updates) with their portable function
bodies, and the export entry point (the graph itself is built from the weights by decoder_graph, no tracing).

The graph's I/O and cache layout belong to contract.Contract; one decoder layer as exported: see decoder_graph.

Why dim-major K^: selecting coordinate c of every cached key reads one contiguous row of the cache,
so a fused kernel reads only k/r of the K cache (a [T, d] row-major cache makes it a strided gather).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .calibrate import Projection
from .config import AquaConfig, ConfigError
from .contract import DOMAIN, Contract
from .models import architecture_of, attention_geometry
from .quantize import WeightFormat

PROJECTION = "projection"  # the attention nodes' optional last input: P [Hkv, d, r], input 0 then being q

OP_TYPE = "TopKGatherDot"
ATTENTION = "AquaAttention"
KEY_UPDATE, VALUE_UPDATE = "KeyCacheUpdate", "ValueCacheUpdate"
VALUE_PRODUCT = "ValueProduct"
PLUGIN_NAMESPACE = "aqua"
PLUGIN_VERSION = "1"
OPSET_VERSION = 1
# the nodes' `rule` attribute per selection rule; the weighted rules are folded into P (selection_bases)
RULES = {"magnitude": 0, "weighted": 0, "group": 1, "group-weighted": 1, "static": 2}
RULE_NAMES = {0: "magnitude", 1: "group", 2: "static"}
RULE_DOC = "0: top-k |q^| per query row; 1: one top-k of the GQA group's summed |q^| for all its rows; 2: the first k"


# --------------------------------------------------------------------------------------------
# The operator
# --------------------------------------------------------------------------------------------

def _keep_selected(query_hat: torch.Tensor, k: int, rule: int) -> torch.Tensor:
    from .attention import select_indices

    if k >= query_hat.shape[-1]:
        return query_hat
    idx = select_indices(query_hat, k, RULE_NAMES[rule])
    return query_hat * torch.zeros_like(query_hat).scatter_(-1, idx, 1.0)


def topk_gather_dot_reference(query_hat: torch.Tensor, key_cache: torch.Tensor, k: int, rule: int = 0) -> torch.Tensor:
    """query_hat [B, Hkv, g, T, r], key_cache [B, Hkv, r, S] (dim-major) -> scores [B, Hkv, g, T, S].

    Per query row: I = the rule's k coordinates (attention.select_indices), scores = q^[I] . K^[I, :].
    """
    return _keep_selected(query_hat, k, rule) @ key_cache.unsqueeze(2)


def attention_reference(query_hat, key_cache, value_cache, total: int, mask, k: int, rule: int = 0,
                        softcap: float = 0.0, projection: torch.Tensor | None = None) -> torch.Tensor:
    """AquaAttention in PyTorch: query_hat [B,Hkv,g,T,r], key_cache [B,Hkv,r,C], value_cache [B,Hkv,C,rv],
    mask [B|1,1,1,T,total] float32 -> [B,Hkv,g,T,rv] = softmax(softcap(q^[I] . K^[I,:total]) + mask) @ V[:total].
    With ``projection`` P [Hkv, d, r] the first input is the query q [B,Hkv,g,T,d] and q^ = q P (the node's
    optional sixth input)."""
    if projection is not None:
        query_hat = query_hat @ projection[:, None].to(query_hat.dtype)
    s = (_keep_selected(query_hat, k, rule) @ key_cache[..., :total].unsqueeze(2)).to(torch.float64)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    w = torch.softmax(s + mask.to(torch.float64), dim=-1)
    return (w @ value_cache[:, :, None, :total].to(torch.float64)).to(query_hat.dtype)


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------

def _register_schema() -> None:
    import onnx
    from onnx.defs import OpSchema

    from .h2o import register_schema

    register_schema()
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    floats = [("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")]
    length = OpSchema.FormalParameter("total_length", "tensor(int64)")
    onnx.defs.register_schema(OpSchema(
        OP_TYPE, DOMAIN, OPSET_VERSION,
        doc="scores = q^[I] . K^[I, :L] with I = top-k |q^| per query row (ties: lower index); K^ dim-major",
        inputs=[OpSchema.FormalParameter("query_hat", "T"), OpSchema.FormalParameter("key_cache", "T"), length],
        outputs=[OpSchema.FormalParameter("scores", "T")],
        type_constraints=floats,
        attributes=[OpSchema.Attribute("k", OpSchema.AttrType.INT, "coordinates kept per query"),
                    OpSchema.Attribute("rule", OpSchema.AttrType.INT, RULE_DOC, required=False),
                    OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                    OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version")],
    ))
    onnx.defs.register_schema(OpSchema(
        ATTENTION, DOMAIN, OPSET_VERSION,
        doc="out = softmax(softcap(q^[I] . K^[I, :L]) + mask) @ V[:L], one pass over the cache; K^ dim-major",
        inputs=[OpSchema.FormalParameter("query_hat", "T"), OpSchema.FormalParameter("key_cache", "T"),
                OpSchema.FormalParameter("value_cache", "T"), length,
                OpSchema.FormalParameter("mask", "tensor(float)"),
                OpSchema.FormalParameter(PROJECTION, "T", "P [Hkv, d, r]: input 0 is then q [B,Hkv,g,T,d], q^ = q P",
                                         param_option=OpSchema.FormalParameterOption.Optional)],
        outputs=[OpSchema.FormalParameter("out", "T")],
        type_constraints=floats,
        attributes=[OpSchema.Attribute("k", OpSchema.AttrType.INT, "coordinates kept per query"),
                    OpSchema.Attribute("rule", OpSchema.AttrType.INT, RULE_DOC, required=False),
                    OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, "tanh soft-cap of the scores, 0 = none",
                                       required=False),
                    OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                    OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version")],
    ))
    for op, layout in ((KEY_UPDATE, "dim-major [r, C] per head"), (VALUE_UPDATE, "token-major [C, r] per head")):
        onnx.defs.register_schema(OpSchema(
            op, DOMAIN, OPSET_VERSION,
            doc=f"present = past with new written at slots L-S..L-1, max(C, L) slots; memory {layout}",
            inputs=[OpSchema.FormalParameter("past", "T"), OpSchema.FormalParameter("new", "T"), length],
            outputs=[OpSchema.FormalParameter("present", "T")], type_constraints=floats))
    onnx.defs.register_schema(OpSchema(
        VALUE_PRODUCT, DOMAIN, OPSET_VERSION,
        doc="out = probs @ value_cache[:, :, :L] with L = probs.shape[4]: the filled slots read in place",
        inputs=[OpSchema.FormalParameter("probs", "T"), OpSchema.FormalParameter("value_cache", "T")],
        outputs=[OpSchema.FormalParameter("out", "T")], type_constraints=floats))


def _ref_constant(name: str, attr: str, kind: str):
    """A Constant node whose value is the function's attribute ``attr`` (value_int / value_float)."""
    import onnx
    from onnx import helper as H

    node = H.make_node("Constant", [], [name])
    node.attribute.append(onnx.AttributeProto(name=kind, ref_attr_name=attr, type=(
        onnx.AttributeProto.INT if kind == "value_int" else onnx.AttributeProto.FLOAT)))
    return node


def _selection_nodes() -> list:
    """query_hat [B,Hkv,g,T,r] -> q_selected: the k coordinates the rule keeps, the others zeroed.

        score = |q^|  (rule 0)   |  ReduceSum over g of |q^|, expanded (rule 1)   |  r, r-1, ..., 1 (rule 2)
        TopK(score, k; ties -> lower index) --idx--> ScatterElements(1s into 0s) --> q^ * keep
    """
    from onnx import TensorProto
    from onnx import helper as H

    def scalar(name, value, kind=TensorProto.FLOAT):
        return H.make_node("Constant", [], [name], value=H.make_tensor(name, kind, [], [value]))

    return [
        _ref_constant("k_scalar", "k", "value_int"), _ref_constant("rule_scalar", "rule", "value_int"),
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
        scalar("rule_group", 1, TensorProto.INT64), scalar("rule_static", 2, TensorProto.INT64),
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
        H.make_node("Mul", ["query_hat", "keep"], ["q_selected"]),
    ]


def _score_nodes(scores: str) -> list:
    """query_hat, key_cache, total_length -> ``scores`` = q_selected @ K^[:, :, :, :total_length] (both bodies' head)."""
    from onnx import helper as H

    return _selection_nodes() + [
        H.make_node("Constant", [], ["axis_2"], value_ints=[2]),
        H.make_node("Constant", [], ["zero_1"], value_ints=[0]),
        H.make_node("Constant", [], ["axis_3"], value_ints=[3]),
        H.make_node("Slice", ["key_cache", "zero_1", "total_length", "axis_3"], ["key_cache_l"]),
        H.make_node("Unsqueeze", ["key_cache_l", "axis_2"], ["key_cache_g"]),
        H.make_node("MatMul", ["q_selected", "key_cache_g"], [scores]),
    ]


def function_body(opset: int):
    """The portable body of TopKGatherDot as an ONNX local function of standard ops.

        query_hat --selection (rule, k)--> q_selected --MatMul--> Unsqueeze(Slice(key_cache, :total_length), 2)
    """
    from onnx import helper as H

    return H.make_function(DOMAIN, OP_TYPE, ["query_hat", "key_cache", "total_length"], ["scores"], _score_nodes("scores"),
                           [H.make_opsetid("", opset)], attributes=["k", "rule", "plugin_namespace", "plugin_version"])


def projection_nodes() -> list:
    """query [B,Hkv,g,T,d], projection P [Hkv,d,r] -> query_hat = q P: the head of both attention bodies' projected
    form (attention_body, h2o.function_body)."""
    from onnx import helper as H

    return [H.make_node("Constant", [], ["proj_axis_1"], value_ints=[1]),
            H.make_node("Unsqueeze", [PROJECTION, "proj_axis_1"], ["projection_g"]),
            H.make_node("MatMul", ["query", "projection_g"], ["query_hat"])]


def attention_body(opset: int, projected: bool = False):
    """The portable body of AquaAttention (materialises the [B,Hkv,g,T,L] scores the native kernel never writes).

        (projected: query --MatMul Unsqueeze(projection, 1)-->) query_hat --selection--> q_selected
        --MatMul K^[:, :L]--> scores --Cast float32--> softcap? --+ mask--> Softmax --CastLike--> MatMul V[:L] --> out

    An ONNX function cannot test whether an optional input is present, so a graph carries the body of the form
    its nodes use: every attention node of one graph projects, or none does (decoder_graph.Plan).
    """
    from onnx import TensorProto
    from onnx import helper as H

    nodes = projection_nodes() * projected + _score_nodes("scores_t") + [
        H.make_node("Cast", ["scores_t"], ["scores"], to=TensorProto.FLOAT),
        _ref_constant("cap", "softcap", "value_float"),
        H.make_node("Div", ["scores", "cap"], ["scaled"]),
        H.make_node("Tanh", ["scaled"], ["squashed"]),
        H.make_node("Mul", ["squashed", "cap"], ["capped"]),
        H.make_node("Constant", [], ["zero_f"], value=H.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0])),
        H.make_node("Greater", ["cap", "zero_f"], ["has_cap"]),
        H.make_node("Where", ["has_cap", "capped", "scores"], ["logits_raw"]),
        H.make_node("Add", ["logits_raw", "mask"], ["logits"]),
        H.make_node("Softmax", ["logits"], ["probs_f"], axis=-1),
        H.make_node("CastLike", ["probs_f", "query_hat"], ["probs"]),
        H.make_node("Slice", ["value_cache", "zero_1", "total_length", "axis_2"], ["value_l"]),
        H.make_node("Unsqueeze", ["value_l", "axis_2"], ["value_g"]),
        H.make_node("MatMul", ["probs", "value_g"], ["out"]),
    ]
    inputs = ["query" if projected else "query_hat", "key_cache", "value_cache", "total_length", "mask"]
    return H.make_function(DOMAIN, ATTENTION, inputs + [PROJECTION] * projected, ["out"], nodes, [H.make_opsetid("", opset)],
                           attributes=["k", "rule", "softcap", "plugin_namespace", "plugin_version"])


def cache_update_body(op: str, opset: int):
    """The portable body of KeyCacheUpdate / ValueCacheUpdate (copies the past: O(C) per step, where the
    native kernel writes a shared buffer in place).

        past [B,H,C,r] --(keys: Reshape to the dim-major [B,H,r,C])--> Slice(slots :L-S) --Concat(new)-->
        Pad(zeros to max(C, L) slots) --(keys: Reshape back)--> present [B,H,max(C,L),r]
    """
    from onnx import helper as H

    key = op == KEY_UPDATE
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
              H.make_node("Reshape", ["past", "rows_shape"], ["memory"], allowzero=1),  # an empty past has C = 0
              H.make_node("Transpose", ["new"], ["fresh"], perm=[0, 1, 3, 2])]
    else:
        n += [H.make_node("Identity", ["past"], ["memory"]), H.make_node("Identity", ["new"], ["fresh"])]
    n += [
        H.make_node("Slice", ["memory", "zero_1", "p", "axis"], ["old"]),
        H.make_node("Concat", ["old", "fresh"], ["joined"], axis=ax),
        H.make_node("Constant", [], ["pads_head"], value_ints=[0] * (4 + ax)),  # begins, then ends up to the slot axis
        H.make_node("Constant", [], ["pads_tail"], value_ints=[0] * (3 - ax + 1)),
        H.make_node("Slice", ["pads_tail", "zero_1", "tail_len"], ["pads_tail_n"]),
        H.make_node("Concat", ["pads_head", "extra", "pads_tail_n"], ["pads"], axis=0),
        H.make_node("Pad", ["joined", "pads"], ["padded" if key else "present"]),
    ]
    if key:
        n += [H.make_node("Concat", ["bh", "out_len", "r"], ["out_shape"], axis=0),
              H.make_node("Reshape", ["padded", "out_shape"], ["present"], allowzero=1)]
    return H.make_function(DOMAIN, op, ["past", "new", "total_length"], ["present"], n, [H.make_opsetid("", opset)])


def value_product_body(opset: int):
    """The portable body of ValueProduct: Slice the L filled slots (a copy), Unsqueeze, MatMul."""
    from onnx import helper as H

    n = [H.make_node("Shape", ["probs"], ["len"], start=4, end=5),
         H.make_node("Constant", [], ["zero_1"], value_ints=[0]),
         H.make_node("Constant", [], ["axis_2"], value_ints=[2]),
         H.make_node("Slice", ["value_cache", "zero_1", "len", "axis_2"], ["filled"]),
         H.make_node("Unsqueeze", ["filled", "axis_2"], ["filled_g"]),
         H.make_node("MatMul", ["probs", "filled_g"], ["out"])]
    return H.make_function(DOMAIN, VALUE_PRODUCT, ["probs", "value_cache"], ["out"], n, [H.make_opsetid("", opset)])


def function_bodies(opset: int, projected: bool = False) -> list:
    """Every custom node's body: a runtime without the native library runs these (projected: the attention nodes,
    AquaAttention or H2OAttention, take P; attention_body)."""
    from . import h2o

    return [function_body(opset), attention_body(opset, projected), cache_update_body(KEY_UPDATE, opset),
            cache_update_body(VALUE_UPDATE, opset), value_product_body(opset), h2o.function_body(opset, projected)]


def single_op_model(k: int, dtype: str = "float32", opset: int = 20, rule: int = 0):
    """A one-node model: TopKGatherDot(q, kc, total_length) -> s with its function body (kernel tests and
    benchmarks; the length input is ``length`` [1] int64)."""
    from onnx import TensorProto
    from onnx import helper as H

    _register_schema()
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    node = H.make_node(OP_TYPE, ["q", "kc", "length"], ["s"], domain=DOMAIN, name="/op/TopKGatherDot", k=k,
                       rule=rule, plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
    graph = H.make_graph([node], "topk_gather_dot", [H.make_tensor_value_info("q", et, [None] * 5),
                                                     H.make_tensor_value_info("kc", et, [None] * 4),
                                                     H.make_tensor_value_info("length", TensorProto.INT64, [1])],
                         [H.make_tensor_value_info("s", et, [None] * 5)])
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                        functions=[function_body(opset)], ir_version=10)


def attention_op_model(k: int, rule: int = 0, softcap: float = 0.0, dtype: str = "float32", opset: int = 20,
                       projected: bool = False):
    """A one-node model: AquaAttention(q, kc, vc, length, mask[, P]) -> out with its function body (kernel tests
    and benchmarks; projected: a sixth input ``P`` [Hkv, d, r], q is then the unprojected query)."""
    from onnx import TensorProto
    from onnx import helper as H

    _register_schema()
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    names = ["q", "kc", "vc", "length", "mask"] + ["P"] * projected
    node = H.make_node(ATTENTION, names, ["out"], domain=DOMAIN, name=f"/op/{ATTENTION}",
                       k=k, rule=rule, softcap=float(softcap), plugin_namespace=PLUGIN_NAMESPACE,
                       plugin_version=PLUGIN_VERSION)
    ins = [H.make_tensor_value_info("q", et, [None] * 5), H.make_tensor_value_info("kc", et, [None] * 4),
           H.make_tensor_value_info("vc", et, [None] * 4), H.make_tensor_value_info("length", TensorProto.INT64, [1]),
           H.make_tensor_value_info("mask", TensorProto.FLOAT, [None] * 5)] + \
        [H.make_tensor_value_info("P", et, [None] * 3)] * projected
    graph = H.make_graph([node], "aqua_attention", ins, [H.make_tensor_value_info("out", et, [None] * 5)])
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                        functions=[attention_body(opset, projected)], ir_version=10)


def cache_op_model(op: str, dtype: str = "float32", opset: int = 20):
    """A one-node model: <op>(past, new, length) -> present with its function body (kernel tests)."""
    from onnx import TensorProto
    from onnx import helper as H

    _register_schema()
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    node = H.make_node(op, ["past", "new", "length"], ["present"], domain=DOMAIN, name=f"/op/{op}")
    graph = H.make_graph([node], op, [H.make_tensor_value_info("past", et, [None] * 4),
                                      H.make_tensor_value_info("new", et, [None] * 4),
                                      H.make_tensor_value_info("length", TensorProto.INT64, [1])],
                         [H.make_tensor_value_info("present", et, [None] * 4)])
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                        functions=[cache_update_body(op, opset)], ir_version=10)


OPSET = 20  # standard-op opset of the exported graph and of the function body




def selection_bases(P: torch.Tensor, key_rms: torch.Tensor, r: int, config: AquaConfig) -> tuple:
    """P [Hkv, d, d], key_rms [Hkv, d] -> (query basis, key basis), each [Hkv, d, r].

    The weighted rules rank |q^_i| * w_i with w = rms(k^_i). Scaling q^ by w and k^ by 1/w leaves every
    score q^ . k^ (and any subset of its terms) unchanged and turns that rank into plain |q^'_i|, so the
    nodes and kernels only know magnitude and group rules; the cache then holds k^ / w. w is floored at
    1e-6 of its largest value so a dead coordinate does not divide by zero (such a coordinate is never
    selected by the rule anyway).
    """
    P_r = P[:, :, :r].to(torch.float32)
    if not config.weighted_selection:
        return P_r, P_r
    w = key_rms[:, :r].to(torch.float32)
    w = torch.maximum(w, 1e-6 * w.amax(-1, keepdim=True))[:, None, :]
    return P_r * w, P_r / w


def layer_bases(projection: Projection, config: AquaConfig, contract: Contract, i: int, head_dim: int) -> tuple:
    """((query basis, key basis), P_v) that layer i of an export folds in: the calibrated ones, or the identity when
    nothing is selected or sliced (at k = r without slicing P and P_v cancel exactly, so the dense graph has no
    projection MatMul and its weights are the checkpoint's)."""
    ct = contract
    if ct.selected == ct.widths == ct.value_widths == (head_dim,) * ct.layers:
        eye = torch.eye(head_dim).expand(ct.kv_heads, head_dim, head_dim)
        return (eye, eye), eye
    return selection_bases(projection.P[i], projection.key_rms[i], ct.widths[i], config), projection.P_v[i]


def check_exportable(model, projection: Projection, config: AquaConfig, weights: WeightFormat = WeightFormat()) -> None:
    """Refuse, in one line each, what the export cannot represent."""
    arch = architecture_of(model.config)
    projection.check_model(model)
    if weights.bits == 8 and "router" in arch.layer_weights(arch.layers(model)[0]):
        raise ConfigError("--weights int8 with mixture-of-experts layers: ONNX Runtime's QMoE has no float32-activation "
                          "kernel for 8-bit experts, so parity could not test the export apart from its int8 "
                          "activations: use --weights int4")
    if config.h2o_ratio < 1 and any(arch.window(model.config, i) for i in range(model.config.num_hidden_layers)):
        raise ConfigError(f"AQUA-H2O with {arch.model_type}'s sliding-window layers is not exported (its slots hold "
                          "tokens in no order a window can be measured in): drop --h2o-ratio")


def contract_for(model, config: AquaConfig, dtype: torch.dtype = torch.float32, projection: Projection | None = None
                 ) -> Contract:
    """The graph contract an export of ``model`` with ``config`` has (projection: for an allocated slicing)."""
    from .allocate import layer_widths

    geo = attention_geometry(model)
    widths, value_widths = layer_widths(config, projection, geo["layers"], geo["head_dim"])
    return Contract(layers=geo["layers"], kv_heads=geo["kv_heads"], widths=widths,
                    selected=tuple(config.selected_of(r) for r in widths), value_widths=value_widths,
                    vocab=model.config.vocab_size,
                    dtype={torch.float32: "float32", torch.float16: "float16"}[dtype], h2o=config.h2o_ratio < 1)


def export_onnx(model, projection: Projection, config: AquaConfig, path, dtype: torch.dtype = torch.float32,
                external_data: bool | None = None, progress=None, fused: bool = True,
                weights: WeightFormat = WeightFormat()):
    """Write ``path`` (and ``model.onnx.data`` beside it when the weights are external) from ``model``'s
    weights, one layer at a time. external_data: True forces it, None decides by size (> EXTERNAL_ABOVE).
    fused: attention as one AquaAttention node (False: separate nodes, what TensorRT's plugin takes).
    weights: how the linear layers, the experts, the output layer and the embedding are stored (quantize.py;
    norms, biases, the projections and a MoE router stay in ``dtype``).
    progress(i, layers) is called after each layer. Returns the graph's ModelProto (weights left on disk
    when external)."""
    from .decoder_graph import DecoderGraph, Plan
    from .graph_blocks import MS
    from .onnx_builder import EXTERNAL_ABOVE, GraphBuilder, TensorStore, save_graph

    check_exportable(model, projection, config, weights)
    _register_schema()
    path = Path(path)
    geo = attention_geometry(model)
    d = geo["head_dim"]
    ct = contract_for(model, config, dtype, projection)
    cfg = model.config
    arch = architecture_of(cfg)
    plan = Plan(contract=ct, heads=geo["heads"], head_dim=d, hidden=geo["hidden_size"],
                dense=ct.selected == ct.widths == ct.value_widths == (d,) * ct.layers,
                dtype=dtype, eps=float(getattr(cfg, arch.norm_eps_attr)),
                rotary_dim=2 * arch.rotary(model, 0)[0].numel() if arch.has_rotary else 0, act=arch.mlp_act,
                attn_softcap=arch.attn_softcap(cfg),
                final_softcap=arch.final_softcap(cfg), fused=fused, h2o_ratio=config.h2o_ratio, weights=weights,
                positions=int(getattr(cfg, "max_position_embeddings", None) or 4096))
    params = sum(t.numel() for t in model.parameters())
    if external_data is None:
        external_data = params * torch.finfo(dtype).bits // 8 > EXTERNAL_ABOVE
    data_path = path.parent / (path.name + ".data") if external_data else None
    store = TensorStore(data_path)
    try:
        gb = GraphBuilder(store)
        g = DecoderGraph(gb, plan, {"rule": RULES[config.selection],
                                    "plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION})
        io = g.inputs()
        et = arch.embeddings(model)
        x = g.embed(io["input_ids"], et.weight.detach())  # the residual stream; (stream, pending) after a layer
        if getattr(et, "embed_scale", None) is not None:  # Gemma's scaled embeddings (in the model dtype, as HF)
            x = gb.op("/model/embed_tokens/Scale", "Mul", [x, gb.const(float(et.embed_scale), dtype)])
        wpe = arch.position_embeddings(model)
        if wpe is not None:  # learned absolute positions (GPT-2)
            pos = g.weight("model.embed_positions.weight", wpe.weight.detach())
            x = gb.op("/model/embed_positions/Add", "Add",
                      [x, gb.op("/model/embed_positions/Gather", "Gather", [pos, io["position_ids"]])])
        stream = (x, None)
        for i, layer in enumerate(arch.layers(model)):
            P, P_v = layer_bases(projection, config, ct, i, d)
            rope = g.rotary(io["position_ids"], *arch.rotary(model, i)) if arch.has_rotary else None
            mask = None if ct.h2o else g.mask(io, arch.window(cfg, i))  # H2OAttention masks by its slots
            stream = g.layer(i, stream, arch.layer_weights(layer), P, P_v, arch.attention(layer).scaling, rope, mask,
                             io)
            if progress is not None:
                progress(i + 1, plan.layers)
        head = model.get_output_embeddings()
        tied = getattr(cfg, "tie_word_embeddings", False) and head.weight is et.weight
        g.head(stream, *arch.final_norm(model), head.weight.detach(), "model.embed_tokens.weight" if tied else None)
        g.outputs()
        m = gb.model("aqua_decoder", {"": OPSET, DOMAIN: OPSET_VERSION, MS: 1},
                     function_bodies(OPSET, plan.projects_query), "aqua-export")
    finally:
        store.close()
    if dtype == torch.float16:
        c = g.cast
        m.metadata_props.add(key="float16_cast", value=f"{c['below_float16_normal_range']} of {c['elements']} weights "
                             f"below float16's normal range (6.1e-5) keep fewer mantissa bits; the others are exact "
                             f"from bfloat16 or rounded to float16 from float32")
    save_graph(m, path)
    return m

