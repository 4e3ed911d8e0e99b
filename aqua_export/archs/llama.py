"""Llama (1, 2, 3.x; Llama-3.1's rotary scaling comes with HF's inv_freq) and SmolLM: the base layout."""

from . import register
from .base import Adapter


@register
class Llama(Adapter):
    model_type = "llama"
    class_name = "LlamaForCausalLM"
