"""Gemma 2: RMSNorm with a (1 + w) weight, four norms per layer (the attention and MLP outputs are normalised
before their residual adds), embeddings scaled by sqrt(hidden) (HF's scaled embedding module), gated GELU (tanh)
MLP, tanh soft-capping of attention scores and of the final logits, sliding-window layers alternating with
global ones."""

from ..config import ConfigError
from . import register
from .base import Adapter


@register
class Gemma2(Adapter):
    model_type = "gemma2"
    class_name = "Gemma2ForCausalLM"
    mlp_act = "gelu_tanh"
    tiny = {"sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0}

    def check(self, config) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"{self.model_type} with hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")

    def attn_softcap(self, config):
        return getattr(config, "attn_logit_softcapping", None)

    def final_softcap(self, config):
        return getattr(config, "final_logit_softcapping", None)

    def layer_weights(self, layer) -> dict:
        """Norm weights as (1 + w), the factor Gemma's RMSNorm applies; the sandwich norms by where they act:
        attn_out_norm and mlp_out_norm on the block outputs, post_attention_layernorm before the MLP."""
        w = super().layer_weights(layer)
        one = lambda n: 1.0 + n.weight.detach().float()  # noqa: E731
        w.update(input_layernorm=one(layer.input_layernorm), attn_out_norm=one(layer.post_attention_layernorm),
                 post_attention_layernorm=one(layer.pre_feedforward_layernorm),
                 mlp_out_norm=one(layer.post_feedforward_layernorm))
        for name in ("q_norm", "k_norm"):
            if w.get(name) is not None:
                w[name] = 1.0 + w[name].float()
        return w

    def final_norm(self, model):
        return 1.0 + self.final_norm_module(model).weight.detach().float(), None
