"""Runtimes a built folder runs in, behind one protocol (``LM``):

    aqua      this project's ONNX Runtime loop (runtime.OrtLM): every variant, H2O eviction included
    genai     onnxruntime-genai (runtime/genai.py): what production apps embed (C, C++, C#, Java, Python)
    tensorrt  the folder's TensorRT engine in this project's loop (runtime/tensorrt.py; needs TensorRT)

Both take padded prompts (runtime.encode_prompts pads on the right, as genai does) and return greedy or
sampled ids; ``open_lm`` picks one by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from .. import capabilities
from ..capabilities import RUNTIMES, Features
from ..config import ConfigError
from .folder import CONFIG_FILE, FolderConfig


class LM(Protocol):
    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray, sampling, eos_token_id: int | None = None,
                 on_token=None, on_logits=None) -> np.ndarray:
        """Padded prompts [B, T] -> generated ids [B, N]; on_token(step, ids[B]) streams; on_logits(step,
        logits[B, V]) sees the logits each token was picked from."""
def open_lm(folder: str | Path, runtime: str = "aqua", threads: int = 0, kernel: str = "auto",
            share_buffer: bool = True, serving: tuple[int, int] | None = None) -> LM:
    """serving: (batch, tokens) the caller will run: checked against the memory before anything loads. A folder this
    tool built is refused in the capability table's one line when ``runtime`` (or ``kernel``) cannot run it."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown --runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    # aqua and genai check the folder where they open it (OrtLM.open: its kernel; GenaiLM: Contract.genai_io), so the
    # config is read once; a TensorRT engine is checked here
    if runtime == "tensorrt" and (Path(folder) / CONFIG_FILE).is_file():
        capabilities.check(Features.of_folder(FolderConfig.from_folder(folder)), runtime)
    if runtime == "aqua":
        from .lm import OrtLM

        return OrtLM.from_folder(folder, threads, kernel, cache="shared" if share_buffer else "concat", serving=serving)
    if runtime == "genai":
        from .genai import GenaiLM

        return GenaiLM(folder, share_buffer=share_buffer, threads=threads, serving=serving)
    from .tensorrt import engine_lm

    return engine_lm(folder)
