"""transformers' ``generate`` on the GPU with the Triton kernels: a static cache laid out as the node's and the
attention function that hands each decode step to ``aqua_attention``.

    with attention_on(model, setting, batch, capacity) as cache:
        model.generate(ids, past_key_values=cache, ...)

Per layer the cache holds, for ``capacity`` positions of ``batch`` sequences (docs/design.md, The operator):

    dense  K [B, Hkv, C, d] and V [B, Hkv, C, d] as written; a step is torch SDPA over the positions so far
    aqua   K^ = K P [B, Hkv, d, C] (dim-major, as AquaAttention reads it) and V [B, Hkv, C, d]; a step is
           aqua_attention: the fused kernel on k coordinates, or token selection's pages read whole

A prompt's rows (T > 1, any setting) attend exactly, as token selection's prompt does in the graph: SDPA of
q^ = q P against K^ (P orthogonal, so q^ . k^ = q . k), causal from the bottom right so a prompt may come in
chunks after earlier ones. The fused kernel's prompt rows are therefore exact here, where the graph's are
approximate; its decode steps are the node's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...ops.spec import GROUP
from .tokens import Tokens

IMPL = "aqua_triton"


@dataclass(frozen=True)
class GpuSetting:
    """One way to attend. k: coordinates of q^ per step (None: dense SDPA, no P); rule: the selection rule
    (ops.spec's codes); tokens: token selection's attributes or None."""

    name: str
    k: int | None = None
    rule: int = GROUP
    tokens: Tokens | None = None

    @property
    def projected(self) -> bool:
        return self.k is not None


@dataclass(eq=False)
class _Slot:
    """One layer's buffers and the setting it attends with."""

    setting: GpuSetting
    keys: torch.Tensor  # dense [B, Hkv, C, d]; projected [B, Hkv, d, C]
    values: torch.Tensor  # [B, Hkv, C, d]
    P: torch.Tensor | None  # [Hkv, d, d] orthogonal, or None (dense)
    ones: torch.Tensor  # [1, C] int32: attention_mask (no padding)
    seen: int = 0
    freeze: bool = False  # a replayed step: write position `seen` but do not advance (tools/bench_gpu_generate.py)


def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class StaticAquaLayer(DynamicLayer):
        """transformers' view of a _Slot: update writes the new rows at the next positions (K projected by P and
        transposed when the setting is projected) and returns the buffers; lengths are the slot's."""

        def __init__(self, slot: _Slot):
            super().__init__()
            self.slot = slot
            self.keys, self.values, self.is_initialized = slot.keys, slot.values, True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            """key_states / value_states [B, Hkv, T, d], post-RoPE."""
            s, t = self.slot, key_states.shape[2]
            if s.seen + t > s.values.shape[2]:
                raise ValueError(f"aqua_triton: {s.seen + t} positions do not fit the cache's {s.values.shape[2]}")
            if s.P is None:
                s.keys[:, :, s.seen:s.seen + t] = key_states
            else:
                s.keys[..., s.seen:s.seen + t] = torch.einsum("bhtd,hdr->bhrt", key_states, s.P)
            s.values[:, :, s.seen:s.seen + t] = value_states
            if not s.freeze:
                s.seen += t
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.slot.seen

        def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
            return self.slot.seen + (query_length if isinstance(query_length, int) else query_length.shape[0]), 0

        def get_max_length(self) -> int:
            return self.slot.values.shape[2]

    return StaticAquaLayer


def _prompt(slot: _Slot, q: torch.Tensor, total: int, scale: float) -> torch.Tensor:
    """q [B, H, T, d] (the last T of ``total`` positions) -> exact causal attention [B, H, T, d]."""
    from torch.nn.attention.bias import causal_lower_right

    b, h, t, d = q.shape
    g = h // slot.values.shape[1]
    keys = slot.keys[:, :, :total] if slot.P is None else slot.keys[..., :total].transpose(2, 3)
    if slot.P is not None:  # q^ = q P per KV head
        q = torch.einsum("bhgtd,hdr->bhgtr", q.view(b, h // g, g, t, d), slot.P).reshape(b, h, t, d)
    keys, values = (x.repeat_interleave(g, dim=1) for x in (keys, slot.values[:, :, :total]))
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(t, total),
                                                            scale=scale)


def _step(slot: _Slot, q: torch.Tensor, total: int, scale: float) -> torch.Tensor:
    """q [B, H, 1, d] -> attention over the ``total`` positions [B, H, 1, d]. The node takes q scaled (the graph
    folds the scale into W_Q), so the kernels get q * scale."""
    from .aqua_attention import aqua_attention

    s = slot.setting
    if s.k is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, slot.keys[:, :, :total], slot.values[:, :, :total], enable_gqa=True, scale=scale)
    b, h, t, d = q.shape
    hkv = slot.values.shape[1]
    out = aqua_attention((q * scale).view(b, hkv, h // hkv, t, d), slot.keys, slot.values, total,
                         slot.ones[:, :total], s.k, s.rule, projection=slot.P, tokens=s.tokens)
    return out.view(b, h, t, d)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: query [B, H, T, d] -> ([B, T, H, d], None)."""
    slot = module.aqua_triton_slot
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    total = slot.seen + (query.shape[2] if slot.freeze else 0)
    out = (_prompt if query.shape[2] > 1 else _step)(slot, query, total, scale)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPL, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPL, lambda *args, **kwargs: None)  # causality is the function's own


def projections(layers: int, hkv: int, d: int, device, dtype, seed: int = 0) -> list[torch.Tensor]:
    """Random orthogonal P per layer [Hkv, d, d] (speed does not depend on which: the calibrated P of
    projection.py would slot in the same way)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.linalg.qr(torch.randn(hkv, d, d, generator=gen, dtype=torch.float64))[0].to(device, dtype)
            for _ in range(layers)]


@contextlib.contextmanager
def attention_on(model, setting: GpuSetting, batch: int, capacity: int, P: list | None = None):
    """Route the model's attention through the setting, over a fresh static cache of ``capacity`` positions per
    sequence; yields the transformers Cache to pass as past_key_values. P: per layer [Hkv, d, d] (projected
    settings; default: projections()). The model's attention implementation is restored on exit."""
    from transformers.cache_utils import Cache

    _register()
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hkv, n = cfg.num_key_value_heads, cfg.num_hidden_layers
    dev, dt = model.device, model.dtype
    if setting.projected and P is None:
        P = projections(n, hkv, d, dev, dt)
    ones = torch.ones(1, capacity, dtype=torch.int32, device=dev)
    slots = []
    for i in range(n):
        shape = (batch, hkv, d, capacity) if setting.projected else (batch, hkv, capacity, d)
        slots.append(_Slot(setting, torch.zeros(shape, device=dev, dtype=dt),
                           torch.zeros(batch, hkv, capacity, d, device=dev, dtype=dt),
                           P[i].to(dev, dt) if setting.projected else None, ones))
    attns = [layer.self_attn for layer in model.model.layers]
    before = cfg._attn_implementation
    for a, s in zip(attns, slots, strict=True):
        a.aqua_triton_slot = s
    model.set_attn_implementation(IMPL)
    layer = _layer_class()
    try:
        yield Cache(layers=[layer(s) for s in slots])
    finally:
        model.set_attn_implementation(before)
        for a in attns:
            del a.aqua_triton_slot
