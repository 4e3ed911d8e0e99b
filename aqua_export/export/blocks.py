"""Building blocks of the decoder graph that do not depend on the attention: weights in the export dtype,
linear layers (float MatMul, or ONNX Runtime's MatMulNBits over quantize.py's blocks), the embedding (Gather or
GatherBlockQuantized), norms, the rotary rotation, MLPs (gated, plain, routed experts: ONNX Runtime's MoE / QMoE,
only the chosen experts run) and soft-capping.

Mixed into DecoderGraph, which provides ``gb`` (the GraphBuilder), ``p`` (the Plan) and ``cast``.
"""

from __future__ import annotations

import torch
from onnx import TensorProto

from ..config import ConfigError
from ..ops import matmul_q4a8
from ..ops.spec import DOMAIN
from ..quantize import FLOAT_ACTIVATION_ROWS, check_shape, quantize

F32 = TensorProto.FLOAT
MS = "com.microsoft"  # ONNX Runtime's contrib ops: MatMulNBits, GatherBlockQuantized, MoE, QMoE
# ops whose outputs are tensors of the export dtype (where a layer's stream and projections are): what a run of
# Blocks.rows_choose_activations may hold
FLOAT_RUN = {("", op) for op in ("MatMul", "Split", "Sigmoid", "Mul", "Add", "Div", "Sqrt", "Pow", "ReduceMean",
                                 "Reshape", "Transpose", "Gelu", "Tanh", "Relu", "Softmax")} | \
    {(MS, op) for op in ("MatMulNBits", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                         "RotaryEmbedding")}


def stack(parts: list) -> tuple:
    """[(W_i [out_i, in], b_i or None)] -> (W [sum out_i, in], b or None): one linear layer computing them all."""
    w = torch.cat([wi for wi, _ in parts], 0)
    if all(bi is None for _, bi in parts):
        return w, None
    return w, torch.cat([torch.zeros(wi.shape[0]) if bi is None else bi for wi, bi in parts])


class Blocks:
    def weight(self, name: str, t: torch.Tensor) -> str:
        """A weight in the export dtype. float16 refuses values past its range (65504) and counts the nonzero
        ones below its normal range (6.1e-5), which keep fewer mantissa bits; all others cast exactly from
        bfloat16, and to float16's rounding from float32."""
        if self.p.dtype == torch.float16 and t.dtype != torch.float16:
            a = t.detach().abs()
            if bool((a > 65504).any()):
                raise ConfigError(f"{name} has values beyond float16's range (|w| up to {float(a.max()):.3g} > 65504): "
                                  "export with --dtype float32")
            self.cast["tensors"] += 1
            self.cast["elements"] += t.numel()
            self.cast["below_float16_normal_range"] += int(((a > 0) & (a < 6.103515625e-05)).sum())
        return self.gb.weight(name, t.to(self.p.dtype))

    def _linear(self, name: str, x: str, w: torch.Tensor, b: torch.Tensor | None, outputs: list | None = None) -> str:
        """x [..., in] @ W^T (+ b): W [out, in] stored transposed, [in, out], in the export dtype; with quantized
        weights (Plan.weights) one MatMulNBits node over W's blocks, the bias its sixth input, or for int4 at level 4
        one MatMulQ4A8 over the same blocks (quantize.WeightFormat.int8_blocks), the bias added after."""
        if self.p.weights.int8_blocks:  # int4 at level 4: MatMulQ4A8 at every row count (quantize.py)
            fmt = self.p.weights
            y = self.gb.op(f"{name}/MatMulQ4A8", matmul_q4a8.OP.name, [x] + self._quantized(name, w), domain=DOMAIN,
                           outputs=outputs if b is None else None, K=w.shape[1], N=w.shape[0], block_size=fmt.block)
            if b is not None:
                y = self.gb.op(f"{name}/Add", "Add", [y, self.weight(f"{name}.bias", b)], outputs=outputs)
            return y[0] if isinstance(y, list) else y
        if self.p.weights.quantized:
            fmt = self.p.weights
            ins = self._quantized(name, w)
            if b is not None:
                ins += [""] * (4 - len(ins)) + [self.weight(f"{name}.bias", b)]  # inputs 3, 4: zero points, g_idx
            y = self.gb.op(f"{name}/MatMulNBits", "MatMulNBits", [x] + ins, domain=MS, outputs=outputs, K=w.shape[1],
                           N=w.shape[0], bits=fmt.bits, block_size=fmt.block, accuracy_level=fmt.accuracy_level)
            return y[0] if outputs else y
        wt = self.weight(f"{name}.weight", w.t())
        y = self.gb.op(f"{name}/MatMul", "MatMul", [x, wt], outputs=None if b is not None else outputs)
        if b is not None:
            y = self.gb.op(f"{name}/Add", "Add", [y, self.weight(f"{name}.bias", b)], outputs=outputs)
        return y[0] if isinstance(y, list) else y

    def rows_choose_activations(self, new: str) -> None:
        """At accuracy level 4, each maximal run of consecutive float nodes (FLOAT_RUN) that holds MatMulNBits
        products (int8 weights: int4 ones are MatMulQ4A8 at every row count, quantize.WeightFormat.int8_blocks)
        becomes one If on the forward's new tokens a sequence (``new`` [1], DecoderGraph.inputs' count;
        quantize.FLOAT_ACTIVATION_ROWS): its then branch the run with float32 activations (accuracy_level 0, a
        prompt's), its else branch the run as built (int8, a decode step's). Per sequence, not batch x tokens: a
        decode step is int8 however many sequences it steps, so batching never changes a sequence's arithmetic. A
        run goes from one attention node to the next layer's cache write (o_proj, norm, MLP, norm, q/k/v), so a
        forward pays about one If a layer, not one a product (each a few microseconds)."""
        if not self.p.weights.int8_activations:
            return
        from onnx import helper as H

        nodes, graph_out = self.gb.nodes, {o.name for o in self.gb.outputs}
        readers: dict = {}
        for i, n in enumerate(nodes):
            for v in n.input:
                readers.setdefault(v, set()).add(i)
        prompt = "/model/prompt_tokens/output_0"
        cond = [H.make_node("GreaterOrEqual", [new, self.gb.const([FLOAT_ACTIVATION_ROWS])], [prompt],
                            name="/model/prompt_tokens")]
        out, run = [], []
        for i, n in enumerate(nodes + [None]):
            if n is not None and (n.domain, n.op_type) in FLOAT_RUN:
                run.append(i)
                continue
            if any(nodes[j].op_type == "MatMulNBits" for j in run):
                out += cond  # once, before the first If (after the node counting the new tokens)
                cond = []
                out.append(self._run_if([nodes[j] for j in run], set(run), readers, graph_out, prompt))
            else:
                out += [nodes[j] for j in run]
            run = []
            if n is not None:
                out.append(n)
        self.gb.nodes = out

    def _run_if(self, run: list, at: set, readers: dict, graph_out: set, prompt: str):
        """One If computing a run's values that nodes outside it read (all of the export dtype: FLOAT_RUN)."""
        from onnx import helper as H

        made = [o for n in run for o in n.output if o]
        leave = [o for o in made if o in graph_out or readers.get(o, set()) - at]
        first = next(n for n in run if n.op_type == "MatMulNBits").name

        def branch(tag: str, level: int):
            name = {o: f"{o}/{tag}" for o in made}
            body = []
            for n in run:
                c = H.make_node(n.op_type, [name.get(v, v) for v in n.input], [name.get(v, v) for v in n.output],
                                name=f"{n.name}/{tag}", domain=n.domain)
                c.attribute.extend(a for a in n.attribute if not (n.op_type == "MatMulNBits" and
                                                                  a.name == "accuracy_level"))
                if n.op_type == "MatMulNBits":
                    c.attribute.append(H.make_attribute("accuracy_level", level))
                body.append(c)
            return H.make_graph(body, f"{first}/{tag}", [], [H.make_tensor_value_info(name[o], self.p.elem, None)
                                                              for o in leave])

        return H.make_node("If", [prompt], leave, name=f"{first}/Rows", then_branch=branch("float32", 0),
                           else_branch=branch("int8", self.p.weights.accuracy_level))

    def _quantized(self, name: str, w: torch.Tensor, shape: tuple | None = None) -> list[str]:
        """W [..., N, K] -> the names of its packed blocks, scales and (asymmetric) zero points (quantize.py), the
        packed blocks in ``shape`` when given (GatherBlockQuantized and QMoE take them flat per row)."""
        fmt = self.p.weights
        check_shape(w.shape[-1], fmt, name)
        packed, scales, zero = quantize(w, fmt)
        out = [self.gb.weight(f"{name}.qweight", packed if shape is None else packed.reshape(shape)),
               self.gb.weight(f"{name}.scales", scales)]
        return out + ([] if zero is None else [self.gb.weight(f"{name}.zero_points", zero)])

    def embed(self, ids: str, table: torch.Tensor) -> str:
        """input_ids [B, T] -> rows of the embedding table [V, D]: Gather, or with quantized weights
        GatherBlockQuantized over the table's blocks along D (the same format as the linear layers)."""
        if not self.p.weights.quantized:
            return self.gb.op("/model/embed_tokens/Gather", "Gather", [self.weight("model.embed_tokens.weight", table),
                                                                    ids])
        fmt = self.p.weights
        ins = self._quantized("model.embed_tokens", table, (table.shape[0], -1))
        return self.gb.op("/model/embed_tokens/GatherBlockQuantized", "GatherBlockQuantized", [ins[0], ids] + ins[1:],
                          domain=MS, bits=fmt.bits, block_size=fmt.block, gather_axis=0, quantize_axis=1)

    def _linears(self, name: str, x: str, parts: list) -> list[str]:
        """[x @ W_i^T (+ b_i) for (W_i, b_i) in parts] as one MatMul over the stacked weights, split back: at
        decode a step is a chain of small GEMVs, and fewer, wider ones cost less per node."""
        y = self._linear(name, x, *stack(parts))
        return self.gb.op(f"{name}/Split", "Split", [y, self.gb.const([wi.shape[0] for wi, _ in parts])],
                          n_out=len(parts), axis=-1)

    def _add_norm(self, name: str, stream: tuple, w: torch.Tensor, b: torch.Tensor | None = None) -> tuple[str, str]:
        """stream = (x, pending): the residual stream and a block output not yet added to it (None: nothing) ->
        (norm(x + pending), x + pending). ONNX Runtime builds add and normalise in one node
        (SkipSimplifiedLayerNormalization, SkipLayerNormalization with a bias), others Add, then _norm."""
        x, pending = stream
        if pending is None:
            return self._norm(name, x, w, b), x
        if not self.p.contrib:
            x = self.gb.op(f"{name}/residual", "Add", [x, pending])
            return self._norm(name, x, w, b), x
        op = "SkipSimplifiedLayerNormalization" if b is None else "SkipLayerNormalization"
        ins = [x, pending, self.weight(f"{name}.weight", w)] + ([self.weight(f"{name}.bias", b)] if b is not None else [])
        outs = [f"{name}/{op}/output_0", "", "", f"{name}/{op}/output_3"]  # normalised, (mean), (1/std), the sum
        self.gb.op(f"{name}/{op}", op, ins, domain=MS, outputs=outs, epsilon=self.p.eps)
        return outs[0], outs[3]

    def _norm(self, name: str, x: str, w: torch.Tensor, b: torch.Tensor | None = None) -> str:
        """RMSNorm, or LayerNorm when the family's norms have a bias (GPT-2), statistics in float32."""
        if b is None:
            return self._rmsnorm(name, x, w)
        return self.gb.op(f"{name}/LayerNormalization", "LayerNormalization",
                          [x, self.weight(f"{name}.weight", w), self.weight(f"{name}.bias", b)], axis=-1,
                          epsilon=self.p.eps, stash_type=1)

    def _rmsnorm(self, name: str, x: str, w: torch.Tensor) -> str:
        """HF's RMSNorm over the last axis: statistics in float32, weight applied in the model dtype (ONNX
        Runtime fuses this pattern)."""
        gb, c = self.gb, self.gb.const
        xf = x if self.p.dtype == torch.float32 else gb.op(f"{name}/Cast", "Cast", [x], to=F32)
        sq = gb.op(f"{name}/Pow", "Pow", [xf, c(2.0, torch.float32)])
        var = gb.op(f"{name}/ReduceMean", "ReduceMean", [sq, c([-1])], keepdims=1)
        std = gb.op(f"{name}/Sqrt", "Sqrt", [gb.op(f"{name}/Add", "Add", [var, c(self.p.eps, torch.float32)])])
        y = gb.op(f"{name}/Div", "Div", [xf, std])
        if self.p.dtype != torch.float32:
            y = gb.op(f"{name}/CastBack", "Cast", [y], to=self.p.elem)
        return gb.op(f"{name}/Mul", "Mul", [y, self.weight(f"{name}.weight", w)])

    def _rope(self, name: str, x: str, rope: tuple, heads: int) -> str:
        """x [B, heads, T, d]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], on the first
        rotary_dim coordinates (all of them unless the family rotates part of each head: partial rotary). rope:
        DecoderGraph.rotary's: ONNX Runtime's RotaryEmbedding over the tables (one node), or in standard ops."""
        gb, c, d, rd = self.gb, self.gb.const, self.p.head_dim, self.p.rotary_dim
        if rope[0] == "tables":
            _, pos, cos_cache, sin_cache = rope
            partial = {"rotary_embedding_dim": rd, "num_heads": heads} if rd < d else {}
            return gb.op(f"{name}/RotaryEmbedding", "RotaryEmbedding", [x, pos, cos_cache, sin_cache], domain=MS,
                         interleaved=0, **partial)
        _, cos, sin = rope
        rest = None
        if rd < d:
            x, rest = gb.op(f"{name}/SplitRotary", "Split", [x, c([rd, d - rd])], n_out=2, axis=-1)
        x1, x2 = gb.op(f"{name}/Split", "Split", [x, c([rd // 2, rd // 2])], n_out=2, axis=-1)
        rot = gb.op(f"{name}/Concat", "Concat", [gb.op(f"{name}/Neg", "Neg", [x2]), x1], axis=-1)
        y = gb.op(f"{name}/Add", "Add", [gb.op(f"{name}/MulCos", "Mul", [x, cos]), gb.op(f"{name}/MulSin", "Mul", [rot, sin])])
        return y if rest is None else gb.op(f"{name}/ConcatPass", "Concat", [y, rest], axis=-1)

    def _silu(self, name: str, x: str) -> str:
        return self.gb.op(f"{name}/Mul", "Mul", [x, self.gb.op(f"{name}/Sigmoid", "Sigmoid", [x])])

    def _gated_mlp(self, n: str, h: str, w: dict) -> str:
        """down(act(gate(h)) * up(h)), act = SiLU or GELU (tanh approximation). int4 weights at level 4 under SiLU:
        gate, up and the gate's product in one MatMulQ4A8Gated node (ops/matmul_q4a8.py)."""
        if self.p.weights.int8_blocks and self.p.act == "silu":
            stacked, _ = stack([(w["gate_proj"], None), (w["up_proj"], None)])
            name = f"{n}/gate_up_proj"
            gated = self.gb.op(f"{name}/MatMulQ4A8Gated", matmul_q4a8.GATED.name, [h] + self._quantized(name, stacked),
                               domain=DOMAIN, K=stacked.shape[1], N=stacked.shape[0], block_size=self.p.weights.block)
            return self._linear(f"{n}/down_proj", gated, w["down_proj"], None)
        gate, up = self._linears(f"{n}/gate_up_proj", h, [(w["gate_proj"], None), (w["up_proj"], None)])
        act = self._silu(f"{n}/act", gate) if self.p.act == "silu" else \
            self.gb.op(f"{n}/act/Gelu", "Gelu", [gate], approximate="tanh")
        return self._linear(f"{n}/down_proj", self.gb.op(f"{n}/Mul", "Mul", [act, up]), w["down_proj"], None)

    def _plain_mlp(self, n: str, h: str, w: dict) -> str:
        """proj(gelu_tanh(fc(h))) (GPT-2's MLP)."""
        a = self.gb.op(f"{n}/act/Gelu", "Gelu", [self._linear(f"{n}/fc", h, w["fc"], w.get("fc_bias"))], approximate="tanh")
        return self._linear(f"{n}/proj", a, w["proj"], w.get("proj_bias"))

    def _moe(self, n: str, h: str, w: dict) -> str:
        """Top-k routed experts, only the chosen ones run per token: ONNX Runtime's MoE op (QMoE with quantized
        weights) on the router's logits. Its SwiGLU takes gate and up rows interleaved (the CPU kernel's only
        layout); QMoE renormalises over the top k unless given the softmax weights, which the unrenormalised rule
        (OLMoE's norm_topk_prob false) passes as router_weights.

            h [B,T,H] --router (float)--> logits --Reshape [BT,E]--> MoE(h, logits, gate|up interleaved, down; k)
                       (QMoE: + Softmax(logits) as router_weights when the top-k weights are not renormalised)
        """
        gb, c, p = self.gb, self.gb.const, self.p
        logits = gb.op(f"{n}/router/MatMul", "MatMul", [h, self.weight(f"{n}/router.weight", w["router"].t())])
        e = w["router"].shape[0]
        logits = gb.op(f"{n}/router/Reshape", "Reshape", [logits, c([-1, e])])
        gate_up, down = w["experts_gate_up"], w["experts_down"]  # [E, 2I, H] gate rows first, [E, H, I]
        inter = down.shape[-1]
        fc1 = torch.stack([gate_up[:, :inter], gate_up[:, inter:]], 2).reshape(gate_up.shape)  # g0, u0, g1, u1, ...
        attrs = dict(k=int(w["top_k"]), activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
                     activation_beta=0.0)
        if not p.weights.quantized:
            return gb.op(f"{n}/experts/MoE", "MoE", [h, logits, self.weight(f"{n}/experts.fc1", fc1), "",
                                                     self.weight(f"{n}/experts.fc2", down)], domain=MS,
                         normalize_routing_weights=int(bool(w["norm_topk_prob"])), **attrs)
        fmt = p.weights
        w1 = self._quantized(f"{n}/experts.fc1", fc1, (e, fc1.shape[1], -1))
        w2 = self._quantized(f"{n}/experts.fc2", down, (e, down.shape[1], -1))
        zeros = [w1[2], w2[2]] if len(w1) > 2 else ["", ""]
        weights = "" if w["norm_topk_prob"] else gb.op(f"{n}/router/Softmax", "Softmax", [logits], axis=-1)
        ins = [h, logits, w1[0], w1[1], "", w2[0], w2[1], "", "", "", ""] + zeros + ["", weights]  # no fc3
        while not ins[-1]:
            ins.pop()
        return gb.op(f"{n}/experts/QMoE", "QMoE", ins, domain=MS, expert_weight_bits=fmt.bits, block_size=fmt.block,
                     accuracy_level=fmt.accuracy_level, normalize_routing_weights=0, **attrs)

    def _softcap(self, n: str, x: str, cap: float) -> str:
        c = self.gb.const
        t = self.gb.op(f"{n}/Tanh", "Tanh", [self.gb.op(f"{n}/Div", "Div", [x, c(cap, torch.float32)])])
        return self.gb.op(f"{n}/Mul", "Mul", [t, c(cap, torch.float32)])
