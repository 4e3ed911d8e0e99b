"""Gemma 3 (text, Gemma3ForCausalLM): Gemma 2's layout without soft-capping, with (1 + w) RMSNorms on each head's
q and k, and two rotary embeddings: local (sliding-window layers) and global, with their own frequencies."""

from . import register
from .gemma2 import Gemma2


@register
class Gemma3(Gemma2):
    model_type = "gemma3_text"
    class_name = "Gemma3ForCausalLM"
    config_class = "Gemma3TextConfig"
    tiny = {"sliding_window": 8, "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"]}

    def attn_softcap(self, config):
        return None

    def rotary(self, model, layer_idx: int):
        rot, kind = self.decoder(model).rotary_emb, model.config.layer_types[layer_idx]
        return getattr(rot, f"{kind}_inv_freq"), float(getattr(rot, f"{kind}_attention_scaling", 1.0))
