"""Rewrites of a built folder's graph that the parity harness runs beside it (each saved next to model.onnx so
that it shares model.onnx.data, opened by path, removed after):

    float32_weight_casts   float16 folders: explicit per-node weight casts (no float32 copy of the weights)
    set_k(k)               every attention node scores k coordinates, evicts and selects nothing (the graph at k = r)
    selection_outputs      the attention nodes inlined, each layer's TopK indices (or shared-k keep mask) exposed
    float_activations      quantized folders: MatMulNBits / QMoE with float32 activations (accuracy_level 0)
    float32_cache(ct)      float16 caches under a float32 graph: the caches float32 (the graph the reference computes)
    all_logits             a last_logits graph computing every position's logits (perplexity, lm-eval, parity)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

from ..ops import matmul_q4a8
from ..ops.catalogue import OPS
from ..ops.spec import DOMAIN, ONNX
from .builder import load_graph, save_graph
from ..contract import Contract
from .decoder_graph import CACHE_CAST, CACHE_QUANT


@contextlib.contextmanager
def graph_variant(model_path: Path, tag: str, *transforms):
    """A rewritten copy of the folder's graph, saved beside it so that it shares ``model.onnx.data`` (no
    copy of the weights, opened by path like every session); removed on exit. No transform: the file itself."""
    model_path = Path(model_path)
    if not transforms:
        yield model_path
        return
    m = load_graph(model_path)
    for t in transforms:
        m = t(m) or m
    fd, name = tempfile.mkstemp(prefix=f".{model_path.stem}.{tag}.", suffix=".onnx", dir=model_path.parent)
    os.close(fd)  # a name of its own: nothing of the folder's is overwritten
    out = Path(name)
    try:
        save_graph(m, out)
        del m
        yield out
    finally:
        out.unlink(missing_ok=True)


def float32_weight_casts(m):
    """Every MatMul / Gemm reading a large float16 weight gets explicit Casts to float32 around it.

    ONNX Runtime's CPU provider has no float16 MatMul: it inserts exactly these casts itself but stores
    the weights' float32 casts as new initializers, doubling the model in memory. Written into the graph
    and left unfolded (make_session(lean=True)), each weight is cast while its node runs: same arithmetic,
    the memory of the float16 weights."""
    from onnx import TensorProto
    from onnx import helper as H

    def numel(t):
        n = 1
        for d in t.dims:
            n *= d
        return n

    big = {t.name for t in m.graph.initializer if t.data_type == TensorProto.FLOAT16 and numel(t) >= 1 << 16}
    nodes = []
    for node in m.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or not big.intersection(node.input):
            nodes.append(node)
            continue
        ins = []
        for j, x in enumerate(node.input):
            c = f"{node.name}/to_float32_{j}"
            nodes.append(H.make_node("Cast", [x], [c], name=c, to=TensorProto.FLOAT))
            ins.append(c)
        out = node.output[0]
        del node.input[:]
        node.input.extend(ins)
        node.output[0] = f"{out}/float32"
        nodes.append(node)
        nodes.append(H.make_node("Cast", [f"{out}/float32"], [out], name=f"{node.name}/to_float16",
                                 to=TensorProto.FLOAT16))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    # ONNX Runtime replaces a Cast of a constant initializer by a float32 copy of it, folding or not; an
    # initializer that is also a graph input may be overridden at run time, so it is not constant: the
    # Casts stay run-time work (the inputs are never fed: their initializers are the defaults)
    for t in m.graph.initializer:
        if t.name in big:
            m.graph.input.append(H.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return m


def set_k(k: int):
    """The graph with every attention node scoring k coordinates, H2O nodes evicting nothing, token selection
    attending every token, sparse prefill every key block and the prompt's products in float32 (HF does none of
    these)."""
    from .. import settings

    selecting = {op.name for op in OPS if "k" in op.attribute_names}
    neutral = {"k": k} | {a: v for m in settings.MECHANISMS for a, v in m.neutral.items()}  # the mechanisms' own

    def transform(m):
        for n in m.graph.node:
            if n.domain == DOMAIN and n.op_type in selecting:
                for a in n.attribute:
                    if a.name in neutral:  # an int attribute's i, a float's f (onnx.AttributeProto.INT / FLOAT)
                        setattr(a, "f" if a.type == a.FLOAT else "i", neutral[a.name])
    return transform


def selection_outputs(m):
    """The graph with its attention nodes inlined and each layer's selection as extra outputs, in layer order: the
    TopK indices of a row's coordinates (and of token selection's pages), or a shared-k node's keep mask (its
    pool_keep [B,Hkv,g,T,r] bool, nodes.pool_nodes) in place of its coordinates' TopKs, and sparse prefill's kept
    keys (pf_keep_rows [B,Hkv,T,L] bool, ops/prefill.py)."""
    import onnx
    import onnx.inliner

    own = {n.name for n in m.graph.node if n.op_type == "TopK"}  # the graph's own TopKs (an MoE router's)
    m = onnx.inliner.inline_local_functions(m)

    def call(name):  # the inliner suffixes each call's names: <name>__<i>
        return name.split("__")[0], name.rpartition("__")[2]

    pooled = {call(n.output[0])[1] for n in m.graph.node if n.output and call(n.output[0])[0] == "pool_keep"}
    for n in m.graph.node:
        if n.op_type == "TopK" and n.name not in own:
            base, at = call(n.output[1])
            if at in pooled and (base == "top_indices" or base.startswith("pool_")) or base.startswith("pf_"):
                continue  # (pf_: sparse prefill's estimate and block order, not a selection the reference replays)
            m.graph.output.append(onnx.helper.make_tensor_value_info(n.output[1], onnx.TensorProto.INT64, None))
        elif n.output and call(n.output[0])[0] in ("pool_keep", "pf_keep_rows"):
            m.graph.output.append(onnx.helper.make_tensor_value_info(n.output[0], onnx.TensorProto.BOOL, None))
    return m


def float32_cache(ct):
    """The graph of contract ``ct`` with its KV buffers (float16 or int8: ct.cache_dtype) in ct.dtype: the past /
    present inputs and outputs retyped (an int8 cache's also narrowed by its scale code), the casts that round the new
    tokens (decoder_graph.CACHE_CAST) made Identity, the QuantizeRows nodes writing int8 rows (CACHE_QUANT) bypassed,
    K^'s dim-major view r rows again, and AquaAttention's float-cache body. What is left is the export the reference
    computes; the folder's own run shows what the narrow cache changes."""
    wide, extra = ONNX[ct.dtype], ct.scale_slots
    buffers = {name(i, kind) for i in range(ct.layers) for kind in ct.KV for name in (ct.past, ct.present)}

    def transform(m):
        for v in list(m.graph.input) + list(m.graph.output):
            if v.name in buffers:
                v.type.tensor_type.elem_type = wide
                last = v.type.tensor_type.shape.dim[-1]
                if extra and last.HasField("dim_value"):
                    last.dim_value -= extra
        for n in m.graph.node:
            if n.op_type == "Cast" and n.name.endswith(f"/{CACHE_CAST}"):
                n.op_type = "Identity"
                del n.attribute[:]
        if extra:
            _without_int8_rows(m, ct)
    return transform


def _without_int8_rows(m, ct) -> None:
    """An int8-cache graph made float: each cache update takes the float k^ / v its int8 rows were made from, the
    row-making nodes go, K^'s view has r rows, and AquaAttention carries its float-cache body."""
    from onnx import numpy_helper

    from ..ops import aqua_attention

    quant = [n for n in m.graph.node if n.name.endswith(f"/{CACHE_QUANT}")]
    source = {n.output[0]: n.input[0] for n in quant}
    for n in m.graph.node:
        for j, x in enumerate(n.input):
            n.input[j] = source.get(x, x)
        if n.op_type == "AquaAttention":
            kept = [a for a in n.attribute if a.name != "cache_scales"]
            del n.attribute[:]
            n.attribute.extend(kept)
    for n in quant:
        m.graph.node.remove(n)
    for n in m.graph.node:
        if n.name.endswith("/k/DimMajorView"):
            layer = int(n.name.split("layers.")[1].split("/")[0])
            name = f"{n.name}/rows_{ct.widths[layer]}"
            m.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, ct.widths[layer], -1], np.int64), name))
            n.input[1] = name
    for i, f in enumerate(m.functions):
        if f.name == aqua_attention.OP.name:
            attrs = set(f.attribute)
            body = aqua_attention.OP.bodied(
                next(o.version for o in f.opset_import if o.domain == ""), "projection" in f.input,
                tokens="token_ratio" in attrs, pooled="head_prices" in attrs, scaled=False,
                keyed="key_weights" in attrs, prefill="prefill_threshold" in attrs)
            m.functions[i].CopyFrom(body)


def all_logits(m):
    """The graph whose constant all_logits (contract.Contract, last_logits) becomes an input of the same name, [1]
    int64 that runtime.lm.OrtLM feeds each forward: 1, the head computes every position's logits (perplexity,
    lm-eval's loglikelihood, parity); 0, each sequence's last row alone (a prompt generated from: lm-eval's
    generate_until). A graph without the constant is returned as it is."""
    from onnx import TensorProto
    from onnx import helper as H

    for i, t in enumerate(m.graph.initializer):
        if t.name == Contract.ALL_LOGITS:
            del m.graph.initializer[i]  # an input, not an overridable initializer: ONNX Runtime binds only inputs
            m.graph.input.append(H.make_tensor_value_info(Contract.ALL_LOGITS, TensorProto.INT64, [1]))
            break
    return m


def float_activations(m):
    """The graph with every quantized MatMul and expert op computing its activations in float32 (accuracy_level 0;
    MatMulQ4A8 made MatMulNBits again, MatMulQ4A8Gated MatMulNBits with its gate in standard ops after it): the
    folder's int8 activations (level 4: MatMulQ4A8's blocks at every row count for int4 weights, MatMulNBits' on a
    decode step's few rows for int8 ones) round the input of each quantized MatMul per block, which is the weight
    format's choice, not the export's; parity gates the export without it and reports it apart."""

    def walk(graph):
        gated = [i for i, n in enumerate(graph.node) if n.domain == DOMAIN and n.op_type == matmul_q4a8.GATED.name]
        for i in reversed(gated):  # the gate after each product: nodes inserted, the later ones first
            matmul_q4a8.to_nbits_gated(graph, i)
        for n in graph.node:
            if n.domain == DOMAIN and n.op_type == matmul_q4a8.OP.name:  # int4 weights' int8 activation blocks
                matmul_q4a8.to_nbits(n)
            if n.domain == "com.microsoft" and n.op_type in ("MatMulNBits", "QMoE"):
                for a in n.attribute:
                    if a.name == "accuracy_level":
                        a.i = 0
            for a in n.attribute:  # blocks.Blocks.rows_choose_activations' Ifs: both branches
                if a.type == a.GRAPH:
                    walk(a.g)

    walk(m.graph)
    return m
