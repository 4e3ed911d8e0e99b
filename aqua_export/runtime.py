"""ONNX Runtime inference from a built folder: sessions, the generation loop, streaming.

onnxruntime is imported here and only here (plus parity), when a session is made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ConfigError

CONFIG_FILE = "aqua_config.json"


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
        if self.max_new_tokens < 0:
            raise ConfigError("--max-new-tokens must be >= 0")
        if not self.temperature > 0:
            raise ConfigError("--temperature must be > 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")


def read_config(folder: str | Path) -> dict:
    folder = Path(folder)
    f = folder / CONFIG_FILE
    if not f.is_file():
        raise ConfigError(f"{folder} is not an aqua-export folder (no {CONFIG_FILE}): build one with `aqua-export --model ...`")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError:
        raise ConfigError(f"{f} is corrupt (not JSON): rebuild the folder") from None


def providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


def make_session(model: str | Path | bytes, threads: int = 0):
    """An ORT session (CUDA when onnxruntime-gpu and a GPU are present, else CPU)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, sess_options=so, providers=providers())


class OrtLM:
    """A causal LM served by ONNX Runtime with the folder's KV-cache contract."""

    def __init__(self, session, cfg: dict):
        self.session, self.cfg = session, cfg
        self.layers = cfg["geometry"]["layers"]
        self.kv_heads = cfg["geometry"]["kv_heads"]
        self.r = cfg["cache"]["width"]
        self.dtype = np.float16 if cfg["dtype"] == "float16" else np.float32

    @classmethod
    def from_folder(cls, folder: str | Path, threads: int = 0) -> "OrtLM":
        cfg = read_config(folder)
        path = Path(folder) / "model.onnx"
        if not path.is_file():
            raise ConfigError(f"{folder} has no model.onnx: rebuild the folder")
        return cls(make_session(path, threads), cfg)

    def empty_past(self, batch: int) -> list[np.ndarray]:
        out = []
        for _ in range(self.layers):
            out += [np.zeros((batch, self.kv_heads, self.r, 0), self.dtype), np.zeros((batch, self.kv_heads, 0, self.r), self.dtype)]
        return out

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward. input_ids/position_ids [B, T], attention_mask [B, P+T]; past as from empty_past."""
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64),
                "position_ids": position_ids.astype(np.int64)}
        for i in range(self.layers):
            feed[f"past_key_values.{i}.key"] = past[2 * i]
            feed[f"past_key_values.{i}.value"] = past[2 * i + 1]
        out = self.session.run(None, feed)
        return out[0], out[1:]

    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray, sampling: SamplingConfig,
                 eos_token_id: int | None = None, on_token=None, on_logits=None) -> np.ndarray:
        """Left-padded prompts [B, T] -> generated ids [B, N]. on_token(step, ids[B]) streams; on_logits(step,
        logits[B, T, V]) sees every forward's logits (step 0 = prefill)."""
        rng = np.random.default_rng(sampling.seed)
        b = input_ids.shape[0]
        mask = attention_mask.astype(np.int64)
        pos = np.clip(mask.cumsum(-1) - 1, 0, None)
        logits, past = self.step(input_ids, mask, pos, self.empty_past(b))
        done = np.zeros(b, dtype=bool)
        out = []
        last_pos = pos[:, -1:]
        for step in range(sampling.max_new_tokens):
            if on_logits is not None:
                on_logits(step, logits)
            nxt = pick(logits[:, -1, :], sampling, rng)
            if eos_token_id is not None:
                nxt = np.where(done, eos_token_id, nxt)
                done |= nxt == eos_token_id
            out.append(nxt)
            if on_token is not None:
                on_token(step, nxt)
            if done.all() or step == sampling.max_new_tokens - 1:
                break
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
            last_pos = last_pos + 1
            logits, past = self.step(nxt[:, None], mask, last_pos, past)
        return np.stack(out, axis=1) if out else np.zeros((b, 0), np.int64)


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


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_prompts(tok, prompts: list[str], chat: bool = False) -> tuple[np.ndarray, np.ndarray]:
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError("--chat needs a tokenizer with a chat template; this model has none")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    enc = tok(prompts, return_tensors="np", padding=True, padding_side="left")
    return enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)
