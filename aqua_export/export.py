"""ONNX export: rewrite passes, the TopKGatherDot custom node with a portable function body, KV-cache I/O.

Graph contract (DESIGN.md 4), per layer i, with r the retained width:

    inputs  input_ids [B, T] int64, attention_mask [B, P+T] int64, position_ids [B, T] int64,
            past_key_values.{i}.key   [B, Hkv, r, P]   K^ dim-major (one contiguous row of P per coordinate)
            past_key_values.{i}.value [B, Hkv, P, r]   V in P_v's basis
    outputs logits [B, T, V], present.{i}.key [B, Hkv, r, P+T], present.{i}.value [B, Hkv, P+T, r]

One decoder layer's attention, as exported:

    h --q_proj(scale folded)--> RoPE --MatMul P_r--> q^ [B,Hkv,g,T,r] --\\
    h --k_proj--> RoPE --MatMul P_r--> Transpose --Concat(past.key)------> TopKGatherDot(k) --> +mask --> Softmax
    h --v_proj(P_v folded, r rows)-----------------Concat(past.value)--------------------------------------> MatMul
      --> o_proj(P_v^T folded, r columns) --> residual

Why dim-major K^: selecting coordinate c of every cached key reads one contiguous row of P values,
so a fused kernel reads only k/r of the K cache (a [T, d] row-major cache makes it a strided gather).
"""

from __future__ import annotations

import torch
from torch import nn

from .calibrate import Projection
from .config import AquaConfig, ConfigError
from .fold import fold_output, fold_scale_into_query, fold_value
from .models import architecture_of, attention_geometry

DOMAIN = "com.aqua"
OP_TYPE = "TopKGatherDot"
PLUGIN_NAMESPACE = "aqua"
PLUGIN_VERSION = "1"
OPSET_VERSION = 1
KV_CACHE_MODES = ("concat", "shared")


# --------------------------------------------------------------------------------------------
# The operator as a torch custom op (registered on first use, not on import)
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


_OP = None


def topk_gather_dot_op():
    """torch.ops.aqua.topk_gather_dot, defined once per process."""
    global _OP
    if _OP is None:
        if not hasattr(torch.ops.aqua, "topk_gather_dot"):
            lib = torch.library.custom_op("aqua::topk_gather_dot", mutates_args=())(
                _typed_reference)
            lib.register_fake(lambda q, kc, k: q.new_empty(*q.shape[:-1], kc.shape[-1]))
        _OP = torch.ops.aqua.topk_gather_dot
    return _OP


def _typed_reference(query_hat: torch.Tensor, key_cache: torch.Tensor, k: int) -> torch.Tensor:
    return topk_gather_dot_reference(query_hat, key_cache, k)


# --------------------------------------------------------------------------------------------
# The export module
# --------------------------------------------------------------------------------------------

class AquaAttentionExport(nn.Module):
    """One layer's attention with the passes applied. Weights are copies: the HF model is untouched."""

    def __init__(self, attn, P: torch.Tensor, P_v: torch.Tensor, r: int, k: int, heads: int, kv_heads: int,
                 d: int, scaling: float, layer_idx: int):
        super().__init__()
        self.h, self.hkv, self.g, self.d, self.r, self.k = heads, kv_heads, heads // kv_heads, d, r, k
        self.layer_idx = layer_idx

        def linear(w, b):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            lin.weight.data.copy_(w)
            if b is not None:
                lin.bias.data.copy_(b)
            return lin

        with torch.no_grad():
            # pass 1: fold the attention scale into W_Q (RoPE and P are linear)
            self.q_proj = linear(*fold_scale_into_query(attn.q_proj.weight, attn.q_proj.bias, scaling))
            self.k_proj = linear(attn.k_proj.weight, attn.k_proj.bias)
            # pass 2: fold P_v into W_V and P_v^T into W_O, keep the first r coordinates (AQUA-Memory)
            wv, bv = fold_value(attn.v_proj.weight, attn.v_proj.bias, P_v)
            keep = torch.arange(kv_heads * d).reshape(kv_heads, d)[:, :r].reshape(-1)
            self.v_proj = linear(wv[keep], None if bv is None else bv[keep])
            wo = fold_output(attn.o_proj.weight, P_v, self.g)
            keep_o = torch.arange(heads * d).reshape(heads, d)[:, :r].reshape(-1)
            self.o_proj = linear(wo[:, keep_o], attn.o_proj.bias)
        # pass 3: P cannot fold into W_Q/W_K under RoPE; it is applied after the rotation
        self.register_buffer("P_r", P[:, :, :r].contiguous().clone(), persistent=False)

    def forward(self, x, cos, sin, mask_add, past_k, past_v, cache_position=None):
        """x [B, T, D]; cos/sin [B, T, d]; mask_add [B, 1 or Hkv, 1, T, S]; past_k [B, Hkv, r, P]; past_v [B, Hkv, P, r].

        Returns (attention output [B, T, D], present key, present value, weights [B, Hkv, T, S] summed over g)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.hkv, self.r).transpose(1, 2)
        c, s = cos[:, None], sin[:, None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        qh = q.reshape(b, self.hkv, self.g, t, self.d) @ self.P_r[None, :, None]
        kh = (k @ self.P_r[None]).transpose(-1, -2)
        if cache_position is None:
            key_cache = torch.cat([past_k, kh], dim=-1)
            value_cache = torch.cat([past_v, v], dim=2)
        else:
            # shared buffer: write the new entries into their slots (ScatterElements); with past and present
            # bound to one buffer ONNX Runtime updates it in place instead of copying the cache every step
            key_cache = past_k.scatter(3, cache_position[None, None, None, :].expand(b, self.hkv, self.r, t), kh)
            value_cache = past_v.scatter(2, cache_position[None, None, :, None].expand(b, self.hkv, t, self.r), v)
        scores = topk_gather_dot_op()(qh, key_cache, self.k) + mask_add
        w = torch.softmax(scores, dim=-1)
        out = w @ value_cache[:, :, None]  # [B, Hkv, g, T, r]
        out = out.permute(0, 3, 1, 2, 4).reshape(b, t, self.h * self.r)
        # H2O's heavy-hitter statistic: attention summed over the query heads of the group
        return self.o_proj(out), key_cache, value_cache, w.sum(2)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class AquaExportModel(nn.Module):
    """A causal LM with AQUA attention and flat KV-cache I/O, built from an HF model."""

    def __init__(self, model, projection: Projection, config: AquaConfig, kv_cache: str = "concat"):
        """kv_cache: "concat" (present = past + new, new tensors every step) or "shared" (past and present are
        one buffer of a capacity the runtime chooses; new entries are written at cache_position)."""
        super().__init__()
        if kv_cache not in KV_CACHE_MODES:
            raise ConfigError(f"--kv-cache must be one of {KV_CACHE_MODES}, got {kv_cache!r}")
        if kv_cache == "shared" and config.h2o_ratio < 1:
            raise ConfigError("AQUA-H2O compacts its cache between tokens: use --kv-cache concat with --h2o-ratio")
        self.kv_cache = kv_cache
        architecture_of(model.config)
        projection.check_model(model)
        if config.selection != "magnitude":
            raise ConfigError(f"export supports selection='magnitude' (the TopKGatherDot contract); "
                              f"{config.selection!r} is reference-only: drop --selection")
        # AQUA-H2O: eviction is a runtime decision between steps (runtime.H2OState); the graph takes
        # each layer's per-head slot validity and returns the attention weights it accumulates
        self.h2o = config.h2o_ratio < 1
        geo = attention_geometry(model)
        self.geo = geo
        d = geo["head_dim"]
        self.r, self.k = config.retained_width(d), config.selected_width(d)
        # At k = r and no slicing nothing is selected or dropped: P and P_v cancel exactly in the maths,
        # so the export uses identity projections (no O(d^2) per-step cost, no extra rounding).
        self.dense = self.k == self.r and config.slice_ratio == 0
        eye = torch.eye(d).expand(geo["kv_heads"], d, d).contiguous()
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        rot = model.model.rotary_emb
        self.register_buffer("inv_freq", rot.inv_freq.detach().clone(), persistent=False)
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self.ln1 = nn.ModuleList(layer.input_layernorm for layer in model.model.layers)
        self.ln2 = nn.ModuleList(layer.post_attention_layernorm for layer in model.model.layers)
        self.mlp = nn.ModuleList(layer.mlp for layer in model.model.layers)
        self.attn = nn.ModuleList(
            AquaAttentionExport(layer.self_attn, eye if self.dense else projection.P[i],
                                eye if self.dense else projection.P_v[i], self.r, self.k, geo["heads"],
                                geo["kv_heads"], d, layer.self_attn.scaling, i)
            for i, layer in enumerate(model.model.layers))

    def forward(self, input_ids, attention_mask, position_ids, *past):
        """past = (key_0, value_0, key_1, value_1, ...), or with H2O (key_0, value_0, valid_0, ...), or with the
        shared cache (cache_position, key_0, value_0, ...).

        Returns (logits, present key_0, value_0, ...[, attention_weights_0, ...] with H2O)."""
        cache_position = None
        if self.kv_cache == "shared":
            cache_position, past = past[0], past[1:]
        x = self.embed(input_ids)
        b, t = input_ids.shape
        s = attention_mask.shape[1]
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (emb.cos() * self.rope_scale).to(x.dtype), (emb.sin() * self.rope_scale).to(x.dtype)
        neg = torch.finfo(x.dtype).min
        # causal + padding: key j is visible to query i iff j <= (S - T) + i (concat) or j <= cache_position[i]
        # (shared buffer), and attention_mask[b, j] == 1
        j = torch.arange(s, device=x.device)
        qpos = torch.arange(t, device=x.device) + (s - t) if cache_position is None else cache_position
        ok = (j[None, :] <= qpos[:, None])[None] & attention_mask[:, None, :].to(torch.bool)
        mask_add = torch.where(ok, 0.0, neg).to(x.dtype)[:, None, None]  # [B, 1, 1, T, S]
        n = 3 if self.h2o else 2
        presents, weights = [], []
        for i in range(len(self.attn)):
            m = mask_add
            if self.h2o:
                # past slots: this layer's per-head validity (evicted or padding -> masked); new tokens: as above
                valid = past[n * i + 2]
                p = valid.shape[-1]
                past_add = torch.where(valid, 0.0, neg).to(x.dtype)[:, :, None, None, :].expand(-1, -1, 1, t, -1)
                m = torch.cat([past_add, mask_add[..., p:].expand(-1, valid.shape[1], -1, -1, -1)], dim=-1)
            a, kc, vc, w = self.attn[i](self.ln1[i](x), cos, sin, m, past[n * i], past[n * i + 1], cache_position)
            x = x + a
            x = x + self.mlp[i](self.ln2[i](x))
            presents += [kc, vc]
            weights.append(w)
        return (self.lm_head(self.norm(x)), *presents, *(weights if self.h2o else ()))

    def empty_past(self, batch: int, dtype=torch.float32) -> list[torch.Tensor]:
        hkv = self.geo["kv_heads"]
        out = []
        for _ in range(self.geo["layers"]):
            out += [torch.zeros(batch, hkv, self.r, 0, dtype=dtype), torch.zeros(batch, hkv, 0, self.r, dtype=dtype)]
            if self.h2o:
                out.append(torch.zeros(batch, hkv, 0, dtype=torch.bool))
        return out


def io_names(layers: int, h2o: bool = False, shared: bool = False) -> tuple[list[str], list[str]]:
    """Graph input and output names. H2O adds past_key_values.{i}.valid [B, Hkv, P] (bool) and
    attention_weights.{i} [B, Hkv, T, P+T] (softmax summed over the group's query heads); the shared
    cache adds cache_position [T] (the buffer slots the new tokens are written to)."""
    ins = ["input_ids", "attention_mask", "position_ids"] + (["cache_position"] if shared else [])
    outs = ["logits"]
    for i in range(layers):
        ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"] + ([f"past_key_values.{i}.valid"] if h2o else [])
        outs += [f"present.{i}.key", f"present.{i}.value"]
    outs += [f"attention_weights.{i}" for i in range(layers)] if h2o else []
    return ins, outs


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------

def _register_schema() -> None:
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    onnx.defs.register_schema(OpSchema(
        OP_TYPE, DOMAIN, OPSET_VERSION,
        doc="scores = q^[I] . K^[I, :] with I = top-k |q^| per query row (ties: lower index); K^ dim-major",
        inputs=[OpSchema.FormalParameter("query_hat", "T"), OpSchema.FormalParameter("key_cache", "T")],
        outputs=[OpSchema.FormalParameter("scores", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
        attributes=[OpSchema.Attribute("k", OpSchema.AttrType.INT, "coordinates kept per query"),
                    OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                    OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version")],
    ))


def function_body(opset: int):
    """The portable body of TopKGatherDot as an ONNX local function of standard ops.

        query_hat --Abs--> TopK(k, largest, sorted: ties -> lower index) --idx--> ScatterElements(1s into 0s)
        query_hat * keep --MatMul--> Unsqueeze(key_cache, 2) --> scores
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
        H.make_node("Unsqueeze", ["key_cache", "axis_2"], ["key_cache_g"]),
        H.make_node("MatMul", ["q_selected", "key_cache_g"], ["scores"]),
    ]
    return H.make_function(DOMAIN, OP_TYPE, ["query_hat", "key_cache"], ["scores"], nodes,
                           [H.make_opsetid("", opset)], attributes=["k", "plugin_namespace", "plugin_version"])


def single_op_model(k: int, dtype: str = "float32", opset: int = 20):
    """A one-node model: TopKGatherDot(q, kc) -> s with its function body (kernel tests and benchmarks)."""
    from onnx import TensorProto
    from onnx import helper as H

    _register_schema()
    et = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    node = H.make_node(OP_TYPE, ["q", "kc"], ["s"], domain=DOMAIN, name="/op/TopKGatherDot", k=k,
                       plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)
    graph = H.make_graph([node], "topk_gather_dot", [H.make_tensor_value_info("q", et, [None] * 5),
                                                     H.make_tensor_value_info("kc", et, [None] * 4)],
                         [H.make_tensor_value_info("s", et, [None] * 5)])
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset), H.make_opsetid(DOMAIN, OPSET_VERSION)],
                        functions=[function_body(opset)], ir_version=10)


def _translate(query_hat, key_cache, k: int):
    import onnxscript

    aqua = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
    return aqua.TopKGatherDot(query_hat, key_cache, k=k, plugin_namespace=PLUGIN_NAMESPACE,
                              plugin_version=PLUGIN_VERSION)


def export_onnx(model, projection: Projection, config: AquaConfig, path, dtype: torch.dtype = torch.float32,
                kv_cache: str = "concat"):
    """Export to ``path`` (written by the caller into a temporary folder). Returns the ONNX ModelProto."""
    import onnx

    _register_schema()
    if dtype != torch.float32:
        import copy

        model = copy.deepcopy(model)  # the export module shares norms/MLP/embeddings with the model it wraps
    em = AquaExportModel(model, projection, config, kv_cache).to(dtype).eval()
    geo = em.geo
    shared = kv_cache == "shared"
    ins, outs = io_names(geo["layers"], em.h2o, shared)
    # example sizes >= 2 everywhere, or the exporter freezes them (DESIGN.md 4)
    b, t, p = 2, 3, 4
    ids = torch.randint(3, model.config.vocab_size, (b, t))
    mask = torch.ones(b, p + t, dtype=torch.long)
    pos = torch.arange(p, p + t)[None].expand(b, t).contiguous()
    past = [torch.arange(1, 1 + t)] if shared else []  # shared: a buffer of p slots, tokens written at 1..t
    for _ in range(geo["layers"]):
        past += [torch.randn(b, geo["kv_heads"], em.r, p, dtype=dtype), torch.randn(b, geo["kv_heads"], p, em.r, dtype=dtype)]
        if em.h2o:
            past.append(torch.rand(b, geo["kv_heads"], p) < 0.7)
    # named batch / sequence / past; AUTO lets torch.export derive attention_mask = past + sequence
    B, T, P = (torch.export.Dim(n, min=1) for n in ("batch", "sequence", "past"))
    S = torch.export.Dim.AUTO
    if shared:
        mask = torch.ones(b, p, dtype=torch.long)
        S = P  # the mask covers the buffer
    dyn_past = [{0: T}] if shared else []
    for _ in range(geo["layers"]):
        dyn_past += [{0: B, 3: P}, {0: B, 2: P}] + ([{0: B, 2: P}] if em.h2o else [])
    dynamic_shapes = ({0: B, 1: T}, {0: B, 1: S}, {0: B, 1: T}, tuple(dyn_past))  # *past: a tuple (DESIGN.md 7)
    op = topk_gather_dot_op()
    import logging
    import warnings

    # torch's exporter logs every torchvision op it cannot register; none are used here
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used")
        prog = torch.onnx.export(
            em, (ids, mask, pos, *past), dynamo=True, input_names=ins, output_names=outs,
            dynamic_shapes=dynamic_shapes, custom_translation_table={op.default: _translate},
            optimize=True, verbose=False,
        )
    m = prog.model_proto
    opset = next(o.version for o in m.opset_import if o.domain == "")
    m.functions.append(function_body(opset))
    if not any(o.domain == DOMAIN for o in m.opset_import):
        m.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    _name_nodes(m)
    onnx.save(m, str(path), save_as_external_data=m.ByteSize() > 1_800_000_000, all_tensors_to_one_file=True,
              location="model.onnx.data")
    return m


def _name_nodes(m) -> None:
    """Stable names for the custom nodes: /model/layers.{i}/attn/TopKGatherDot, in layer order."""
    i = 0
    for n in m.graph.node:
        if n.domain == DOMAIN and n.op_type == OP_TYPE:
            n.name = f"/model/layers.{i}/attn/TopKGatherDot"
            i += 1
