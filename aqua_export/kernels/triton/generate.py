"""transformers' ``generate`` on the GPU with the Triton kernels: a static cache laid out as the node's and the
attention function that hands each decode step to ``aqua_attention``.

    with attention_on(model, setting, batch, capacity) as cache:
        model.generate(ids, past_key_values=cache, ...)          # eager steps, bound by Python's launches
    with attention_on(model, setting, batch, capacity) as cache:
        model(ids[:, :-1], past_key_values=cache)               # the prompt (in chunks if long)
        greedy(model, cache, ids[:, -1:], new).tokens            # steps replayed from CUDA graphs

Per layer the cache holds, for ``capacity`` positions of ``batch`` sequences (docs/design.md, The operator):

    dense  K [B, Hkv, C, d] and V [B, Hkv, C, d] as written; a step is torch SDPA over the positions so far
    aqua   K^ = K P [B, Hkv, d, C] (dim-major, as AquaAttention reads it) and V [B, Hkv, C, d]; a step is
           aqua_attention: the fused kernel on k coordinates, or token selection's pages read whole

A prompt's rows (T > 1, any setting) attend exactly, as token selection's prompt does in the graph: SDPA of
q^ = q P against K^ (P orthogonal, so q^ . k^ = q . k), causal from the bottom right so a prompt may come in
chunks after earlier ones. The fused kernel's prompt rows are therefore exact here, where the graph's are
approximate; its decode steps are the node's. Under sparse prefill (a projected setting's ``prefill``) the prompt
goes through aqua_attention on every coordinate, each query block over the key blocks its estimate keeps.

``greedy`` decodes with the step's lengths on the device (_Static: the slot a step writes, and the mask of the
positions written), so the kernels' shapes depend only on a bucket of positions and one captured CUDA graph
replays every step of its bucket: the host launches a whole step at once instead of ~30 ms of Python.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...ops.spec import GROUP
from .prefill import Prefill
from .tokens import Tokens

IMPL = "aqua_triton"
BUCKET = 256  # positions one captured step covers: a graph serves every step whose position falls in its bucket


@dataclass(frozen=True)
class GpuSetting:
    """One way to attend. k: coordinates of q^ per step (None: dense SDPA, no P); rule: the selection rule
    (ops.spec's codes); tokens: token selection's attributes or None; prefill: sparse prefill's or None (a projected
    setting's prompt)."""

    name: str
    k: int | None = None
    rule: int = GROUP
    tokens: Tokens | None = None
    prefill: Prefill | None = None

    def __post_init__(self):
        if self.prefill is not None and self.k is None:
            raise ValueError("aqua_triton: sparse prefill estimates with q^ = q P: give the setting a k")

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
    static: _Static | None = None  # while greedy runs: the step's lengths on the device


@dataclass(eq=False)
class _Static:
    """A decode step's lengths on the device, shared by every layer, so a captured graph serves many steps: the
    step writes slot ``write`` and attends the first ``span`` slots (its bucket's end, fixed per graph), seeing
    those ``mask`` marks written. Slots of one cache capacity C' (C rounded up to 16, the SDPA mask's alignment)."""

    write: torch.Tensor  # [1] int64
    mask: torch.Tensor  # [1, C'] int32: 1 at the positions written (the aqua kernels' attention_mask)
    bias: torch.Tensor  # [1, 1, 1, C'] the model's dtype: 0 there, -inf elsewhere (dense SDPA's mask)
    span: int = 0

    @classmethod
    def after(cls, seen: int, capacity: int, device, dtype) -> _Static:
        """The state of a cache holding its first ``seen`` positions."""
        c = -(-capacity // 16) * 16
        mask = torch.zeros(1, c, dtype=torch.int32, device=device)
        mask[:, :seen] = 1
        bias = torch.full((1, 1, 1, c), float("-inf"), dtype=dtype, device=device)
        bias[..., :seen] = 0
        return cls(torch.full((1,), seen, dtype=torch.int64, device=device), mask, bias)

    def open(self) -> None:
        """The step's own position becomes visible (inside the step, so a graph replays it)."""
        self.mask.index_fill_(1, self.write, 1)
        self.bias.index_fill_(3, self.write, 0.0)


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
            if s.static is not None:
                return self._write_static(key_states, value_states)
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

        def _write_static(self, key_states, value_states):
            """One decode row [B, Hkv, 1, d] written at the slot the device holds."""
            s = self.slot
            if key_states.shape[2] != 1:
                raise ValueError("aqua_triton: greedy's steps take one token per sequence")
            at = s.static.write
            if s.P is None:
                s.keys.index_copy_(2, at, key_states)
            else:
                s.keys.index_copy_(3, at, torch.einsum("bhtd,hdr->bhrt", key_states, s.P))
            s.values.index_copy_(2, at, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.slot.seen

        def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
            return self.slot.seen + (query_length if isinstance(query_length, int) else query_length.shape[0]), 0

        def get_max_length(self) -> int:
            return self.slot.values.shape[2]

    return StaticAquaLayer


def _prompt(slot: _Slot, q: torch.Tensor, total: int, scale: float) -> torch.Tensor:
    """q [B, H, T, d] (the last T of ``total`` positions) -> causal attention [B, H, T, d]: exact, or over the key
    blocks sparse prefill keeps."""
    from torch.nn.attention.bias import causal_lower_right

    b, h, t, d = q.shape
    g = h // slot.values.shape[1]
    if slot.setting.prefill is not None:  # every coordinate (k = d: exact scores), over the kept key blocks
        from .aqua_attention import aqua_attention

        out = aqua_attention((q * scale).reshape(b, h // g, g, t, d), slot.keys, slot.values, total,
                             slot.ones[:, :total], d, GROUP, projection=slot.P, prefill=slot.setting.prefill)
        return out.reshape(b, h, t, d)
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


def _static_step(slot: _Slot, q: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, 1, d] -> attention over the first ``span`` slots that the mask marks [B, H, 1, d]. Dense: SDPA with
    the g query heads of a KV head as g rows over its keys (GQA without copying K and V), the bias masking the
    slots not written yet."""
    from .aqua_attention import aqua_attention

    st, s = slot.static, slot.setting
    b, h, _, d = q.shape
    hkv = slot.values.shape[1]
    if s.k is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(b, hkv, h // hkv, d), slot.keys[:, :, :st.span], slot.values[:, :, :st.span],
            attn_mask=st.bias[..., :st.span], scale=scale)
        return out.reshape(b, h, 1, d)  # CUDA's masked SDPA answers in another layout
    out = aqua_attention((q * scale).reshape(b, hkv, h // hkv, 1, d), slot.keys, slot.values, st.span,
                         st.mask[:, :st.span], s.k, s.rule, projection=slot.P, tokens=s.tokens)
    return out.view(b, h, 1, d)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: query [B, H, T, d] -> ([B, T, H, d], None)."""
    slot = module.aqua_triton_slot
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if slot.static is not None:
        return _static_step(slot, query, scale).transpose(1, 2).contiguous(), None
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


def _taken_over(old: _Slot, setting: GpuSetting, P: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An earlier slot's positions in this setting's layout -> (keys, values): K from K^ = K P_old (P orthogonal,
    so K = K^^T P_old^T), then K^ = K P when projected; values and an unchanged layout are shared, not copied."""
    if (old.P is None and P is None) or (old.P is not None and P is not None and torch.equal(old.P, P)):
        return old.keys, old.values
    keys = old.keys if old.P is None else torch.einsum("bhrc,hdr->bhcd", old.keys, old.P)
    return (keys if P is None else torch.einsum("bhcd,hdr->bhrc", keys, P).contiguous()), old.values


@contextlib.contextmanager
def attention_on(model, setting: GpuSetting, batch: int, capacity: int, P: list | None = None, prefilled=None):
    """Route the model's attention through the setting, over a fresh static cache of ``capacity`` positions per
    sequence; yields the transformers Cache to pass as past_key_values. P: per layer [Hkv, d, d] (projected
    settings; default: projections()). prefilled: a Cache an earlier attention_on of this model yielded (same
    batch and capacity): its positions are taken over, K projected for this setting (every setting's prompt is
    exact, so one prefill serves them all). The model's attention implementation is restored on exit."""
    from transformers.cache_utils import Cache

    _register()
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hkv, n = cfg.num_key_value_heads, cfg.num_hidden_layers
    dev, dt = model.device, model.dtype
    if setting.projected and P is None:
        P = projections(n, hkv, d, dev, dt)
    earlier = [layer.slot for layer in prefilled.layers] if prefilled is not None else None
    if earlier and earlier[0].values.shape[:3] != (batch, hkv, capacity):
        raise ValueError("aqua_triton: a prefilled cache must have this batch and capacity")
    ones = torch.ones(1, capacity, dtype=torch.int32, device=dev)
    slots = []
    for i in range(n):
        p = P[i].to(dev, dt) if setting.projected else None
        if earlier:
            keys, values = _taken_over(earlier[i], setting, p)
        else:
            shape = (batch, hkv, d, capacity) if setting.projected else (batch, hkv, capacity, d)
            keys, values = (torch.zeros(x, device=dev, dtype=dt) for x in (shape, (batch, hkv, capacity, d)))
        slots.append(_Slot(setting, keys, values, p, ones, seen=earlier[i].seen if earlier else 0))
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

@dataclass
class Decoded:
    """greedy's result: tokens [B, new]; logits [new, B, V] float32 on the CPU (asked for) or None; stamps: the
    host clock after each step's token was on the device (a synchronized clock's, asked for)."""

    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    stamps: list[float] | None = None


def _captured(step, state: list[torch.Tensor]):
    """The step captured in a CUDA graph -> (graph, its logits buffer). One eager run on a side stream first
    (Triton's compiles, cuBLAS's workspaces), ``state`` restored after it: that run wrote the same slot the
    replay writes next, and the mask's entry for it is the replay's own."""
    keep = [x.clone() for x in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for x, y in zip(state, keep, strict=True):
        x.copy_(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    return graph, logits


@torch.no_grad()
def greedy(model, cache, token: torch.Tensor, new: int, bucket: int = BUCKET, graphs: bool | None = None,
           logits: bool = False, clock=None) -> Decoded:
    """Greedy decoding from the cache attention_on yielded, its slots holding the positions so far: token [B, 1]
    is the next position's input (the prompt's last token) -> Decoded with the ``new`` tokens [B, new]. Each step
    writes and attends with lengths on the device (_Static), so on a GPU one CUDA graph per bucket of positions
    replays every step of the bucket; graphs=False (the default without a GPU) runs the same step eagerly.
    clock(): a host clock read after each step (it synchronizes)."""
    slots = [layer.slot for layer in cache.layers]
    seen, cap = slots[0].seen, slots[0].values.shape[2]
    if seen + new > cap:
        raise ValueError(f"aqua_triton: {seen + new} positions do not fit the cache's {cap}")
    graphs = token.is_cuda if graphs is None else graphs
    st = _Static.after(seen, cap, token.device, model.dtype)
    tok, pos = token.clone(), torch.full_like(token, seen)
    out = torch.empty(new, token.shape[0], dtype=token.dtype, device=token.device)
    kept, stamps = [], [] if clock else None

    def step() -> torch.Tensor:
        st.open()
        last = model(tok, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tok.copy_(last.argmax(-1, keepdim=True))
        pos.add_(1)
        st.write.add_(1)
        return last

    for s in slots:
        s.static = st
    graph, done = None, 0
    try:
        for i in range(new):
            span = min(-(-(seen + i + 1) // bucket) * bucket, cap)
            if span != st.span:  # a new bucket: the kernels' shapes change, so does the graph
                st.span, graph = span, None
                if graphs:
                    graph, last = _captured(step, [tok, pos, st.write])
            if graph is None:
                last = step()
            else:
                graph.replay()
            out[i] = tok[:, 0]
            done = i + 1
            if logits:
                kept.append(last.float().cpu())
            if clock:
                stamps.append(clock())
    finally:
        for s in slots:
            s.static = None
            s.seen = seen + done
    return Decoded(out.T.contiguous(), torch.stack(kept) if logits else None, stamps)
