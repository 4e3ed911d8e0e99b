"""Mistral: the Llama layout with a sliding attention window on every layer (config.sliding_window)."""

from . import register
from .base import Adapter


@register
class Mistral(Adapter):
    model_type = "mistral"
    class_name = "MistralForCausalLM"
    tiny = {"sliding_window": 8}  # shorter than the test prompts, so the window really cuts
