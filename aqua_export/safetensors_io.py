"""A deterministic safetensors writer (sorted header keys, fixed tensor order) and an atomic write.

safetensors' own writer serialises metadata from a hash map, so two runs over the same inputs can
differ in header byte order; the calibration artifact must be byte-identical run to run.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.int64: "I64"}


def check_writable_parent(out: Path) -> None:
    """Fail before any work if files cannot be created next to ``out`` (one line naming the fix)."""
    from .config import ConfigError

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise ConfigError(f"--out {out} is not writable ({e.strerror}): choose another path") from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dumps(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": {k: str(v) for k, v in sorted(metadata.items())}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        b = t.numpy().tobytes()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + b"".join(blobs)


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    atomic_write_bytes(Path(path), dumps(tensors, metadata))
