"""How a token is picked from the logits, shared by every host's generation loop (OrtLM, GenaiLM's checks, the
TensorRT engine's loop)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy when do_sample is False; otherwise temperature / top-k / top-p sampling from a seeded generator."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens} generates nothing: give 1 or more")
        if not self.temperature > 0:
            raise ConfigError("--temperature must be > 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k} is negative: give 0 (all tokens) or a count of tokens")

    def check_vocabulary(self, vocab: int) -> None:
        """top_k counts tokens of this vocabulary (0: all of them)."""
        if self.top_k > vocab:
            raise ConfigError(f"--top-k {self.top_k} exceeds the model's vocabulary of {vocab} tokens: give 0 (all) "
                              f"up to {vocab}")


def check_finite(logits: np.ndarray, folder) -> None:
    """Logits a token is picked from must be numbers: NaN or inf means damaged weights (a folder whose data file
    was overwritten keeps its size), or a float16 folder whose activations overflowed. Shared by every runtime."""
    if not np.isfinite(logits).all():
        raise ConfigError(f"the model in {folder or 'this folder'} computed logits that are not numbers (NaN or inf): "
                          f"its weights are damaged (see `aqua-export check {folder or 'FOLDER'}`), or a float16 "
                          "folder overflowed: rebuild the folder")


def emit(nxt: np.ndarray, done: np.ndarray, eos: int | None, step: int, out: list, on_token) -> np.ndarray:
    """One generated token per row: rows already finished repeat eos, ``done`` (updated in place) marks rows
    that produced it; the tokens are appended to ``out`` and streamed. Shared by every runtime's loop."""
    if eos is not None:
        nxt = np.where(done, eos, nxt)
        done |= nxt == eos
    out.append(nxt)
    if on_token is not None:
        on_token(step, nxt)
    return nxt


def pick(logits: np.ndarray, s: SamplingConfig, rng) -> np.ndarray:
    """logits [B, V] -> token ids [B]; greedy ties go to the lower id (np.argmax)."""
    if not s.do_sample:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / s.temperature
    if s.top_k:
        kth = np.sort(z, axis=-1)[:, -s.top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if s.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, -1)
        cut = sp.cumsum(-1) - sp > s.top_p
        sp[cut] = 0
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp, -1)
        p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])
