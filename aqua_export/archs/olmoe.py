"""OLMoE (the seed paper's second model): multi-head attention with RMSNorm over the whole q and k projections,
and a top-k routed mixture of gated-SiLU experts."""

from ..config import ConfigError
from . import register
from .base import Adapter


@register
class Olmoe(Adapter):
    model_type = "olmoe"
    class_name = "OlmoeForCausalLM"
    tiny = {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}

    def check(self, config) -> None:
        super().check(config)
        if config.clip_qkv is not None:  # a clamp on v sits between W_V and the P_v fold
            raise ConfigError(f"olmoe with clip_qkv={config.clip_qkv} is not supported: use a checkpoint without it")

    def mlp_weights(self, mlp) -> dict:
        """router [E, hidden]; experts_gate_up [E, 2 * I, hidden] (gate rows first); experts_down [E, hidden, I];
        and the routing rule: top_k experts by softmax probability, renormalised or not."""
        return {"router": mlp.gate.weight, "experts_gate_up": mlp.experts.gate_up_proj,
                "experts_down": mlp.experts.down_proj, "top_k": mlp.gate.top_k, "norm_topk_prob": mlp.gate.norm_topk_prob}
