"""Building blocks of the decoder graph that do not depend on the attention: weights in the export dtype,
linear layers, norms, the rotary rotation, MLPs (gated, plain, routed experts) and soft-capping.

Mixed into DecoderGraph, which provides ``gb`` (the GraphBuilder), ``p`` (the Plan) and ``cast``.
"""

from __future__ import annotations

import torch
from onnx import TensorProto

from .config import ConfigError

F32 = TensorProto.FLOAT


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

    def _linear(self, name: str, x: str, w: torch.Tensor, b: torch.Tensor | None) -> str:
        """x [..., in] @ W^T (+ b): W [out, in] stored transposed, [in, out], in the export dtype."""
        wt = self.weight(f"{name}.weight", w.t())
        y = self.gb.op(f"{name}/MatMul", "MatMul", [x, wt])
        if b is not None:
            y = self.gb.op(f"{name}/Add", "Add", [y, self.weight(f"{name}.bias", b)])
        return y

    def _linears(self, name: str, x: str, parts: list) -> list[str]:
        """[x @ W_i^T (+ b_i) for (W_i, b_i) in parts] as one MatMul over the stacked weights, split back: at
        decode a step is a chain of small GEMVs, and fewer, wider ones cost less per node."""
        y = self._linear(name, x, *stack(parts))
        return self.gb.op(f"{name}/Split", "Split", [y, self.gb.const([wi.shape[0] for wi, _ in parts])],
                          n_out=len(parts), axis=-1)

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

    def _rope(self, name: str, x: str, cos: str, sin: str) -> str:
        """x [B, heads, T, d]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], on the first
        rotary_dim coordinates (all of them unless the family rotates part of each head: partial rotary)."""
        gb, c, d, rd = self.gb, self.gb.const, self.p.head_dim, self.p.rotary_dim
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
        """down(act(gate(h)) * up(h)), act = SiLU or GELU (tanh approximation)."""
        gate, up = self._linears(f"{n}/gate_up_proj", h, [(w["gate_proj"], None), (w["up_proj"], None)])
        act = self._silu(f"{n}/act", gate) if self.p.act == "silu" else \
            self.gb.op(f"{n}/act/Gelu", "Gelu", [gate], approximate="tanh")
        return self._linear(f"{n}/down_proj", self.gb.op(f"{n}/Mul", "Mul", [act, up]), w["down_proj"], None)

    def _plain_mlp(self, n: str, h: str, w: dict) -> str:
        """proj(gelu_tanh(fc(h))) (GPT-2's MLP)."""
        a = self.gb.op(f"{n}/act/Gelu", "Gelu", [self._linear(f"{n}/fc", h, w["fc"], w.get("fc_bias"))], approximate="tanh")
        return self._linear(f"{n}/proj", a, w["proj"], w.get("proj_bias"))

    def _moe(self, n: str, h: str, w: dict) -> str:
        """Top-k routed experts with standard ops: the router's softmax (float32), TopK, the chosen probabilities
        scattered into a dense [B, T, E] weight; every expert runs on every token (batched MatMul over E) and
        the outputs are summed with those weights. Exact, at E / top_k times the routed MLP's arithmetic.

            h --router--> Softmax --TopK(k)--> ScatterElements --> w [B,E,T,1]
            h [B,1,T,H] --MatMul gate_up [E,H,2I]--> Split --> silu(gate) * up --MatMul down [E,I,H]--> * w --> Sum_E
        """
        gb, c, p = self.gb, self.gb.const, self.p
        logits = self._linear(f"{n}/router", h, w["router"], None)
        if p.dtype != torch.float32:
            logits = gb.op(f"{n}/router/Cast", "Cast", [logits], to=F32)
        probs = gb.op(f"{n}/router/Softmax", "Softmax", [logits], axis=-1)
        top_v, top_i = gb.op(f"{n}/router/TopK", "TopK", [probs, c([int(w["top_k"])])], n_out=2, axis=-1, largest=1,
                             sorted=1)
        if w["norm_topk_prob"]:
            top_v = gb.op(f"{n}/router/Renorm", "Div", [top_v, gb.op(f"{n}/router/SumTop", "ReduceSum", [top_v, c([-1])],
                                                                      keepdims=1)])
        dense = gb.op(f"{n}/router/Zeros", "Mul", [probs, c(0.0, torch.float32)])
        dense = gb.op(f"{n}/router/Scatter", "ScatterElements", [dense, top_i, top_v], axis=-1)  # [B, T, E]
        if p.dtype != torch.float32:
            dense = gb.op(f"{n}/router/CastBack", "Cast", [dense], to=p.elem)
        route = gb.op(f"{n}/router/Unsqueeze", "Unsqueeze", [gb.op(f"{n}/router/Transpose", "Transpose", [dense],
                                                                    perm=[0, 2, 1]), c([-1])])  # [B, E, T, 1]
        gu = self.weight(f"{n}/experts.gate_up", w["experts_gate_up"].transpose(1, 2))  # [E, H, 2I]
        down = self.weight(f"{n}/experts.down", w["experts_down"].transpose(1, 2))  # [E, I, H]
        inter = w["experts_down"].shape[-1]
        y = gb.op(f"{n}/experts/MatMulGateUp", "MatMul", [gb.op(f"{n}/experts/Unsqueeze", "Unsqueeze", [h, c([1])]), gu])
        gate, up = gb.op(f"{n}/experts/Split", "Split", [y, c([inter, inter])], n_out=2, axis=-1)
        a = gb.op(f"{n}/experts/Mul", "Mul", [self._silu(f"{n}/experts/act", gate), up])
        y = gb.op(f"{n}/experts/Weighted", "Mul", [gb.op(f"{n}/experts/MatMulDown", "MatMul", [a, down]), route])
        return gb.op(f"{n}/experts/Sum", "ReduceSum", [y, c([1])], keepdims=0)

    def _softcap(self, n: str, x: str, cap: float) -> str:
        c = self.gb.const
        t = self.gb.op(f"{n}/Tanh", "Tanh", [self.gb.op(f"{n}/Div", "Div", [x, c(cap, torch.float32)])])
        return self.gb.op(f"{n}/Mul", "Mul", [t, c(cap, torch.float32)])
