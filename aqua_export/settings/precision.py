"""The prompt's arithmetic: AquaAttention's two products over a prompt (the scores q^ K^ and the probabilities times
V, for calls of 16 or more rows) in float32, or in bfloat16 with float32 sums on CPUs with AVX512_BF16
(plugins/ort/aqua_prompt.cc: vdpbf16ps, twice the float32 FMA's multiply-adds an instruction). Decode steps, the
function bodies and CPUs without AVX512_BF16 compute in float32; runtime.session.prompt_bf16_runs says which."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Mechanism, Setting

PRECISION = Setting("prompt_precision", str, "float32", "AquaAttention's products over a prompt: float32, or "
                    "bfloat16 with float32 sums where the CPU has AVX512_BF16 (float32 elsewhere)",
                    choices=("float32", "bfloat16"))


def bf16(cfg) -> bool:
    """A prompt's attention products round their operands to bfloat16 (where the CPU runs it)."""
    return cfg.prompt_precision == "bfloat16"


def _check(cfg) -> None:
    if bf16(cfg) and cfg.h2o_ratio < 1.0:
        raise ConfigError("--prompt-precision bfloat16 is a mode of the fused AquaAttention node's prompt, and "
                          "AQUA-H2O attends in its own node: drop one of --prompt-precision and --h2o-ratio")


def _attrs(cfg) -> dict:
    return {"prompt_bf16": 1} if bf16(cfg) else {}


def _name(cfg) -> list:
    return ["bf16"] if bf16(cfg) else []


_FLOAT32 = "yes, in float32 (the function body ignores prompt_bf16)"
MECHANISM = Mechanism("precision", "a prompt's attention products in bfloat16 (float32 sums) on AVX512_BF16 CPUs",
                      (PRECISION,), on=bf16, check=_check, node_attrs=_attrs, name_parts=_name,
                      approximates=False,  # it rounds the products, approximating no attention: no projection needed
                      aliases={"prompt_bf16": bf16}, features={"prompt_bf16": bf16}, neutral={"prompt_bf16": 0},
                      refusals={("prompt_bf16", "tensorrt"): "--prompt-precision bfloat16 is a mode of the fused "
                                "AquaAttention node's prompt, which has no TensorRT plugin (TensorRT picks its own "
                                "precisions): drop it there"},
                      notes={("prompt_bf16", "function"): _FLOAT32, ("prompt_bf16", "standard"): _FLOAT32,
                             ("prompt_bf16", "native"): "yes, in bfloat16 where the CPU has AVX512_BF16, else float32"})
