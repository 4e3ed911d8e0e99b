"""The adapter protocol, with the Llama layout as its defaults (most families differ in one or two places)."""

from __future__ import annotations

import torch

from ..config import ConfigError


class Adapter:
    """One decoder family.

    model_type / class_name: HF's names. has_rotary: positions enter through a rotary embedding (P is applied
    after it); without one P folds into W_Q / W_K. tiny: config overrides that make the tiny random test
    model exercise what is particular to the family (a sliding window, q/k norms, ...).
    """

    model_type: str = ""
    class_name: str = ""
    config_class: str = ""  # HF config class, when it is not class_name's "...Config"
    has_rotary: bool = True
    tiny: dict = {}

    # ------------------------------------------------------------------ what the model is
    def check(self, config) -> None:
        """Refuse, in one line, a configuration of this family that the export does not represent."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{self.model_type} with hidden_act={act!r} is not supported (gated SiLU MLPs only)")
        params = getattr(config, "rope_parameters", None) or {}
        for rp in (params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]):
            if (rp or {}).get("rope_type") in ("dynamic", "longrope"):
                raise ConfigError(f"{self.model_type} with rope_type {rp['rope_type']!r} is not supported: its rotary "
                                  "frequencies change with the sequence length at run time, which one exported graph "
                                  "does not represent")

    def check_settings(self, config, aqua) -> None:
        """Refuse, in one line, AQUA settings (config.AquaConfig) this model cannot take: the one check that the
        reference (apply_aqua) and the export (check_exportable) both make."""
        if aqua.evicts and any(self.window(config, i) for i in range(config.num_hidden_layers)):
            raise ConfigError(f"AQUA-H2O with {self.model_type}'s sliding-window layers is not supported (a window and "
                              "an eviction budget over the same slots disagree on what is kept): drop --h2o-ratio")

    # what the graph computes beyond the Llama layout (None / defaults: nothing)
    mlp_act = "silu"  # activation of the gated MLP: "silu" or "gelu_tanh"

    def attn_softcap(self, config) -> float | None:
        """scores -> tanh(scores / c) * c before the mask (Gemma 2), or None."""
        return None

    def final_softcap(self, config) -> float | None:
        """logits -> tanh(logits / c) * c (Gemma 2), or None."""
        return None

    def rotary(self, model, layer_idx: int):
        """(inv_freq [rotary_dim / 2], attention_scaling) of the layer's rotary embedding, as HF computes them
        (Llama-3.1 and YaRN scaling included)."""
        rot = self.decoder(model).rotary_emb
        return rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0))

    def window(self, config, layer_idx: int) -> int | None:
        """The layer's sliding attention window in tokens (keys j > i - window are visible to query i), or None."""
        types = getattr(config, "layer_types", None)
        w = getattr(config, "sliding_window", None)
        if types:
            return w if types[layer_idx] == "sliding_attention" else None
        return w

    # ------------------------------------------------------------------ where things are in the HF model
    def decoder(self, model):
        """The model without its LM head (what calibration runs: it never needs the vocabulary's logits)."""
        return model.model

    def layers(self, model):
        return self.decoder(model).layers

    def embeddings(self, model):
        return self.decoder(model).embed_tokens

    def position_embeddings(self, model):
        """A learned position-embedding table (absolute positions), or None (rotary families)."""
        return None

    def final_norm_module(self, model):
        return self.decoder(model).norm

    norm_eps_attr = "rms_norm_eps"

    # ------------------------------------------------------------------ weights by role
    def attention(self, layer):
        return layer.self_attn

    def layer_weights(self, layer) -> dict[str, torch.Tensor | None]:
        """A decoder layer's tensors by role: input_layernorm, post_attention_layernorm, q/k/v/o_proj (+ _bias),
        q_norm / k_norm (RMSNorm weights: [d] per head, or [heads * d] over the whole projection), and the MLP
        (mlp_weights)."""
        a = self.attention(layer)
        w = {"input_layernorm": layer.input_layernorm.weight, "post_attention_layernorm": layer.post_attention_layernorm.weight,
             **self.mlp_weights(layer.mlp)}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(a, name)
            w[name] = lin.weight
            w[f"{name}_bias"] = lin.bias
        for name in ("q_norm", "k_norm"):
            if getattr(a, name, None) is not None:
                w[name] = getattr(a, name).weight
        return {k: (v.detach() if hasattr(v, "detach") else v) for k, v in w.items()}

    def mlp_weights(self, mlp) -> dict:
        """Gated MLP: gate_proj, up_proj, down_proj [out, in]."""
        return {"gate_proj": mlp.gate_proj.weight, "up_proj": mlp.up_proj.weight, "down_proj": mlp.down_proj.weight}

    def final_norm(self, model):
        """(weight, bias) of the final norm (bias None for RMSNorm)."""
        n = self.final_norm_module(model)
        return n.weight.detach(), (None if getattr(n, "bias", None) is None else n.bias.detach())

    def attention_linears(self, layer) -> list:
        """(name, nn.Linear) of the attention projections, in a fixed order (the model fingerprint hashes them)."""
        a = self.attention(layer)
        return [(n, getattr(a, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]

    def value_output(self, layer):
        """(v_proj, o_proj) Linear modules, which the reference folds P_v into for AQUA-Memory."""
        a = self.attention(layer)
        return a.v_proj, a.o_proj

    # ------------------------------------------------------------------ tests
    def tiny_config(self, *, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, vocab: int = 128,
                    **extra):
        """A small random config of this family, built in code (no hub)."""
        import transformers

        cfg_cls = getattr(transformers, self.config_class or self.class_name.replace("ForCausalLM", "Config"))
        kw = dict(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
        kw.update(self.tiny)
        kw.update(extra)
        return cfg_cls(**kw)
