"""The decoder as an ONNX graph, built layer by layer from the weights (no tracing).

Per layer i, with g = H / Hkv, r the retained width and k the selected width (docs/design.md):

    x --RMSNorm--> h
    h --q|k|v_proj as one MatMul, Split (scale folded into q)--> RoPE --> q [B,Hkv,g,T,d], P_q [Hkv,d,r] ----------\
    h --k_proj--> RoPE --MatMul P_k--> [B,Hkv,T,r] --KeyCacheUpdate(past.key, L)--> present.key                    |
                                           present.key viewed [B,Hkv,r,C] (dim-major) -----------------------> AquaAttention
    h --v_proj (P_v folded, r rows)--> [B,Hkv,T,r] --ValueCacheUpdate(past.value, L)--> present.value -------> (k, rule,
                                                                                    attention_mask [B, L] --> softcap,
                                                                                                     sliding_window)
      <-- [B,Hkv,g,T,r]: q^ = q P_q, softmax(q^[I] . K^[I, :L] + mask) @ V[:L] in one pass over the cache
      --> [B,T,H*r] --o_proj (P_v^T folded, r columns)--> + x --RMSNorm--> gated MLP --> + --> next layer

P_q = P_k = P[:, :r] except under the weighted rules (fold.selection_bases: P_q = P_r w, P_k = P_r / w; under an int8
cache P_k = P_r / w^s and the node's key_weights w^(1 - s)). TensorRT builds (whose plugin
is TopKGatherDot) run q --MatMul P_q--> q^, TopKGatherDot, Softmax and ValueProduct as separate nodes
instead. AQUA-H2O replaces the cache updates and AquaAttention by one node over the layer's slot buffers
(h2o.py), given q and P_q as AquaAttention is:

    q, k^, v, past.{key, value, heavy, token}, attention_mask, P_q --H2OAttention(k, rule, softcap, ratio)-->
        [B,Hkv,g,T,r], present.{key, value, heavy, token}       (written in place when bound to the past)

What the families change (archs/): q/k RMSNorms before RoPE (the scale then folds into q_norm), partial
rotary, per-layer sliding-window masks, soft-capping of the scores before the mask, norms on the block
outputs, GELU or routed-expert MLPs, LayerNorm; without a rotary embedding P folds into q_proj / k_proj and
both RoPE and the P MatMuls disappear.

L = attention_mask.shape[1] is the sequence so far; the cache contract (buffers shared with onnxruntime-genai,
in-place writes, positions from the mask) is contract.Contract's.

Node names are stable paths (``/model/layers.3/attn/AquaAttention``); every weight is folded in
float32 from the model's own tensors and written to the TensorStore the moment it is made, so only one
layer's folded weights exist at a time. At k = r without slicing P and P_v cancel exactly, so the dense
graph has no projection MatMul at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onnx import TensorProto

from ..fold import attention_projections
from ..ops import aqua_attention, cache_update, h2o_attention, logit_rows, quantize_rows, topk_gather_dot, value_product
from ..ops.spec import DOMAIN, ONNX
from ..quantize import WeightFormat
from .blocks import Blocks, stack
from .builder import GraphBuilder, onnx_type
from ..contract import Contract

F32 = TensorProto.FLOAT
ATTENTION, H2O, SCORES = aqua_attention.OP.name, h2o_attention.OP.name, topk_gather_dot.OP.name
ROWS, QUANTIZE = logit_rows.OP.name, quantize_rows.OP.name
KEY_UPDATE, VALUE_UPDATE, VALUE_PRODUCT = cache_update.KEY.name, cache_update.VALUE.name, value_product.OP.name
CACHE_CAST = "CastCache"  # the node names' last part of the casts rounding new k^ / v to a float16 cache
CACHE_QUANT = "QuantizeCache"  # the node names' last part of the QuantizeRows writing new k^ / v as int8 rows


@dataclass(frozen=True)
class Plan:
    """What the graph computes beyond its contract (which fixes layers, KV heads, widths, vocabulary and
    H2O): the model's shapes and numerics. dtype: the exported float type."""

    contract: Contract
    heads: int
    head_dim: int
    hidden: int
    dense: bool
    dtype: torch.dtype
    eps: float
    rotary_dim: int  # coordinates of each head that RoPE rotates (head_dim unless partial rotary)
    act: str = "silu"  # gated MLP activation: silu or gelu_tanh
    attn_softcap: float | None = None  # scores -> tanh(scores / c) * c before the mask
    final_softcap: float | None = None  # logits -> tanh(logits / c) * c
    fused: bool = True  # ONNX Runtime: one AquaAttention node per layer; False: TensorRT's nodes (TopKGatherDot,
    #                     Softmax, ValueProduct)
    contrib: bool = True  # ONNX Runtime's contrib fusions for rotary and norms (RotaryEmbedding, SkipSimplified-
    #                       LayerNormalization); False: standard ops (any ONNX consumer; TensorRT)
    positions: int = 4096  # the rotary tables' positions (the model's context)
    weights: WeightFormat = WeightFormat()  # the linear layers' (and embedding's) storage: float, or int4 / int8 blocks
    selects_tokens: bool = False  # token selection: a decode step reads chosen pages (AquaConfig.selects_tokens)

    layers = property(lambda self: self.contract.layers)
    kv_heads = property(lambda self: self.contract.kv_heads)
    vocab = property(lambda self: self.contract.vocab)
    def r(self, i: int) -> int:
        """Layer i's cached width (contract.widths)."""
        return self.contract.widths[i]

    def k(self, i: int) -> int:
        """Layer i's selected coordinates (contract.selected)."""
        return self.contract.selected[i]

    def rv(self, i: int) -> int:
        """Layer i's cached V width (contract.value_widths)."""
        return self.contract.value_widths[i]

    h2o = property(lambda self: self.contract.h2o)

    @property
    def projects_query(self) -> bool:
        """The attention node (AquaAttention or H2OAttention) takes P_q and projects q itself: one node fewer per
        layer, and at short context that node cost more than the attention saved (benchmarks/performance.md,
        break-even). Needs a rotary embedding (otherwise P folds into W_Q) and the fused node (TensorRT's
        separate nodes take q^)."""
        return not self.dense and self.fused and self.rotary_dim > 0

    @property
    def g(self) -> int:
        return self.heads // self.kv_heads

    @property
    def elem(self) -> int:
        return onnx_type(self.dtype)


class DecoderGraph(Blocks):
    """Emits one graph: embeddings, rotary tables and masks once, then each layer, then the head."""

    def __init__(self, gb: GraphBuilder, plan: Plan, op_attrs: dict):
        """op_attrs: the attention nodes' attributes beyond k and the graph's own (the mechanisms' node attributes,
        settings.node_attrs, and the TensorRT plugin's names)."""
        self.gb, self.p, self.contract = gb, plan, plan.contract
        self.op_attrs, self.domain, self.op_type = op_attrs, DOMAIN, SCORES
        # what casting the weights to a float16 export cost (reported in aqua_config.json)
        self.cast = {"tensors": 0, "elements": 0, "below_float16_normal_range": 0}
        self._masks: dict = {}  # one mask per distinct sliding window (None: full causal)
        self._rotary: dict = {}  # one cos/sin pair per distinct rotary embedding
        self.logit_index = None  # last_logits: the head's rows [B, K] (inputs()), gathered in the last layer

    # ---------------------------------------------------------------- once per graph
    def inputs(self) -> dict:
        """Declares the contract's inputs; returns their names plus values every layer shares: total (the
        sequence length so far, [1]) and position_ids (cumsum(attention_mask) - 1)."""
        gb, c, types = self.gb, self.gb.const, {"int64": TensorProto.INT64, "bool": TensorProto.BOOL, **ONNX}
        for t in self.contract.inputs():
            gb.input(t.name, types[t.dtype], list(t.shape))
        ct = self.contract
        io = {"input_ids": ct.INPUT_IDS, "attention_mask": ct.ATTENTION_MASK}
        io["total"] = gb.op("/model/total_length", "Shape", [ct.ATTENTION_MASK], start=1, end=2)
        io["new"] = gb.op("/model/new_tokens", "Shape", [ct.INPUT_IDS], start=1, end=2)  # T, [1]
        if ct.last_logits:  # 0: each sequence's last row (rewrites.all_logits sets 1)
            gb.weight(ct.ALL_LOGITS, torch.zeros(1, dtype=torch.int64))
        # HF's positions under left padding: the count of real tokens before each one
        n = "/model/position_ids"
        seen = gb.op(f"{n}/CumSum", "CumSum", [ct.ATTENTION_MASK, c(1)])
        pos = gb.op(f"{n}/Max", "Max", [gb.op(f"{n}/Sub", "Sub", [seen, c(1)]), c(0)])
        new = gb.op(f"{n}/ShapeNew", "Shape", [ct.INPUT_IDS], start=1, end=2)
        io["position_ids"] = gb.op(f"{n}/SliceNew", "Slice", [pos, gb.op(f"{n}/First", "Sub", [io["total"], new]),
                                                               io["total"], c([1])])
        if ct.last_logits:  # here, among the integer nodes: inside a quantized graph's float runs an If would take it
            self.logit_index = self._logit_rows(io)
        return io

    def outputs(self) -> None:
        """Declares the contract's outputs (the nodes made them under these names)."""
        types = {"int64": TensorProto.INT64, **ONNX}
        for t in self.contract.outputs():
            self.gb.output(t.name, types[t.dtype], list(t.shape))

    def rotary(self, position_ids: str, inv_freq: torch.Tensor, scale: float) -> tuple:
        """What _rope rotates with, one per distinct rotary embedding (Gemma 3's local and global ones). ONNX Runtime
        builds: cos / sin tables [positions, rotary_dim / 2] made here the way HF computes them (angles position *
        inv_freq in float32, times the attention scaling) and the position ids, for its RotaryEmbedding op;
        otherwise cos, sin [B, 1, T, rotary_dim] computed in the graph."""
        key = (tuple(inv_freq.tolist()), scale)
        if key not in self._rotary:
            n = "/model/rotary_emb" + (f"_{len(self._rotary)}" if self._rotary else "")
            self._rotary[key] = self._rotary_tables(position_ids, inv_freq, scale, n) if self.p.contrib else \
                self._make_rotary(position_ids, inv_freq, scale, n)
        return self._rotary[key]

    def _rotary_tables(self, position_ids: str, inv_freq: torch.Tensor, scale: float, n: str) -> tuple:
        angles = torch.arange(self.p.positions, dtype=torch.float32)[:, None] * inv_freq.to(torch.float32)[None]
        cos, sin = (self.gb.weight(f"{n}.{fn}_cache", (getattr(angles, fn)() * scale).to(self.p.dtype))
                    for fn in ("cos", "sin"))
        return "tables", position_ids, cos, sin

    def _make_rotary(self, position_ids: str, inv_freq: torch.Tensor, scale: float, n: str) -> tuple:
        gb, c = self.gb, self.gb.const
        pos = gb.op(f"{n}/Cast", "Cast", [gb.op(f"{n}/Unsqueeze", "Unsqueeze", [position_ids, c([-1])])], to=F32)
        freqs = gb.op(f"{n}/Mul", "Mul", [pos, gb.weight(f"{n}.inv_freq", inv_freq.to(torch.float32))])
        emb = gb.op(f"{n}/Concat", "Concat", [freqs, freqs], axis=-1)
        out = []
        for fn in ("Cos", "Sin"):
            t = gb.op(f"{n}/{fn}", fn, [emb])
            if scale != 1.0:
                t = gb.op(f"{n}/{fn}/Scale", "Mul", [t, c(scale, torch.float32)])
            if self.p.dtype != torch.float32:
                t = gb.op(f"{n}/{fn}/Cast", "Cast", [t], to=self.p.elem)
            out.append(gb.op(f"{n}/{fn}/Unsqueeze", "Unsqueeze", [t, c([1])]))
        return "inline", out[0], out[1]

    def mask(self, io: dict, window: int | None = None) -> str:
        """Additive float32 mask [B, 1, 1, T, L]: key j is visible to query t iff j <= qpos[t] = L - T + t and
        attention_mask[b, j] == 1; with a sliding window also j > qpos[t] - window (slots are token indices,
        padding included, as in HF)."""
        if window in self._masks:
            return self._masks[window]
        gb, c = self.gb, self.gb.const
        n = "/model/attn_mask" + ("" if window is None else f"_window{window}")
        s = gb.op(f"{n}/ShapeS", "Shape", [io["attention_mask"]], start=1, end=2)
        j = gb.op(f"{n}/RangeS", "Range", [c(0), gb.op(f"{n}/SqueezeS", "Squeeze", [s]), c(1)])
        t = gb.op(f"{n}/ShapeT", "Shape", [io["input_ids"]], start=1, end=2)
        first = gb.op(f"{n}/SqueezeFirst", "Squeeze", [gb.op(f"{n}/Sub", "Sub", [s, t])])
        qpos = gb.op(f"{n}/RangeT", "Range", [first, gb.op(f"{n}/SqueezeS2", "Squeeze", [s]), c(1)])
        j2 = gb.op(f"{n}/UnsqueezeJ", "Unsqueeze", [j, c([0])])
        q2 = gb.op(f"{n}/UnsqueezeQ", "Unsqueeze", [qpos, c([1])])
        causal = gb.op(f"{n}/LessOrEqual", "LessOrEqual", [j2, q2])  # [T, S]
        if window is not None:
            recent = gb.op(f"{n}/Greater", "Greater", [j2, gb.op(f"{n}/SubWindow", "Sub", [q2, c(window)])])
            causal = gb.op(f"{n}/AndWindow", "And", [causal, recent])
        pad = gb.op(f"{n}/CastMask", "Cast", [io["attention_mask"]], to=TensorProto.BOOL)
        ok = gb.op(f"{n}/And", "And", [causal, gb.op(f"{n}/UnsqueezePad", "Unsqueeze", [pad, c([1])])])  # [B,T,S]
        add = gb.op(f"{n}/Where", "Where", [ok, c(0.0, torch.float32), c(torch.finfo(torch.float32).min, torch.float32)])
        self._masks[window] = gb.op(f"{n}/Unsqueeze", "Unsqueeze", [add, c([1, 2])])
        return self._masks[window]

    # ---------------------------------------------------------------- per layer
    def layer(self, i: int, stream: tuple, w: dict, P: tuple, P_v: torch.Tensor, scaling: float, rope: tuple | None,
              window: int | None, io: dict) -> tuple[str, str]:
        """stream = (x, pending): the residual stream and the last block's output, added by this layer's first norm
        (Blocks._add_norm). w: the layer's weights as HF names them (see decoder_weights); P: fold.Bases (query
        and key bases [Hkv, d, r], the node's key_weights); P_v [Hkv, d, d].
        Returns the stream after the layer, its MLP output pending (its present.{i}.* outputs are named nodes)."""
        n = f"/model/layers.{i}"
        h, x = self._add_norm(f"{n}/input_layernorm", stream, w["input_layernorm"], w.get("input_layernorm_bias"))
        attn = self._attention(i, h, w, P, P_v, scaling, rope, window, io)
        if "attn_out_norm" in w:  # Gemma: the block's output is normalised before the residual add
            attn = self._rmsnorm(f"{n}/attn_out_norm", attn, w["attn_out_norm"])
        if self._head_rows_only(i):  # attn has the head's rows already when the attention took those alone
            x = self._gather_rows(f"{n}/HeadRows/x", x, self.logit_index)
            if not self._head_queries_only():
                attn = self._gather_rows(f"{n}/HeadRows/attn", attn, self.logit_index)
        h, x = self._add_norm(f"{n}/post_attention_layernorm", (x, attn), w["post_attention_layernorm"],
                              w.get("post_attention_layernorm_bias"))
        down = self._moe(f"{n}/mlp", h, w) if "router" in w else \
            self._plain_mlp(f"{n}/mlp", h, w) if "fc" in w else self._gated_mlp(f"{n}/mlp", h, w)
        if "mlp_out_norm" in w:
            down = self._rmsnorm(f"{n}/mlp_out_norm", down, w["mlp_out_norm"])
        return x, down

    def _attention(self, i, h, w, P, P_v, scaling, rope, window, io):
        gb, p, c, n = self.gb, self.p, self.gb.const, f"/model/layers.{i}/attn"
        hkv, rv = p.kv_heads, p.rv(i)
        proj = attention_projections(w, P, P_v, scaling, p.heads, rv, rotary=bool(p.rotary_dim))
        wo, bo = proj["o"][0], w.get("o_proj_bias")
        bo = None if bo is None else bo.to(torch.float32)
        if not p.rotary_dim:
            return self._attention_folded(i, h, proj, window, io, wo, bo, P.key_weights)
        q, k, v = self._rotary_qk(n, h, w, proj["q"], proj["k"], proj["v"], scaling, rope)
        pq = None
        if not p.dense:
            P_q, P_k = P.query.to(torch.float32), P.key.to(torch.float32)
            if p.projects_query:
                pq = self.weight(f"{n}.P_q", P_q)  # [Hkv, d, r]: the attention node's last input
            else:
                q = gb.op(f"{n}/q/MatMulP", "MatMul", [q, self.weight(f"{n}.P_q", P_q[:, None])])
            k = gb.op(f"{n}/k/MatMulP", "MatMul", [k, self.weight(f"{n}.P_k", P_k)])
        v = gb.op(f"{n}/v/Transpose", "Transpose", [gb.op(f"{n}/v/Reshape", "Reshape", [v, c([0, 0, hkv, rv])])],
                  perm=[0, 2, 1, 3])  # [B, Hkv, T, rv]
        return self._attend(i, q, k, v, wo, bo, window, io, pq, P.key_weights)

    def _rotary_qk(self, n, h, w, qp, kp, vp, scaling, rope):
        """h -> q [B,Hkv,g,T,d], k [B,Hkv,T,d] after RoPE, v [B,T,Hkv*rv]: one MatMul for all three. Without q/k
        norms q and k are rotated together (one RoPE over H + Hkv heads: fewer nodes, and decode is per-node
        bound at short context)."""
        gb, p, c = self.gb, self.p, self.gb.const
        hkv, g, d = p.kv_heads, p.g, p.head_dim
        if "q_norm" not in w and "k_norm" not in w:
            qk, v = self._linears(f"{n}/qkv_proj", h, [stack([qp, kp]), vp])
            qk = gb.op(f"{n}/qk/Reshape", "Reshape", [qk, c([0, 0, p.heads + hkv, d])])
            qk = self._rope(f"{n}/qk_rope", gb.op(f"{n}/qk/Transpose", "Transpose", [qk], perm=[0, 2, 1, 3]), rope,
                            p.heads + hkv)
            q, k = gb.op(f"{n}/qk/SplitHeads", "Split", [qk, c([p.heads, hkv])], n_out=2, axis=1)
            return gb.op(f"{n}/q/Reshape5", "Reshape", [q, c([0, hkv, g, -1, d])]), k, v
        # q/k RMSNorm before RoPE, per head (Qwen3: weight [d]) or over the whole projection (OLMoE): a norm
        # would undo a scale folded into W_Q, so the scale goes into q_norm's weight instead
        q, k, v = self._linears(f"{n}/qkv_proj", h, [qp, kp, vp])
        q = self._qk_norm(f"{n}/q_norm", q, p.heads, None if "q_norm" not in w else w["q_norm"].float() * scaling)
        q = gb.op(f"{n}/q/Transpose", "Transpose", [q], perm=[0, 2, 1, 3])
        q = gb.op(f"{n}/q/Reshape5", "Reshape", [self._rope(f"{n}/q_rope", q, rope, p.heads), c([0, hkv, g, -1, d])])
        k = self._qk_norm(f"{n}/k_norm", k, hkv, w.get("k_norm"))
        k = gb.op(f"{n}/k/Transpose", "Transpose", [k], perm=[0, 2, 1, 3])
        return q, self._rope(f"{n}/k_rope", k, rope, hkv), v

    def _attention_folded(self, i, h, proj, window, io, wo, bo, key_weights):
        """Without rotary embeddings P folds exactly into W_Q and W_K (docs/design.md, What folds;
        fold.attention_projections): q^ and k^ come out of the projections, r wide, and the graph has no projection
        MatMul at all."""
        gb, p, c, n = self.gb, self.p, self.gb.const, f"/model/layers.{i}/attn"
        hkv, g, r = p.kv_heads, p.g, p.r(i)
        q = gb.op(f"{n}/q/Reshape", "Reshape", [self._linear(f"{n}/q_proj", h, *proj["q"]), c([0, 0, p.heads, r])])
        q = gb.op(f"{n}/q/Transpose", "Transpose", [q], perm=[0, 2, 1, 3])
        q = gb.op(f"{n}/q/Reshape5", "Reshape", [q, c([0, hkv, g, -1, r])])
        k = gb.op(f"{n}/k/Reshape", "Reshape", [self._linear(f"{n}/k_proj", h, *proj["k"]), c([0, 0, hkv, r])])
        kh = gb.op(f"{n}/k/Transpose", "Transpose", [k], perm=[0, 2, 1, 3])  # [B, Hkv, T, r]
        v = self._linear(f"{n}/v_proj", h, *proj["v"])
        v = gb.op(f"{n}/v/Transpose", "Transpose", [gb.op(f"{n}/v/Reshape", "Reshape", [v, c([0, 0, hkv, p.rv(i)])])],
                  perm=[0, 2, 1, 3])
        return self._attend(i, q, kh, v, wo, bo, window, io, key_weights=key_weights)

    def _attend(self, i, q, kh, v, wo, bo, window, io, proj=None, key_weights=None):
        """q^ [B,Hkv,g,T,r] (or q [B,Hkv,g,T,d] with proj = P_q [Hkv,d,r]), k^ [B,Hkv,T,r], v [B,Hkv,T,rv], the
        layer's sliding window (None: none), key_weights [Hkv, r] (fold.Bases: the node divides K^'s rows by them)
        -> attention output [B,T,D]. AquaAttention and H2OAttention read the
        attention mask [B, L] itself; TensorRT's separate nodes add the [B, 1, 1, T, L] mask (DecoderGraph.mask)."""
        gb, p, c, n = self.gb, self.p, self.gb.const, f"/model/layers.{i}/attn"
        rv, attrs = p.rv(i), dict(self.op_attrs, k=p.k(i))
        if self._head_rows_only(i) and self._head_queries_only():
            q = self._gather_rows(f"{n}/HeadRows/q", q, self.logit_index, axis=3)
        assert key_weights is None or (p.fused and not p.h2o), "key weights come with an int8 cache: AquaAttention's"
        if p.h2o:  # the slots, the scores and the eviction in one node (h2o.py)
            ct = self.contract
            a = gb.op(f"{n}/{H2O}", H2O, [q, kh, v] + [ct.past(i, kind) for kind in ct.kinds] + [ct.ATTENTION_MASK]
                      + [proj] * (proj is not None),
                      domain=self.domain, outputs=[f"{n}/{H2O}/out"] + [ct.present(i, kind) for kind in ct.kinds],
                      softcap=float(p.attn_softcap or 0.0), **attrs)[0]
        elif not p.fused:
            kc, vc = self._cache(n, i, kh, v, io)
            a = self._attend_separate(n, q, kc, vc, self.mask(io, window), io, attrs)
        else:  # one pass over the cache: no [B, Hkv, g, T, L] scores in memory
            kc, vc = self._cache(n, i, kh, v, io)
            prices = self.contract.head_prices(i)  # the heads share the layer's k (allocate.head_prices)
            a = gb.op(f"{n}/{ATTENTION}", ATTENTION, [q, kc, vc, io["total"], io["attention_mask"]] +
                      [proj] * (proj is not None), domain=self.domain, softcap=float(p.attn_softcap or 0.0),
                      sliding_window=int(window or 0), **attrs,
                      **({"cache_scales": 1} if self.contract.scale_slots else {}),
                      **({} if key_weights is None else {"key_weights": key_weights.reshape(-1).tolist()}),
                      **({} if prices is None else {"head_prices": prices}))  # [B, Hkv, g, T, rv]
        a = gb.op(f"{n}/out/Transpose", "Transpose", [a], perm=[0, 3, 1, 2, 4])
        a = gb.op(f"{n}/out/Reshape", "Reshape", [a, c([0, 0, p.heads * rv])])
        return self._linear(f"{n}/o_proj", a, wo, bo)

    def _attend_separate(self, n, q, kc, vc, mask, io, attrs):
        """Scores, softmax and value product as separate nodes (TensorRT's plugin is TopKGatherDot)."""
        gb, p = self.gb, self.p
        scores = gb.op(f"{n}/{self.op_type}", self.op_type, [q, kc, io["total"]], domain=self.domain, **attrs)
        if p.dtype != torch.float32:
            scores = gb.op(f"{n}/scores/Cast", "Cast", [scores], to=F32)  # softmax in float32, as HF does
        if p.attn_softcap:  # the attention scale is already in q^ (folded into W_Q or q_norm)
            scores = self._softcap(f"{n}/softcap", scores, p.attn_softcap)
        probs = gb.op(f"{n}/Softmax", "Softmax", [gb.op(f"{n}/mask/Add", "Add", [scores, mask])], axis=-1)
        if p.dtype != torch.float32:
            probs = gb.op(f"{n}/probs/Cast", "Cast", [probs], to=p.elem)
        return gb.op(f"{n}/{VALUE_PRODUCT}", VALUE_PRODUCT, [probs, vc], domain=self.domain)  # [B, Hkv, g, T, r]

    def _qk_norm(self, n: str, x: str, heads: int, w: torch.Tensor | None) -> str:
        """x [B, T, heads * d] -> [B, T, heads, d], RMS-normalised per head ([d] weight) or whole ([heads * d])."""
        c, d = self.gb.const, self.p.head_dim
        if w is not None and w.numel() != d:
            x = self._rmsnorm(n, x, w)
        x = self.gb.op(f"{n}/Reshape", "Reshape", [x, c([0, 0, heads, d])])
        return self._rmsnorm(n, x, w) if w is not None and w.numel() == d else x

    def _cache(self, n: str, i: int, kh: str, v: str, io: dict) -> tuple[str, str]:
        """k^, v [B,Hkv,T,r] -> (K^ as [B,Hkv,r,C] over present.{i}.key's memory, present.{i}.value). The
        native update writes a shared buffer in place; the key view is a Reshape (no copy); TopKGatherDot and
        ValueProduct read only the L filled slots. A float16 cache under a float32 graph: the new tokens are cast
        as they are written (AquaAttention reads float16 caches whatever its query's type); an int8 cache: each new
        token's K^ column and V row become int8 rows with their scale's code (QuantizeRows), and K^'s view has
        r + 1 dim-major rows."""
        gb, c, ct = self.gb, self.gb.const, self.contract
        if ct.scale_slots:  # rows that carry their scale's code
            kh = gb.op(f"{n}/k/{CACHE_QUANT}", QUANTIZE, [kh], domain=self.domain)
            v = gb.op(f"{n}/v/{CACHE_QUANT}", QUANTIZE, [v], domain=self.domain)
        elif ct.narrow_cache:
            kh = gb.op(f"{n}/k/{CACHE_CAST}", "Cast", [kh], to=ONNX[ct.cache_dtype])
            v = gb.op(f"{n}/v/{CACHE_CAST}", "Cast", [v], to=ONNX[ct.cache_dtype])
        kc = gb.op(f"{n}/k/CacheUpdate", KEY_UPDATE, [ct.past(i, "key"), kh, io["total"]], domain=self.domain,
                   outputs=[ct.present(i, "key")])[0]
        vc = gb.op(f"{n}/v/CacheUpdate", VALUE_UPDATE, [ct.past(i, "value"), v, io["total"]], domain=self.domain,
                   outputs=[ct.present(i, "value")])[0]
        kr = gb.op(f"{n}/k/DimMajorView", "Reshape", [kc, c([0, 0, self.p.r(i) + ct.scale_slots, -1])])  # C inferred
        return kr, vc

    # ---------------------------------------------------------------- head
    def head(self, stream: tuple, norm_w: torch.Tensor, norm_b: torch.Tensor | None, lm_head: torch.Tensor,
             tied_to: str | None, io: dict) -> None:
        """logits = norm(x + pending) @ W_lm^T. Tied float embeddings reuse the embedding table through Gemm(transB);
        quantized weights give the output layer its own MatMulNBits blocks (of the same table when tied). A
        last_logits graph (contract.Contract) runs the last layer's MLP and the head on the rows logit_rows picks
        (gathered by layer()) and places them with LogitRows."""
        gb, c = self.gb, self.gb.const
        last = self.contract.last_logits
        index = self.logit_index  # the last layer took the stream at these rows (layer())
        h, _ = self._add_norm("/model/norm", stream, norm_w, norm_b)
        cap = self.p.final_softcap
        out = None if cap or last else ["logits"]
        if tied_to is None or self.p.weights.quantized:
            y = self._linear("/lm_head", h, lm_head, None, outputs=out)
        else:
            flat = gb.op("/lm_head/Flatten", "Reshape", [h, c([-1, self.p.hidden])])
            y = gb.op("/lm_head/Gemm", "Gemm", [flat, tied_to], transB=1)
            shape = gb.op("/lm_head/Shape", "Concat", [gb.op("/lm_head/ShapeBT", "Shape", [h], start=0, end=2),
                                                      c([self.p.vocab])], axis=0)
            y = gb.op("/lm_head/Reshape", "Reshape", [y, shape], outputs=out)
        y = y[0] if isinstance(y, list) else y
        if cap:
            capped = self._softcap("/lm_head/softcap", y if self.p.dtype == torch.float32 else
                                   gb.op("/lm_head/Cast", "Cast", [y], to=F32), cap)
            y = gb.op("/lm_head/softcap/Out", "Cast" if self.p.dtype != torch.float32 else "Identity", [capped],
                      outputs=None if last else ["logits"], **({"to": self.p.elem} if self.p.dtype != torch.float32 else {}))
            y = y[0] if isinstance(y, list) else y
        if last:
            gb.op(f"/lm_head/{ROWS}", ROWS, [y, index, io["new"]], domain=self.domain, outputs=["logits"])

    def _head_rows_only(self, i: int) -> bool:
        """Whether layer i is a last_logits graph's last (contract.Contract): its MLP, and the head, run on the
        rows the logits need alone (every row's keys and values are cached before them)."""
        return self.contract.last_logits and i == self.contract.layers - 1

    def _head_queries_only(self) -> bool:
        """Whether the last layer's attention takes the head's query rows alone: one row per sequence, which
        AquaAttention computes as a decode step at the last slot; exact as the prompt kernel is (its causal and
        padding masks leave the row the same keys), but under token selection a decode step reads chosen pages,
        and H2OAttention's heavy-hitter sums take every query row."""
        return self.p.fused and not self.p.h2o and not self.p.selects_tokens

    def _logit_rows(self, io: dict) -> str:
        """The rows the head computes (contract.Contract, last_logits): index [B, K], each sequence's last position
        whose attention_mask is 1 (K = 1), or every position when the constant all_logits is 1 (K = T)."""
        gb, c, n = self.gb, self.gb.const, "/model/logit_rows"
        ct = self.contract
        new = gb.op(f"{n}/NewMask", "Slice", [ct.ATTENTION_MASK, gb.op(f"{n}/Neg", "Neg", [io["new"]]),
                                              c([2**62]), c([1])])
        last = gb.op(f"{n}/Last", "ArgMax", [new], axis=1, keepdims=1, select_last_index=1)  # [B, 1]
        every = gb.op(f"{n}/Every", "Greater", [ct.ALL_LOGITS, c([0])])
        keep = gb.op(f"{n}/Keep", "Where", [every, io["new"], c([1])])
        start = gb.op(f"{n}/Start", "Where", [every, c([0]), last])  # [B, 1]
        ramp = gb.op(f"{n}/Ramp", "Range", [c(0), gb.op(f"{n}/KeepScalar", "Squeeze", [keep]), c(1)])
        return gb.op(f"{n}/Index", "Add", [start, gb.op(f"{n}/RampRow", "Unsqueeze", [ramp, c([0])])])  # [B, K]

    def _gather_rows(self, n: str, t: str, index: str, axis: int = 1) -> str:
        """t [B, T, D] (axis 1) or [B, Hkv, g, T, w] (axis 3) at the positions index [B, K] -> K in place of T."""
        gb, c = self.gb, self.gb.const
        shape = gb.op(f"{n}/Shape", "Shape", [t])
        wide = gb.op(f"{n}/WideShape", "Concat", [gb.op(f"{n}/Lead", "Slice", [shape, c([0]), c([axis])]),
                                                  gb.op(f"{n}/K", "Shape", [index], start=1, end=2),
                                                  gb.op(f"{n}/Trail", "Slice", [shape, c([axis + 1]), c([2**62])])],
                     axis=0)
        # Unsqueeze, not Reshape: a quantized graph's Ifs take Reshapes among their float runs (blocks.FLOAT_RUN)
        at = gb.op(f"{n}/IndexAxes", "Unsqueeze", [index, c([-1] if axis == 1 else [1, 2, 4])])
        at = gb.op(f"{n}/At", "Expand", [at, wide])  # [B, K, D] or [B, Hkv, g, K, w]
        return gb.op(f"{n}/Gather", "GatherElements", [t, at], axis=axis)
