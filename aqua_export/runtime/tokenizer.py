"""A folder's tokenizer without transformers (which imports torch, seconds of a start-up that serving does not
need): tokenizer.json through the ``tokenizers`` library, the chat template through jinja2 as transformers renders
it, the special tokens from tokenizer_config.json. It answers the calls this package makes of a Hugging Face
tokenizer (``tok(texts, ...)``, ``decode``, ``apply_chat_template``, the special token ids); tests/test_text.py
holds it to transformers' AutoTokenizer on the embedded model."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from ..config import ConfigError


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _cleanup(text: str) -> str:
    """transformers' clean_up_tokenization (for a tokenizer_config.json that asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class FolderTokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of a folder."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.backend.no_padding()
        self.backend.no_truncation()
        path = folder / "tokenizer_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else cfg.get("chat_template")
        self.bos_token, self.eos_token = _content(cfg.get("bos_token")), _content(cfg.get("eos_token"))
        self.pad_token = _content(cfg.get("pad_token")) or self.eos_token
        self.clean_up = bool(cfg.get("clean_up_tokenization_spaces", False))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    bos_token_id = property(lambda self: self._id(self.bos_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))
    pad_token_id = property(lambda self: self._id(self.pad_token))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text, add_special_tokens: bool = True, return_attention_mask: bool = True,
                 return_tensors: str | None = None, padding: bool = False, padding_side: str = "right") -> dict:
        """One text -> {"input_ids": [ids]}; a list -> lists, or with return_tensors="np" and padding [B, T] int64
        arrays padded with the pad token on ``padding_side``."""
        if isinstance(text, str):
            return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}
        rows = [e.ids for e in self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        if not padding:
            return {"input_ids": rows}
        n, pad = max(map(len, rows), default=0), self.pad_token_id
        ids = np.full((len(rows), n), pad, np.int64)
        mask = np.zeros((len(rows), n), np.int64)
        for i, r in enumerate(rows):
            at = slice(0, len(r)) if padding_side == "right" else slice(n - len(r), n)
            ids[i, at], mask[i, at] = r, 1
        out = {"input_ids": ids if return_tensors == "np" else ids.tolist()}
        if return_attention_mask:
            out["attention_mask"] = mask if return_tensors == "np" else mask.tolist()
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _cleanup(text) if self.clean_up else text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        """The template rendered as transformers renders it (a sandboxed jinja2 environment, blocks trimmed)."""
        if not self.chat_template:
            raise ConfigError("--chat needs a tokenizer with a chat template; this model has none")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ConfigError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                      ensure_ascii=ensure_ascii)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", pad_token=self.pad_token or "")
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text
