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

OP_TYPE = "TopKGatherDot"
KEY_UPDATE, VALUE_UPDATE = "KeyCacheUpdate", "ValueCacheUpdate"
VALUE_PRODUCT = "ValueProduct"
PLUGIN_NAMESPACE = "aqua"
PLUGIN_VERSION = "1"
OPSET_VERSION = 1


# --------------------------------------------------------------------------------------------
# The operator
# --------------------------------------------------------------------------------------------

def topk_gather_dot_reference(query_hat: torch.Tensor, key_cache: torch.Tensor, k: int) -> torch.Tensor:
    """query_hat [B, Hkv, g, T, r], key_cache [B, Hkv, r, S] (dim-major) -> scores [B, Hkv, g, T, S].

    Per query row: I = top-k |q^| (ties -> lower index), scores = q^[I] . K^[I, :].
    """
    r = query_hat.shape[-1]
    if k < r:
        idx = torch.sort(query_hat.abs(), dim=-1, descending=True, stable=True).indices[..., :k]
        query_hat = query_hat * torch.zeros_like(query_hat).scatter_(-1, idx, 1.0)
    return query_hat @ key_cache.unsqueeze(2)


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------

def _register_schema() -> None:
    import onnx
    from onnx.defs import OpSchema

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


def function_body(opset: int):
    """The portable body of TopKGatherDot as an ONNX local function of standard ops.

        query_hat --Abs--> TopK(k, largest, sorted: ties -> lower index) --idx--> ScatterElements(1s into 0s)
        query_hat * keep --MatMul--> Unsqueeze(Slice(key_cache, :total_length), 2) --> scores
    """
    from onnx import TensorProto
    from onnx import helper as H

    import onnx

    # Constant value_int bound to the function's attribute k
    ref = onnx.AttributeProto(name="value_int", type=onnx.AttributeProto.INT, ref_attr_name="k")
    k_const = H.make_node("Constant", [], ["k_scalar"])
    k_const.attribute.append(ref)
    nodes = [
        k_const,
        H.make_node("Constant", [], ["shape_1"], value_ints=[1]),
        H.make_node("Reshape", ["k_scalar", "shape_1"], ["k_1d"]),
        H.make_node("Abs", ["query_hat"], ["magnitude"]),
        H.make_node("TopK", ["magnitude", "k_1d"], ["top_values", "top_indices"], axis=-1, largest=1, sorted=1),
        H.make_node("Shape", ["query_hat"], ["q_shape"]),
        H.make_node("Constant", [], ["zero"], value=H.make_tensor("zero", TensorProto.FLOAT, [], [0.0])),
        H.make_node("CastLike", ["zero", "query_hat"], ["zero_t"]),
        H.make_node("Expand", ["zero_t", "q_shape"], ["zeros"]),
        H.make_node("Shape", ["top_indices"], ["i_shape"]),
        H.make_node("Constant", [], ["one"], value=H.make_tensor("one", TensorProto.FLOAT, [], [1.0])),
        H.make_node("CastLike", ["one", "query_hat"], ["one_t"]),
        H.make_node("Expand", ["one_t", "i_shape"], ["ones"]),
        H.make_node("ScatterElements", ["zeros", "top_indices", "ones"], ["keep"], axis=-1),
        H.make_node("Mul", ["query_hat", "keep"], ["q_selected"]),
        H.make_node("Constant", [], ["axis_2"], value_ints=[2]),
        H.make_node("Constant", [], ["zero_1"], value_ints=[0]),
        H.make_node("Constant", [], ["axis_3"], value_ints=[3]),
        H.make_node("Slice", ["key_cache", "zero_1", "total_length", "axis_3"], ["key_cache_l"]),
        H.make_node("Unsqueeze", ["key_cache_l", "axis_2"], ["key_cache_g"]),
        H.make_node("MatMul", ["q_selected", "key_cache_g"], ["scores"]),
    ]
    return H.make_function(DOMAIN, OP_TYPE, ["query_hat", "key_cache", "total_length"], ["scores"], nodes,
                           [H.make_opsetid("", opset)], attributes=["k", "plugin_namespace", "plugin_version"])


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


def function_bodies(opset: int) -> list:
    """Every custom node's body: a runtime without the native library runs these."""
    return [function_body(opset), cache_update_body(KEY_UPDATE, opset), cache_update_body(VALUE_UPDATE, opset),
            value_product_body(opset)]


def single_op_model(k: int, dtype: str = "float32", opset: int = 20):
    """A one-node model: TopKGatherDot(q, kc, total_length) -> s with its function body (kernel tests and
    benchmarks; the length input is ``length`` [1] int64)."""
    from onnx import TensorProto
    from onnx import helper as H

    _register_schema()
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    node = H.make_node(OP_TYPE, ["q", "kc", "length"], ["s"], domain=DOMAIN, name="/op/TopKGatherDot", k=k,
                       plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
    graph = H.make_graph([node], "topk_gather_dot", [H.make_tensor_value_info("q", et, [None] * 5),
                                                     H.make_tensor_value_info("kc", et, [None] * 4),
                                                     H.make_tensor_value_info("length", TensorProto.INT64, [1])],
                         [H.make_tensor_value_info("s", et, [None] * 5)])
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                        functions=[function_body(opset)], ir_version=10)


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


def check_exportable(model, projection: Projection, config: AquaConfig) -> None:
    """Refuse, in one line each, what the export cannot represent."""
    arch = architecture_of(model.config)
    projection.check_model(model)
    if config.selection != "magnitude":
        raise ConfigError(f"export supports selection='magnitude' (the TopKGatherDot contract); "
                          f"{config.selection!r} is reference-only: drop --selection")
    if config.h2o_ratio < 1 and any(arch.window(model.config, i) for i in range(model.config.num_hidden_layers)):
        raise ConfigError(f"AQUA-H2O with {arch.model_type}'s sliding-window layers is not exported (eviction "
                          "compacts the slots the window is measured in): drop --h2o-ratio")


def contract_for(model, config: AquaConfig, dtype: torch.dtype = torch.float32) -> Contract:
    """The graph contract an export of ``model`` with ``config`` has."""
    geo = attention_geometry(model)
    d = geo["head_dim"]
    return Contract(layers=geo["layers"], kv_heads=geo["kv_heads"], width=config.retained_width(d),
                    selected=config.selected_width(d), vocab=model.config.vocab_size,
                    dtype={torch.float32: "float32", torch.float16: "float16"}[dtype], h2o=config.h2o_ratio < 1)


def export_onnx(model, projection: Projection, config: AquaConfig, path, dtype: torch.dtype = torch.float32,
                external_data: bool | None = None, progress=None):
    """Write ``path`` (and ``model.onnx.data`` beside it when the weights are external) from ``model``'s
    weights, one layer at a time. external_data: True forces it, None decides by size (> EXTERNAL_ABOVE).
    progress(i, layers) is called after each layer. Returns the graph's ModelProto (weights left on disk
    when external)."""
    from .decoder_graph import DecoderGraph, Plan
    from .onnx_builder import EXTERNAL_ABOVE, GraphBuilder, TensorStore, save_graph

    check_exportable(model, projection, config)
    _register_schema()
    path = Path(path)
    geo = attention_geometry(model)
    d = geo["head_dim"]
    ct = contract_for(model, config, dtype)
    cfg = model.config
    arch = architecture_of(cfg)
    plan = Plan(contract=ct, heads=geo["heads"], head_dim=d, hidden=geo["hidden_size"],
                dense=ct.selected == ct.width and config.slice_ratio == 0,
                dtype=dtype, eps=float(getattr(cfg, arch.norm_eps_attr)),
                rotary_dim=2 * arch.rotary(model, 0)[0].numel() if arch.has_rotary else 0, act=arch.mlp_act,
                attn_softcap=arch.attn_softcap(cfg),
                final_softcap=arch.final_softcap(cfg))
    params = sum(t.numel() for t in model.parameters())
    if external_data is None:
        external_data = params * torch.finfo(dtype).bits // 8 > EXTERNAL_ABOVE
    data_path = path.parent / (path.name + ".data") if external_data else None
    store = TensorStore(data_path)
    try:
        gb = GraphBuilder(store)
        g = DecoderGraph(gb, plan, {"k": ct.selected, "plugin_namespace": PLUGIN_NAMESPACE,
                                    "plugin_version": PLUGIN_VERSION})
        io = g.inputs()
        et = arch.embeddings(model)
        embed = g.weight("model.embed_tokens.weight", et.weight.detach())
        x = gb.op("/model/embed_tokens/Gather", "Gather", [embed, io["input_ids"]])
        if getattr(et, "embed_scale", None) is not None:  # Gemma's scaled embeddings (in the model dtype, as HF)
            x = gb.op("/model/embed_tokens/Scale", "Mul", [x, gb.const(float(et.embed_scale), dtype)])
        wpe = arch.position_embeddings(model)
        if wpe is not None:  # learned absolute positions (GPT-2)
            pos = g.weight("model.embed_positions.weight", wpe.weight.detach())
            x = gb.op("/model/embed_positions/Add", "Add",
                      [x, gb.op("/model/embed_positions/Gather", "Gather", [pos, io["position_ids"]])])
        eye = torch.eye(d).expand(geo["kv_heads"], d, d)
        cos = sin = None
        for i, layer in enumerate(arch.layers(model)):
            P, P_v = (eye, eye) if plan.dense else (projection.P[i], projection.P_v[i])
            if arch.has_rotary:
                cos, sin = g.rotary(io["position_ids"], *arch.rotary(model, i))
            mask = g.mask(io, arch.window(cfg, i))
            x = g.layer(i, x, arch.layer_weights(layer), P, P_v, arch.attention(layer).scaling, cos, sin, mask, io)
            if progress is not None:
                progress(i + 1, plan.layers)
        head = model.get_output_embeddings()
        tied = getattr(cfg, "tie_word_embeddings", False) and head.weight is et.weight
        g.head(x, *arch.final_norm(model), head.weight.detach(), embed if tied else None)
        g.outputs()
        m = gb.model("aqua_decoder", {"": OPSET, DOMAIN: OPSET_VERSION}, function_bodies(OPSET), "aqua-export")
    finally:
        store.close()
    if dtype == torch.float16:
        c = g.cast
        m.metadata_props.add(key="float16_cast", value=f"{c['below_float16_normal_range']} of {c['elements']} weights "
                             f"below float16's normal range (6.1e-5) keep fewer mantissa bits; the others are exact "
                             f"from bfloat16 or rounded to float16 from float32")
    save_graph(m, path)
    return m

