"""Qwen3: the Llama layout with an RMSNorm on each head's q and k (q_norm / k_norm, over head_dim) before RoPE."""

from . import register
from .base import Adapter


@register
class Qwen3(Adapter):
    model_type = "qwen3"
    class_name = "Qwen3ForCausalLM"
