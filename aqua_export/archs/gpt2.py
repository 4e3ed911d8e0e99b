"""GPT-2: learned absolute positions (no rotary embedding, so P folds exactly into W_Q and W_K and costs
nothing at run time), LayerNorm with bias, fused c_attn (Conv1D: weights stored [in, out]), GELU (tanh) MLP
with biases, tied embeddings. Multi-head attention (g = 1)."""

from types import SimpleNamespace

from ..config import ConfigError
from . import register
from .base import Adapter


@register
class Gpt2(Adapter):
    model_type = "gpt2"
    class_name = "GPT2LMHeadModel"
    has_rotary = False
    norm_eps_attr = "layer_norm_epsilon"

    def check(self, config) -> None:
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"gpt2 with activation_function={config.activation_function!r} is not supported "
                              "(gelu_new)")
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn or not config.scale_attn_weights:
            raise ConfigError("gpt2 with scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or without "
                              "scale_attn_weights is not supported")

    def decoder(self, model):
        return model.transformer

    def layers(self, model):
        return model.transformer.h

    def embeddings(self, model):
        return model.transformer.wte

    def position_embeddings(self, model):
        return model.transformer.wpe

    def final_norm_module(self, model):
        return model.transformer.ln_f

    def attention(self, layer):
        return layer.attn

    def _qkv(self, layer):
        """q, k, v as Linear-layout [out, in] views of c_attn (Conv1D keeps [in, out]), with their biases."""
        w, b, dim = layer.attn.c_attn.weight, layer.attn.c_attn.bias, layer.attn.embed_dim
        return [(w[:, i * dim:(i + 1) * dim].t(), b[i * dim:(i + 1) * dim]) for i in range(3)]

    def layer_weights(self, layer) -> dict:
        (wq, bq), (wk, bk), (wv, bv) = self._qkv(layer)
        a, m = layer.attn, layer.mlp
        out = {"input_layernorm": layer.ln_1.weight, "input_layernorm_bias": layer.ln_1.bias,
               "post_attention_layernorm": layer.ln_2.weight, "post_attention_layernorm_bias": layer.ln_2.bias,
               "q_proj": wq, "q_proj_bias": bq, "k_proj": wk, "k_proj_bias": bk, "v_proj": wv, "v_proj_bias": bv,
               "o_proj": a.c_proj.weight.t(), "o_proj_bias": a.c_proj.bias,
               "fc": m.c_fc.weight.t(), "fc_bias": m.c_fc.bias, "proj": m.c_proj.weight.t(), "proj_bias": m.c_proj.bias}
        return {k: v.detach() for k, v in out.items()}

    def attention_linears(self, layer) -> list:
        return [("c_attn", layer.attn.c_attn), ("c_proj", layer.attn.c_proj)]

    def value_output(self, layer):
        """Views of c_attn's v part and of c_proj in Linear layout: the P_v fold writes through to them."""
        wv, bv = self._qkv(layer)[2]
        return SimpleNamespace(weight=wv, bias=bv), SimpleNamespace(weight=layer.attn.c_proj.weight.t(), bias=None)

    def tiny_config(self, *, layers: int = 2, heads: int = 4, kv_heads: int = 4, head_dim: int = 16, vocab: int = 128,
                    **extra):
        import transformers

        if kv_heads != heads:
            raise ValueError("gpt2 is multi-head attention: kv_heads must equal heads")
        kw = dict(vocab_size=vocab, n_embd=heads * head_dim, n_layer=layers, n_head=heads, n_positions=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kw.update(extra)
        return transformers.GPT2Config(**kw)
