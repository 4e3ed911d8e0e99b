"""Weight-only integer quantization: the one definition the export writes (ONNX Runtime's MatMulNBits, QMoE and
GatherBlockQuantized formats) and parity's reference dequantizes, so both compute with the same weights.

A weight W [N, K] (N outputs, K inputs, as nn.Linear stores it) is cut along K into blocks of ``block`` values, each
row's blocks on their own; with b bits and half = 2^(b - 1):

    symmetric   s = m / -half, m the block's value of largest magnitude (its sign kept, so m lands on -half exactly)
                q = clamp(round(w / s + half), 0, 2^b - 1)            w~ = (q - half) s     (no zero points stored)
    asymmetric  lo = min(0, min w), hi = max(0, max w), s = (hi - lo) / (2^b - 1), z = clamp(round(-lo / s))
                q = clamp(round(w / s + z), 0, 2^b - 1)               w~ = (q - z) s
    round: to nearest, halves away from zero; a block of zeros has s = 0 and w~ = 0

Stored as ONNX Runtime reads them: ``packed`` uint8 [N, K / block, block b / 8] (4-bit: two values a byte, the first in
the low nibble), ``scales`` float32 [N, K / block], ``zero_points`` uint8 [N, ceil(K / block b / 8)] packed the same
way (asymmetric only). These are the conventions of ONNX Runtime's own blockwise quantizer, so a folder's weights
equal those onnxruntime-genai's model builder writes for the same matrix (tests/test_quantize.py checks it byte for
byte).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ConfigError

if TYPE_CHECKING:
    import torch

BITS = (4, 8)
BLOCKS = (16, 32, 64, 128)
ACCURACY_LEVELS = (0, 1, 4)  # MatMulNBits' accuracy_level: 0/1 float32 activations, 4 int8 activations
# Level 4's int8 activations pay only for products of few rows: ONNX Runtime 1.32 on AVX2 + FMA without VNNI
# (MatMulNBits alone, K 576 / 1536, int4 and int8 weights) was 1.5x faster with int8 activations at 16 rows, even at
# 32-64, and 1.2x (int4) to 1.6x (int8 weights) slower from 128 rows to a prompt's 8,000. So a level-4 graph of int8
# weights multiplies a forward of at least this many new tokens a sequence (a prompt, or its chunk) with float32
# activations, and a decode step's one token a sequence with int8 ones, whatever the batch
# (blocks.Blocks.rows_choose_activations: both kernels over the same blocks). int4 weights take MatMulQ4A8 at every
# row count (WeightFormat.int8_blocks): the faster from 16 rows, 0.75-1.10x MatMulNBits at one.
FLOAT_ACTIVATION_ROWS = 64


@dataclass(frozen=True)
class WeightFormat:
    """How a folder stores its linear layers: bits 4 or 8 (MatMulNBits), or float (None: the export dtype).

    block: inputs per quantization block; symmetric: no zero points (the default, as onnxruntime-genai's builder);
    accuracy_level: ONNX Runtime's minimum accuracy of the activations in the quantized MatMuls (4: int8, the
    builder's CPU default and the fast path for a decode step, float32 from FLOAT_ACTIVATION_ROWS new tokens up;
    0: float32)."""

    bits: int | None = None
    block: int = 32
    symmetric: bool = True
    accuracy_level: int = 4

    def __post_init__(self):
        if self.bits is not None and self.bits not in BITS:
            raise ConfigError(f"weights of {self.bits} bits are not supported: use --weights int4 or int8")
        if self.block not in BLOCKS:
            raise ConfigError(f"--weight-block {self.block} is not supported: use one of {', '.join(map(str, BLOCKS))}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ConfigError(f"--accuracy-level {self.accuracy_level} is not supported: use one of "
                              f"{', '.join(map(str, ACCURACY_LEVELS))}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def int8_activations(self) -> bool:
        return self.quantized and self.accuracy_level == 4

    @property
    def int8_blocks(self) -> bool:
        """int4 weights without zero points at level 4: every product is MatMulQ4A8 (ops/matmul_q4a8.py), int8
        activation blocks on the integer units at any row count (1.8-2.8x MatMulNBits on a prompt's rows, 1.4-1.9x
        its level 4 from 16, 0.75-1.10x at one; tools/studies/activation_levels_study.py)."""
        return self.bits == 4 and self.symmetric and self.accuracy_level == 4

    @property
    def name(self) -> str:
        return f"int{self.bits}" if self.bits else "float"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> WeightFormat:
        if not isinstance(d, dict) or set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(f"weights must be an object of {[f.name for f in dataclasses.fields(cls)]}, got {d!r}")
        return cls(**d)


def check_shape(k: int, fmt: WeightFormat, what: str) -> None:
    if k % fmt.block:
        raise ConfigError(f"{what} has {k} inputs, not a multiple of the weight block {fmt.block}: choose a "
                          "--weight-block that divides it")


def _round(x: torch.Tensor) -> torch.Tensor:
    import torch  # here, not at the top: serving a folder reads WeightFormat without torch
    return torch.sign(x) * torch.floor(x.abs() + 0.5)  # halves away from zero


SLICE_ELEMENTS = 1 << 22  # weights quantized at a time: the float32 temporaries stay tens of MiB whatever W's size


def quantize(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """W [..., N, K] (any float type; computed in float32) -> (packed uint8 [..., N, K / block, block bits / 8],
    scales float32 [..., N, K / block], zero_points uint8 [..., N, ceil(K / block bits / 8)] or None).

    Quantization is by rows, so it goes SLICE_ELEMENTS weights at a time: an OLMoE layer's experts (400M weights)
    would otherwise hold several float32 copies of themselves at once."""
    import torch
    *lead, n, k = w.shape
    rows = w.reshape(-1, k)
    step = max(1, SLICE_ELEMENTS // k)
    parts = [_quantize_rows(rows[a:a + step], fmt) for a in range(0, rows.shape[0], step)]
    packed, scale, zp = (None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(3))
    return (packed.reshape(*lead, n, *packed.shape[1:]), scale.reshape(*lead, n, -1),
            None if zp is None else zp.reshape(*lead, n, -1))


def _quantize_rows(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """quantize on rows W [R, K]."""
    import torch
    r, k = w.shape
    b, top = fmt.bits, (1 << fmt.bits) - 1
    x = w.to(torch.float32).reshape(r, k // fmt.block, fmt.block)
    if fmt.symmetric:
        idx = x.abs().argmax(-1, keepdim=True)
        scale = torch.gather(x, -1, idx)[..., 0] / -(1 << (b - 1))
        zero = torch.full_like(scale, 1 << (b - 1))
    else:
        lo = torch.clamp(x.amin(-1), max=0.0)
        hi = torch.clamp(x.amax(-1), min=0.0)
        scale = (hi - lo) / top
        zero = torch.clamp(_round(-lo / torch.where(scale == 0, 1.0, scale)), 0, top)
    ratio = torch.where(scale[..., None] == 0, 0.0, x / torch.where(scale == 0, 1.0, scale)[..., None])
    q = torch.clamp(_round(ratio + zero[..., None]), 0, top).to(torch.uint8)
    zp = None if fmt.symmetric else _pack(zero.to(torch.uint8), b)
    return _pack(q, b), scale, zp


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2^bits along the last axis -> bytes, 4-bit values two to a byte (low nibble first)."""
    import torch
    if bits == 8:
        return q.contiguous()
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def _unpack(p: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    import torch
    if bits == 8:
        return p[..., :count]
    return torch.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], -1)[..., :count]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, fmt: WeightFormat,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """quantize's output -> W~ [..., N, K] in ``dtype`` ((q - z) s, computed in float32 as ONNX Runtime does, then
    widened)."""
    import torch
    *lead, n, kb, _ = packed.shape
    q = _unpack(packed, fmt.bits, fmt.block).to(torch.float32)
    z = torch.full_like(scales, 1 << (fmt.bits - 1)) if zero_points is None else \
        _unpack(zero_points, fmt.bits, kb).to(torch.float32)
    return ((q - z[..., None]) * scales[..., None]).reshape(*lead, n, kb * fmt.block).to(dtype or torch.float32)


def roundtrip(w: torch.Tensor, fmt: WeightFormat, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W -> the weights a folder of format ``fmt`` computes with (the reference's view of a quantized export)."""
    import torch

    if not fmt.quantized:
        return w.to(dtype or torch.float32)
    return dequantize(*quantize(w, fmt), fmt, dtype)
