"""Text sources for calibration and evaluation, all available offline.

A source is a path to a plain-text or JSONL file (JSONL: each line an object with a "text" field),
or ``builtin:NAME`` for texts every fresh machine of ours has:

- ``builtin:python-reference``: the Python language/library reference prose shipped in CPython's
  ``pydoc_data.topics`` (~465k characters of English technical text).
- ``builtin:gpl-3``: the GNU GPL v3 text from Debian's ``base-files`` (/usr/share/common-licenses).
- ``builtin:licenses``: every other licence of Debian's ``base-files`` in one text, longest first (~29k tokens of
  SmolLM2: the long windows, 2k-8k tokens, that token selection is measured on; GPL-3 left out, it is the
  512-token evaluation text).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .config import ConfigError

BUILTIN = ("python-reference", "gpl-3", "licenses")
LICENSES = Path("/usr/share/common-licenses")


def _builtin_text(name: str) -> str:
    if name == "python-reference":
        import pydoc_data.topics as topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    if name == "gpl-3":
        p = Path("/usr/share/common-licenses/GPL-3")
        if not p.exists():
            raise ConfigError("builtin:gpl-3 needs /usr/share/common-licenses/GPL-3 (Debian base-files)")
        return p.read_text(encoding="utf-8")
    if name == "licenses":
        files = [f for f in LICENSES.glob("*") if f.is_file() and not f.is_symlink() and f.name != "GPL-3"]
        if not files:
            raise ConfigError(f"builtin:licenses needs {LICENSES} (Debian base-files)")
        files.sort(key=lambda f: (-f.stat().st_size, f.name))
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    raise ConfigError(f"unknown builtin text {name!r}: use one of {', '.join('builtin:' + b for b in BUILTIN)}")


def read_text(source: str) -> str:
    """The text of one source, whitespace kept as it is."""
    if source.startswith("builtin:"):
        return _builtin_text(source.split(":", 1)[1])
    p = Path(source)
    if p.is_dir():
        raise ConfigError(f"{source} is a folder: give a text file (plain text or JSONL) or builtin:NAME")
    if not p.is_file():
        raise ConfigError(f"text file {source} does not exist")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"text file {source} is not UTF-8 text") from None
    if "\x00" in raw:
        raise ConfigError(f"text file {source} holds NUL bytes: it is binary data, not text")
    if p.suffix == ".jsonl":
        parts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{source}:{n} is not a JSON object: JSONL lines need a \"text\" field") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ConfigError(f"{source}:{n} has no string \"text\" field")
            parts.append(obj["text"])
        return "\n\n".join(parts)
    return raw


def read_texts(sources: list[str]) -> str:
    return "\n\n".join(read_text(s) for s in sources)


def describe(sources: list[str]) -> str:
    return ",".join(s if s.startswith("builtin:") else Path(s).name for s in sources)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenize(tok, text: str, max_tokens: int | None = None):
    """Token ids [N] (int64) of the text, no special tokens added."""
    import torch

    ids = tok(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if max_tokens is not None:
        if len(ids) < max_tokens:
            import sys

            # not an error (a short file is a choice), but results on it mean less than the user asked for
            print(f"aqua-export: warning: the text has {len(ids)} tokens, fewer than the {max_tokens} asked: "
                  "results cover those only", file=sys.stderr)
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def windows(ids, seq_len: int) -> list:
    """Non-overlapping windows of ``seq_len`` tokens; a last, shorter window is kept if it has >= 2."""
    if seq_len < 2:
        raise ConfigError("--seq-len must be at least 2")
    ws = [ids[i:i + seq_len] for i in range(0, ids.numel(), seq_len)]
    return [w for w in ws if w.numel() >= 2]
