"""The weights a quantized folder computes with, in the layout the PyTorch reference computes in, so parity compares
the export with a reference of the *same* dequantized weights (it tests the export, not the quantizer).

Per layer, the export folds (fold.attention_projections: the attention scale into W_Q, P_v into W_V / W_O, P into
W_Q / W_K without a rotary embedding), then quantizes each matrix row by row (quantize.py). The reference applies
the same folds in float32, takes each matrix's round trip quantize -> dequantize, and maps it back to the module it
came from:

    q_proj  W~_Q / s (s the attention scale, folded into W_Q; not when q_norm takes it), unfolded from P_q's
            coordinates without a rotary embedding (_unfold_projection)
    k_proj  W~_K, likewise unfolded from P_k's coordinates without a rotary embedding
    v_proj  P_v[:, :rv] W~_V per KV head (the reference keeps the model's basis and projects values by P_v in attention)
    o_proj  W~_O P_v[:, :rv]^T per query head
    MLP, experts, the output layer and the embedding: their round trip (quantization is row by row, so a slice of
    rows of the round trip is the round trip of those rows: the output layer and the embedding go by rows)

Used by precision.computing_in(model, dtype, weights=...), one layer at a time while it runs (write_layer).
"""

from __future__ import annotations

import torch

from ..fold import attention_projections, layer_bases
from ..models import architecture_of, attention_geometry
from ..quantize import SLICE_ELEMENTS, WeightFormat, roundtrip


class ExportedWeights:
    """model: the HF model; projection: the folder's artifact; config: its AQUA settings; widths / value_widths: its
    contract's per-layer K^ and V widths; fmt: its weight format (quantized)."""

    def __init__(self, model, projection, config, contract, fmt: WeightFormat):
        self.arch = architecture_of(model.config)
        self.geo = attention_geometry(model)
        self.fmt, self.value_widths = fmt, contract.value_widths
        # the bases each layer of the export folds in (the identity for a dense export)
        self.bases = lambda i: layer_bases(projection, config, contract, i, self.geo["head_dim"])

    def write_layer(self, i: int, layer) -> None:
        """Layer i's weights (Adapter.layer_weights' views, the widened copies the reference computes with while the
        layer runs) overwritten in place by what the folder computes with. The matrices that are not folded (the MLP,
        the experts) go a slice of rows at a time (quantization is by rows), so that what the round trip adds to
        memory stays a few MiB whatever the layer (an OLMoE layer's experts are 400M weights)."""
        views = self.arch.layer_weights(layer)
        for role, t in self._attention(i, layer, views).items():
            views[role].copy_(t)
        for role in ("gate_proj", "up_proj", "down_proj", "fc", "proj", "experts_gate_up", "experts_down"):
            if isinstance(views.get(role), torch.Tensor):
                _roundtrip_in_place(views[role], self.fmt)

    def _attention(self, i: int, layer, w: dict) -> dict[str, torch.Tensor]:
        """q/k/v/o_proj as the export folds and quantizes them, mapped back to the module's own basis, float32."""
        arch, d = self.arch, self.geo["head_dim"]
        rv, rotary = self.value_widths[i], arch.has_rotary
        P, P_v = self.bases(i)
        P_v = P_v.to(torch.float32)
        scaling = float(arch.attention(layer).scaling)
        proj = attention_projections(w, P, P_v, scaling, self.geo["heads"], rv, rotary)
        q, k, v, o = (roundtrip(proj[x][0], self.fmt) for x in "qkvo")
        q = q if "q_norm" in w else q / scaling  # the reference applies the scale to the scores
        if not rotary:
            q, k = (_unfold_projection(t, b, self.geo["heads"] if x == "q" else self.geo["kv_heads"])
                    for t, b, x in zip((q, k), P, "qk"))
        return {"q_proj": q, "k_proj": k, **self._values(v, o, P_v, rv, d)}

    def _values(self, v, o, P_v, rv, d) -> dict:
        """v [Hkv*rv, D], o [D, H*rv] in P_v's sliced basis -> v_proj / o_proj in the model's own basis (the reference
        projects values by P_v inside attention): W_V = P_v[:, :rv] v, W_O = o P_v[:, :rv]^T per head."""
        hkv, heads = self.geo["kv_heads"], self.geo["heads"]
        basis = P_v[:, :, :rv]
        v_model = torch.einsum("hde,heD->hdD", basis, v.reshape(hkv, rv, -1)).reshape(hkv * d, -1)
        o_model = torch.einsum("ohge,hde->ohgd", o.reshape(o.shape[0], hkv, heads // hkv, rv), basis)
        return {"v_proj": v_model, "o_proj": o_model.reshape(o.shape[0], -1)}

    def rows(self, weight: torch.Tensor, index) -> torch.Tensor:
        """weight[index] (the output layer's or the embedding's rows) as the folder computes with it."""
        return roundtrip(weight[index], self.fmt)


def _roundtrip_in_place(t: torch.Tensor, fmt: WeightFormat) -> None:
    """t [..., N, K] (rows of blocks along K) <- its round trip, by slices of its first dimension."""
    step = max(1, SLICE_ELEMENTS // max(1, t[0].numel()))
    for a in range(0, t.shape[0], step):
        t[a:a + step].copy_(roundtrip(t[a:a + step], fmt))


def _unfold_projection(wt: torch.Tensor, basis: torch.Tensor, heads: int) -> torch.Tensor:
    """W~ [heads * r, D], per head the round trip of B^T W with B = basis [Hkv, d, r] = P_r diag(c) (P_r's columns
    orthonormal, c the weighted rules' per-coordinate factor, 1 otherwise) -> the reference's W [heads * d, D]:
    W = B (B^T B)^-1 W~ = P_r diag(1 / c) W~, so that the reference's own projection P_r^T W = diag(1 / c) W~ is the
    export's coordinates without the factor the weighted rules fold into P (fold.selection_bases)."""
    hkv, d, r = basis.shape
    b = basis.to(torch.float64)
    pinv = torch.linalg.solve(b.transpose(1, 2) @ b, b.transpose(1, 2))  # [Hkv, r, d]
    per = heads // hkv
    w = wt.to(torch.float64).reshape(hkv, per, r, -1)
    return torch.einsum("hrd,hgrD->hgdD", pinv, w).reshape(heads * d, -1).to(torch.float32)
