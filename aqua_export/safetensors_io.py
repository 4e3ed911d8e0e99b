"""A deterministic safetensors writer (sorted header keys, fixed tensor order), written atomically.

safetensors' own writer serialises metadata from a hash map, so two runs over the same inputs can
differ in header byte order; the calibration artifact must be byte-identical run to run.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from .outputs import atomic_write_bytes

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.int64: "I64"}


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
