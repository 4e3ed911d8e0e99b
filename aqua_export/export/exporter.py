"""The export entry point: a model and its calibration artifact -> model.onnx (and model.onnx.data), one layer at a
time. The graph's I/O and cache layout are contract.Contract's; one decoder layer as exported: see decoder_graph;
the custom nodes and their function bodies: the ops catalogue.

Why dim-major K^: selecting coordinate c of every cached key reads one contiguous row of the cache,
so a fused kernel reads only k/r of the K cache (a [T, d] row-major cache makes it a strided gather).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from .. import capabilities, settings
from ..allocate import head_prices, layer_selected, layer_widths
from ..capabilities import Features
from ..config import AquaConfig, ConfigError
from ..fold import layer_bases
from ..models import architecture_of, attention_geometry
from ..options import GRAPH_OPS
from ..ops import spec
from ..ops.catalogue import function_bodies, register_schemas
from ..projection import Projection
from ..quantize import WeightFormat
from .blocks import MS
from .builder import EXTERNAL_ABOVE, GraphBuilder, TensorStore, save_graph
from ..contract import DEFAULT_CONTEXT, Contract
from .decoder_graph import DecoderGraph, Plan

STANDARD_NEEDS_DENSE_MLP = ("--ops standard writes standard ONNX ops only, and routed experts are ONNX Runtime's MoE "
                            "op: build this mixture-of-experts model with --ops onnxruntime")


def check_exportable(model, projection: Projection, config: AquaConfig, weights: WeightFormat = WeightFormat(),
                     fused: bool = True, ops: str = "onnxruntime") -> None:
    """Refuse, in one line each, what the export cannot represent."""
    arch = architecture_of(model.config)
    projection.check_model(model)
    if ops not in GRAPH_OPS:
        raise ConfigError(f"--ops {ops!r} is unknown: use one of {', '.join(GRAPH_OPS)}")
    if ops == "standard" and weights.quantized:
        raise ConfigError(capabilities.REFUSALS["quantized", "standard"])
    if ops == "standard" and "router" in arch.layer_weights(arch.layers(model)[0]):
        raise ConfigError(STANDARD_NEEDS_DENSE_MLP)
    if weights.bits == 8 and "router" in arch.layer_weights(arch.layers(model)[0]):
        raise ConfigError("--weights int8 with mixture-of-experts layers: ONNX Runtime's QMoE has no float32-activation "
                          "kernel for 8-bit experts, so parity could not test the export apart from its int8 "
                          "activations: use --weights int4")
    arch.check_settings(model.config, config)
    if not fused:  # TensorRT's graph: separate nodes
        capabilities.check(replace(Features.of_config(config), quantized=weights.quantized), "tensorrt")


def contract_for(model, config: AquaConfig, dtype: torch.dtype = torch.float32, projection: Projection | None = None,
                 cache_dtype: str | None = None, fused: bool = True) -> Contract:
    """The graph contract an export of ``model`` with ``config`` has (projection: for an allocated slicing or k;
    cache_dtype: the K^ / V buffers' type, default dtype; fused: ONNX Runtime's graph, TensorRT's otherwise)."""
    geo = attention_geometry(model)
    widths, value_widths = layer_widths(config, projection, geo["layers"], geo["head_dim"])
    return Contract(layers=geo["layers"], kv_heads=geo["kv_heads"], widths=widths,
                    selected=layer_selected(config, projection, widths), value_widths=value_widths,
                    vocab=model.config.vocab_size, dtype=spec.type_name(dtype), h2o=config.evicts,
                    cache_dtype=cache_dtype, prices=head_prices(config, projection), last_logits=fused)


def plan_for(model, config: AquaConfig, contract: Contract, dtype: torch.dtype, fused: bool,
             weights: WeightFormat, ops: str = "onnxruntime") -> Plan:
    """What the graph of ``model`` exported with ``config`` computes (decoder_graph.Plan)."""
    geo, cfg = attention_geometry(model), model.config
    arch, d, ct = architecture_of(cfg), geo["head_dim"], contract
    return Plan(contract=ct, heads=geo["heads"], head_dim=d, hidden=geo["hidden_size"],
                dense=ct.selected == ct.widths == ct.value_widths == (d,) * ct.layers,
                dtype=dtype, eps=float(getattr(cfg, arch.norm_eps_attr)),
                rotary_dim=2 * arch.rotary(model, 0)[0].numel() if arch.has_rotary else 0, act=arch.mlp_act,
                attn_softcap=arch.attn_softcap(cfg),
                final_softcap=arch.final_softcap(cfg), fused=fused, contrib=fused and ops == "onnxruntime",
                weights=weights, positions=int(getattr(cfg, "max_position_embeddings", None) or DEFAULT_CONTEXT),
                selects_tokens=config.selects_tokens)


def export_onnx(model, projection: Projection, config: AquaConfig, path, dtype: torch.dtype = torch.float32,
                external_data: bool | None = None, progress=None, fused: bool = True,
                weights: WeightFormat = WeightFormat(), cache_dtype: str | None = None, ops: str = "onnxruntime"):
    """Write ``path`` (and ``model.onnx.data`` beside it when the weights are external) from ``model``'s
    weights, one layer at a time. external_data: True forces it, None decides by size (> EXTERNAL_ABOVE).
    fused: attention as one AquaAttention node (False: separate nodes, what TensorRT's plugin takes).
    weights: how the linear layers, the experts, the output layer and the embedding are stored (quantize.py;
    norms, biases, the projections and a MoE router stay in ``dtype``). cache_dtype: the KV buffers' type
    (contract.Contract), default dtype. ops: GRAPH_OPS, what the nodes around the custom ones are.
    progress(i, layers) is called after each layer. Returns the graph's ModelProto (weights left on disk
    when external)."""
    check_exportable(model, projection, config, weights, fused, ops)
    register_schemas()
    path = Path(path)
    ct = contract_for(model, config, dtype, projection, cache_dtype, fused)
    if not fused:  # TensorRT's graph: what the contract holds (the cache's type) too
        capabilities.check(Features.of_contract(ct), "tensorrt")
    plan = plan_for(model, config, ct, dtype, fused, weights, ops)
    if external_data is None:
        external_data = sum(t.numel() for t in model.parameters()) * torch.finfo(dtype).bits // 8 > EXTERNAL_ABOVE
    store = TensorStore(path.parent / (path.name + ".data") if external_data else None)
    try:
        gb = GraphBuilder(store)
        g = DecoderGraph(gb, plan, {"plugin_namespace": spec.PLUGIN_NAMESPACE, "plugin_version": spec.PLUGIN_VERSION,
                                    **settings.node_attrs(config)})
        _decoder(g, model, projection, config, progress)
        domains = {"": spec.OPSET, spec.DOMAIN: spec.OPSET_VERSION}
        keyed = any(a.name == "key_weights" for n in gb.nodes if n.domain == spec.DOMAIN for a in n.attribute)
        if any(n.domain == MS for n in gb.nodes):
            domains[MS] = 1
        m = gb.model("aqua_decoder", domains,
                     function_bodies(spec.OPSET, plan.projects_query, config.selects_tokens, ct.prices is not None,
                                     ct.scale_slots > 0, keyed, config.sparse_prefill),
                     "aqua-export")
    finally:
        store.close()
    if dtype == torch.float16:
        c = g.cast
        m.metadata_props.add(key="float16_cast", value=f"{c['below_float16_normal_range']} of {c['elements']} weights "
                             f"below float16's normal range (6.1e-5) keep fewer mantissa bits; the others are exact "
                             f"from bfloat16 or rounded to float16 from float32")
    save_graph(m, path)
    return m


def _decoder(g: DecoderGraph, model, projection: Projection, config: AquaConfig, progress) -> None:
    """The whole graph into g: inputs, embeddings, every layer (weights folded and written as each is built),
    the head, outputs; at accuracy level 4 the quantized products' Ifs on the new tokens (rows_choose_activations)."""
    cfg, gb, ct, d = model.config, g.gb, g.p.contract, g.p.head_dim
    arch = architecture_of(cfg)
    io = g.inputs()
    et = arch.embeddings(model)
    x = g.embed(io["input_ids"], et.weight.detach())  # the residual stream; (stream, pending) after a layer
    if getattr(et, "embed_scale", None) is not None:  # Gemma's scaled embeddings (in the model dtype, as HF)
        x = gb.op("/model/embed_tokens/Scale", "Mul", [x, gb.const(float(et.embed_scale), g.p.dtype)])
    wpe = arch.position_embeddings(model)
    if wpe is not None:  # learned absolute positions (GPT-2)
        pos = g.weight("model.embed_positions.weight", wpe.weight.detach())
        x = gb.op("/model/embed_positions/Add", "Add",
                  [x, gb.op("/model/embed_positions/Gather", "Gather", [pos, io["position_ids"]])])
    stream = (x, None)
    for i, layer in enumerate(arch.layers(model)):
        P, P_v = layer_bases(projection, config, ct, i, d)
        rope = g.rotary(io["position_ids"], *arch.rotary(model, i)) if arch.has_rotary else None
        stream = g.layer(i, stream, arch.layer_weights(layer), P, P_v, arch.attention(layer).scaling, rope,
                         arch.window(cfg, i), io)
        if progress is not None:
            progress(i + 1, ct.layers)
    head = model.get_output_embeddings()
    tied = getattr(cfg, "tie_word_embeddings", False) and head.weight is et.weight
    g.head(stream, *arch.final_norm(model), head.weight.detach(), "model.embed_tokens.weight" if tied else None, io)
    g.outputs()
    g.rows_choose_activations(io["new"])
