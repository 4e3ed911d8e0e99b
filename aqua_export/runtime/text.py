"""Text in and out of a folder: its tokenizer, prompts encoded for the graph, generated text streamed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import ConfigError


def write_tokenizer(tok, folder: Path) -> None:
    """The tokenizer's files in a folder, readable by the transformers versions other ONNX tools pin (optimum-onnx:
    transformers < 4.58) as well as this one: transformers 5 names its tokenizer class TokenizersBackend, which
    older versions do not have, so the files name the fast tokenizer class both know, its input names (no
    token_type_ids) and the chat template inline as well as in chat_template.jinja."""
    import json

    tok.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("model_input_names", list(tok.model_input_names))
    template = Path(folder) / "chat_template.jinja"
    if template.is_file():
        cfg.setdefault("chat_template", template.read_text())
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer (runtime.tokenizer: no transformers, no torch), or one line naming the fix."""
    from .tokenizer import FolderTokenizer

    try:
        tok = FolderTokenizer(folder)
    except Exception as e:  # tokenizers raises its own exception types for a damaged or missing file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"the tokenizer in {folder} cannot be loaded ({type(e).__name__}: {first}): rebuild the "
                          "folder") from None
    if tok.pad_token_id is None:
        raise ConfigError(f"the tokenizer in {folder} has neither a pad nor an end-of-sequence token (its "
                          "tokenizer_config.json was edited?): rebuild the folder")
    return tok


def encode_prompts(tok, prompts: list[str], chat: bool = False, context: int | None = None,
                   max_new_tokens: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids and mask, the batch layout onnxruntime-genai uses (so both runtimes compute the same
    arithmetic; the graph takes positions from the mask, so either side works). Refused before anything is
    allocated: an empty prompt (without --chat), one that is not UTF-8 text, one that cannot fit the model's context
    with the tokens to generate."""
    if not chat and any(not p for p in prompts):
        raise ConfigError("--prompt is empty: give some text (or --chat, which wraps it in the chat template)")
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:  # the shell passed bytes that are not UTF-8 (Python keeps them as surrogates)
            raise ConfigError(f"--prompt is not UTF-8 text (an undecodable byte at character {e.start}): give it in "
                              "UTF-8") from None
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError("--chat needs a tokenizer with a chat template; this model has none")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    enc = tok(prompts, return_tensors="np", padding=True, padding_side="right")
    ids = enc["input_ids"].astype(np.int64)
    if ids.shape[1] == 0:
        raise ConfigError("--prompt encodes to no tokens: give some text")
    if context is not None and ids.shape[1] + max_new_tokens > context:
        raise ConfigError(f"the prompt is {ids.shape[1]} tokens and {max_new_tokens} more are asked, past the model's "
                          f"context of {context}: shorten the prompt or lower --max-new-tokens")
    return ids, enc["attention_mask"].astype(np.int64)


class TextStream:
    """One sequence's generated tokens printed as they come (``stream(step, ids)``; ``close()`` at the end). A
    token may end inside a character: byte-level tokenizers split emoji and CJK characters into byte pieces, and
    decoding a prefix that stops mid-character gives U+FFFD. Such text is held back until the character is whole,
    so the printed text equals the decoded generation (whenever decoding is prefix-stable, as byte-level BPE is)."""

    def __init__(self, tok, out):
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def __call__(self, step: int, nxt: np.ndarray) -> None:
        self.ids.append(int(nxt[0]))
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._show(text)

    def close(self) -> None:
        self._show(self.tok.decode(self.ids, skip_special_tokens=True))  # whatever is left, a cut character too

    def _show(self, text: str) -> None:
        # a later token can change how earlier ones decode (a tokenizer's clean-up of spaces): print from the
        # first character that differs from what is shown (what was printed before that stays printed)
        common = len(os.path.commonprefix([text, self.shown]))
        self.out.write(text[common:])
        self.out.flush()
        self.shown = text
