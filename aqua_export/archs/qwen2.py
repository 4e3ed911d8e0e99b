"""Qwen2 / Qwen2.5: the Llama layout with biases on q, k and v (sliding layers when the config asks)."""

from . import register
from .base import Adapter


@register
class Qwen2(Adapter):
    model_type = "qwen2"
    class_name = "Qwen2ForCausalLM"
