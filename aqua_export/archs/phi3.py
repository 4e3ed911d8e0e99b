"""Phi-3: fused qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows), optionally partial rotary, sliding
window when the config sets one (Phi-3-mini-4k: 2047). LongRoPE (the 128k variants) switches its frequencies
with the sequence length at run time, which one exported graph does not represent: refused."""

from types import SimpleNamespace

from ..config import ConfigError
from . import register
from .base import Adapter


@register
class Phi3(Adapter):
    model_type = "phi3"
    class_name = "Phi3ForCausalLM"
    tiny = {"partial_rotary_factor": 0.5, "sliding_window": 12}

    def check(self, config) -> None:
        super().check(config)
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope == "longrope":
            raise ConfigError("phi3 with LongRoPE (rope_type 'longrope', the 128k-context variants) is not supported: "
                              "its rotary frequencies change with the sequence length; use a 4k/8k variant")

    def _rows(self, layer):
        a = layer.self_attn
        q = a.config.num_attention_heads * a.head_dim
        kv = a.num_key_value_heads * a.head_dim
        return a.qkv_proj.weight, q, kv

    def layer_weights(self, layer) -> dict:
        w, q, kv = self._rows(layer)
        gu, inter = layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight.shape[1]
        out = {"input_layernorm": layer.input_layernorm.weight, "post_attention_layernorm": layer.post_attention_layernorm.weight,
               "q_proj": w[:q], "k_proj": w[q:q + kv], "v_proj": w[q + kv:], "o_proj": layer.self_attn.o_proj.weight,
               "q_proj_bias": None, "k_proj_bias": None, "v_proj_bias": None, "o_proj_bias": None,
               "gate_proj": gu[:inter], "up_proj": gu[inter:], "down_proj": layer.mlp.down_proj.weight}
        return {k: (None if v is None else v.detach()) for k, v in out.items()}

    def attention_linears(self, layer) -> list:
        return [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]

    def value_output(self, layer):
        """The v rows of the fused qkv_proj as a view: folding P_v into it writes through to qkv_proj."""
        w, q, kv = self._rows(layer)
        return SimpleNamespace(weight=w[q + kv:], bias=None), layer.self_attn.o_proj
