"""AquaCache: the KV cache the reference generates with (transformers' Cache API), holding what the exported
graph's cache holds: projected keys k^ sliced to r, values in P_v's basis, and AQUA-H2O's evicted state."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class AquaLayerCache(DynamicLayer):
    """One layer of an AquaCache.

    keys   [B, Hkv, S, r]  projected keys k^ (post-RoPE, P applied, sliced to r)
    values [B, Hkv, S, r]  values in P_v's basis, sliced to r
    valid  [B, Hkv, S]     slot holds a real, not evicted token
    acc    [B, Hkv, S]     H2O accumulated attention
    pos    [B, Hkv, S]     which token (0-based, padding counted) each slot holds
    n_real [B]             real (non-padding) tokens this sequence has seen
    seen                   logical length (tokens seen incl. padding): what HF's masks and positions use
    """

    def __init__(self, state):
        """state: the layer's attention.LayerAqua (its P_r, r and the values' basis)."""
        super().__init__()
        self.state = state
        self.seen = 0
        self.valid = self.acc = self.n_real = self.pos = None

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        b, hkv = key_states.shape[:2]
        self.keys = key_states.new_zeros(b, hkv, 0, self.state.r)
        self.values = value_states.new_zeros(b, hkv, 0, self.state.value_width)
        self.valid = torch.zeros(b, hkv, 0, dtype=torch.bool, device=key_states.device)
        self.acc = torch.zeros(b, hkv, 0, dtype=torch.float32, device=key_states.device)
        self.pos = torch.zeros(b, hkv, 0, dtype=torch.int64, device=key_states.device)
        self.n_real = torch.zeros(b, dtype=torch.int64, device=key_states.device)

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states/value_states [B, Hkv, T, d] post-RoPE, unprojected; stores k^ and sliced v."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        st = self.state
        kh = key_states @ st.P_r[None].to(key_states.dtype)
        vh = st.values_in(value_states)
        t = key_states.shape[2]
        self.keys = torch.cat([self.keys, kh], dim=-2)
        self.values = torch.cat([self.values, vh], dim=-2)
        b, hkv = kh.shape[:2]
        self.valid = torch.cat([self.valid, torch.ones(b, hkv, t, dtype=torch.bool, device=kh.device)], dim=-1)
        self.acc = torch.cat([self.acc, torch.zeros(b, hkv, t, device=kh.device)], dim=-1)
        new_pos = torch.arange(self.seen, self.seen + t, device=kh.device)
        self.pos = torch.cat([self.pos, new_pos.expand(b, hkv, t)], dim=-1)
        self.seen += t
        st.fresh = (self.keys, self)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def compact(self) -> None:
        """Physically drop invalid slots; the length becomes the largest kept count over (batch, head)."""
        keep = int(self.valid.sum(-1).max().item()) if self.valid.numel() else 0
        order = torch.sort((~self.valid).to(torch.int8), dim=-1, stable=True).indices[..., :keep]
        self.keys = torch.gather(self.keys, 2, order[..., None].expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = torch.gather(self.values, 2, order[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        self.valid = torch.gather(self.valid, 2, order)
        self.acc = torch.gather(self.acc, 2, order)
        self.pos = torch.gather(self.pos, 2, order)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("AquaCache does not support cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("AquaCache does not support beam search / num_return_sequences > 1")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("AquaCache does not support beam search")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("AquaCache does not support beam search")


class AquaCache(Cache):
    """KV cache holding projected, possibly narrowed, possibly evicted keys and values."""

    def __init__(self, states: list):
        """states: one attention.LayerAqua per layer."""
        super().__init__(layers=[AquaLayerCache(s) for s in states])
