"""The graph contract: the one owner of the exported decoder's I/O names, shapes, dtypes, dynamic axes,
cache layout and modes. Export, the runtimes (ours and onnxruntime-genai's config), the TensorRT profiles,
the benchmarks and the tests all derive from a ``Contract``; nothing else spells a name or a layout.

Per layer i, with r = widths[i] the width of its K^ and rv = value_widths[i] that of its V (equal, and equal over
the layers, unless AQUA-Memory's slicing is allocated: allocate.py), the decoder takes

    input_ids                 [batch, sequence]              int64   the new tokens
    attention_mask            [batch, total]                 int64   every token so far (0 = padding), new included
    past_key_values.{i}.key   [batch, kv_heads, past, r]     K^ buffer, memory dim-major (see below)
    past_key_values.{i}.value [batch, kv_heads, past, rv]    V buffer (P_v's basis), memory token-major
  both of cache_dtype: the graph's dtype, or float16 under a float32 graph (half the cache's bytes, what a CPU
  decode step at long context mostly reads; the new tokens are rounded to it as they are written), or int8 under
  a float32 graph (a quarter of float32's): each token's K^ column and V row then holds its values as int8 and,
  one element further, the code of its scale, a quarter power of two (ops.spec, ops.rules.int8_rows), so the buffers
  are declared r + 1 and rv + 1 wide (scale_slots) and onnxruntime-genai carries them like any other
  and H2O graphs also (The H2O state, below)
    past_key_values.{i}.heavy [batch, kv_heads, past]        float32 accumulated attention of each slot
    past_key_values.{i}.token [batch, kv_heads, past]        int64   which token a slot holds, -1 = free

and returns logits [batch, sequence, vocab] and present.{i}.<kind> for each of those buffers ([..., present, ...]).

The logits (last_logits, what the ONNX Runtime graphs do): only each sequence's last real token's row is computed
(its last position whose attention_mask is 1); the other rows are unspecified (ops/logit_rows.py: never written, so a
long prompt's [T, vocab] logits are never resident; the last layer's MLP already runs on those rows alone:
export.decoder_graph). Generation reads those rows alone, onnxruntime-genai included.
Perplexity, lm-eval and parity open the graph with its constant ``all_logits`` made an input (rewrites.all_logits;
not an initializer with a default, which ONNX Runtime's IOBinding cannot bind), fed per forward by runtime.lm.OrtLM:
1 computes every row, 0 the last rows alone (the prompt lm-eval's generate_until generates from).

The KV contract, as onnxruntime-genai drives it (docs/design.md, The KV contract):
  * total = attention_mask.shape[1] is the only length the graph needs; the new tokens go to slots
    total-sequence .. total-1 of the buffer, and positions are cumsum(attention_mask) - 1 (what HF computes
    for left padding), so no cache_position or position_ids is fed.
  * present = max(past, total) slots. A buffer already holding ``total`` slots (genai's
    past_present_share_buffer: past and present bound to one [batch, kv_heads, max_length, r] buffer) is
    written in place, O(sequence) per step; a shorter past (share_buffer false, or our concat runs) is
    copied into a present of exactly ``total`` slots.
  * The declared shape is genai's; the memory layout is ours: a key buffer of C slots holds K^ as
    [batch, kv_heads, r, C] (one contiguous row per coordinate; ``key_rows`` gives that view), so
    TopKGatherDot reads the first ``total`` values of only the k selected rows.

The H2O state (h2o.py, AQUA-H2O): the buffers are slots, not positions. A new real token takes the first
free slot and an evicted token frees its slot, inside the graph (one H2OAttention node per layer), so
slots are positions of nothing: token[b, h, slot] says which token (0-based, padding counted) a slot of
head h holds. present = max(past, h2o.slots_needed) slots, at most ceil(ratio * total) + 1; a buffer
that has them is updated in place, as above. Positions are still cumsum(attention_mask) - 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import capabilities
from .capabilities import Features
from .config import ConfigError, reject_unknown
from .ops.spec import CACHE_TYPES, CACHES, FLOAT_TYPES, FREE

# the context a folder is exported for and served at when its model names no length (max_position_embeddings)
DEFAULT_CONTEXT = 4096

# 7: token selection's pages count from the first slot a step sees (ops.rules.page_origin); 6: an int8 cache's scales
# in quarter powers of two; 5: AquaAttention reads attention_mask, last_logits; 4: K^, V
# widths and k per layer
CONTRACT_VERSION = 7
DTYPES = FLOAT_TYPES


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: shape entries are ints or dynamic-axis names."""

    name: str
    dtype: str  # float32 | float16 | int64 | bool
    shape: tuple


@dataclass(frozen=True)
class Contract:
    """What a built decoder graph takes and returns (module docstring)."""

    layers: int
    kv_heads: int
    widths: tuple  # r per layer: cached coordinates of K^ per head
    selected: tuple  # k per layer: coordinates that score each query
    value_widths: tuple  # rv per layer: cached coordinates of V per head
    vocab: int
    dtype: str = "float32"
    h2o: bool = False
    version: int = CONTRACT_VERSION
    cache_dtype: str | None = None  # the K^ / V buffers' float type; None (folders written before it): dtype
    prices: tuple | None = None  # per layer [kv_heads] floats: its heads share its k per token (allocate.head_prices)
    last_logits: bool = False  # the logits of each sequence's last token only (module docstring)

    def __post_init__(self):
        def positive(name, v):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"contract.{name} must be a positive integer, got {v!r}")

        for f in ("layers", "kv_heads", "vocab"):
            positive(f, getattr(self, f))
        for f in ("widths", "selected", "value_widths"):
            v = getattr(self, f)
            if not isinstance(v, (list, tuple)) or len(v) != self.layers:
                raise ConfigError(f"contract.{f} must list one integer per layer ({self.layers}), got {v!r}")
            object.__setattr__(self, f, tuple(v))
            for x in v:
                positive(f, x)
        for i, (r, k) in enumerate(zip(self.widths, self.selected)):
            if k > r:
                raise ConfigError(f"contract.selected {k} exceeds contract.widths {r} at layer {i}")
        if self.prices is not None:
            object.__setattr__(self, "prices", self._checked_prices(self.prices))
        if self.dtype not in DTYPES:
            raise ConfigError(f"contract.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cache_dtype is None:
            object.__setattr__(self, "cache_dtype", self.dtype)
        self.check_cache_dtype(self.dtype, self.cache_dtype, self.h2o)
        for flag in ("h2o", "last_logits"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"contract.{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.version != CONTRACT_VERSION:
            raise ConfigError(f"graph contract version {self.version} is not this tool's ({CONTRACT_VERSION})")

    def _checked_prices(self, prices) -> tuple:
        """contract.prices as a tuple of tuples: one positive finite price per KV head and layer, no H2O."""
        ok = isinstance(prices, (list, tuple)) and len(prices) == self.layers and all(
            isinstance(row, (list, tuple)) and len(row) == self.kv_heads and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in row)
            for row in prices)
        if not ok:
            raise ConfigError(f"contract.prices must list {self.kv_heads} positive prices per layer ({self.layers}), "
                              f"got {prices!r}")
        if self.h2o:
            raise ConfigError("contract.prices: AQUA-H2O's node takes one k per row (no shared k)")
        return tuple(tuple(float(x) for x in row) for row in prices)

    def head_prices(self, i: int) -> list | None:
        """Layer i's AquaAttention head_prices attribute (every node of a shared-k graph carries one: the graph has
        one body), or None."""
        return None if self.prices is None else list(self.prices[i])

    @staticmethod
    def check_cache_dtype(dtype: str, cache_dtype: str, h2o: bool) -> None:
        """One ConfigError line for a cache type the graph cannot have: its own dtype, or float16 / int8 under float32
        (not for AQUA-H2O, whose node keeps its slot buffers in the graph's dtype)."""
        if cache_dtype not in CACHES:
            raise ConfigError(f"contract.cache_dtype must be one of {CACHE_TYPES}, got {cache_dtype!r}")
        line = CACHES[cache_dtype].refusal(dtype, h2o)
        if line:
            raise ConfigError(line)

    # ---------------------------------------------------------------- names
    INPUT_IDS = "input_ids"
    ATTENTION_MASK = "attention_mask"
    ALL_LOGITS = "all_logits"  # a last_logits graph's constant [1] int64: 1 computes every row
    LOGITS = "logits"
    PAST = "past_key_values.%d.%s"
    PRESENT = "present.%d.%s"
    KV = ("key", "value")
    H2O_STATE = ("heavy", "token")
    FREE = FREE  # token of a free slot (ops.spec)

    def past(self, i: int, kind: str) -> str:
        return self.PAST % (i, kind)

    def present(self, i: int, kind: str) -> str:
        return self.PRESENT % (i, kind)

    @property
    def kinds(self) -> tuple:
        """The buffers each layer carries between forwards, in I/O order."""
        return self.KV + (self.H2O_STATE if self.h2o else ())

    @property
    def scale_slots(self) -> int:
        """What a token's K^ column / V row carries beyond its width: an int8 cache's scale code (ops.spec)."""
        return CACHES[self.cache_dtype].scale_slots

    @property
    def narrow_cache(self) -> bool:
        """The cache narrower than the graph (float16 or int8 under float32)."""
        return CACHES[self.cache_dtype].narrow(self.dtype)

    @property
    def uniform(self) -> bool:
        """Every layer caches K^ and V at one width (what onnxruntime-genai's single head_size describes)."""
        return len(set(self.widths) | set(self.value_widths)) == 1

    # ---------------------------------------------------------------- I/O
    def _buffer_spec(self, name: str, kind: str, slots: str, layer: int) -> TensorSpec:
        dtype = {"heavy": "float32", "token": "int64"}.get(kind, self.cache_dtype)
        width = {"key": self.widths, "value": self.value_widths}.get(kind)
        shape = ("batch", self.kv_heads, slots) + ((width[layer] + self.scale_slots,) if width else ())
        return TensorSpec(name, dtype, shape)

    def inputs(self) -> list[TensorSpec]:
        out = [TensorSpec(self.INPUT_IDS, "int64", ("batch", "sequence")),
               TensorSpec(self.ATTENTION_MASK, "int64", ("batch", "total"))]
        for i in range(self.layers):
            out += [self._buffer_spec(self.past(i, k), k, "past", i) for k in self.kinds]
        return out

    def outputs(self) -> list[TensorSpec]:
        out = [TensorSpec(self.LOGITS, self.dtype, ("batch", "sequence", self.vocab))]
        for i in range(self.layers):
            out += [self._buffer_spec(self.present(i, k), k, "present", i) for k in self.kinds]
        return out

    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs()]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs()]

    def feed_shapes(self, batch: int, new: int, past: int) -> dict[str, tuple]:
        """Concrete input shapes of one forward (a concat past of ``past`` slots): TensorRT profiles, tests."""
        sizes = {"batch": batch, "sequence": new, "past": past, "total": past + new}
        return {t.name: tuple(sizes.get(d, d) for d in t.shape) for t in self.inputs()}

    # ---------------------------------------------------------------- the cache
    def cache_bytes(self, batch: int, slots: int) -> int:
        """Bytes of every layer's buffers for ``batch`` sequences of ``slots`` slots each."""
        elem, extra = np.dtype(self.cache_dtype).itemsize, 2 * self.scale_slots
        per_slot = sum(w + rv + extra for w, rv in zip(self.widths, self.value_widths)) * elem
        if self.h2o:
            per_slot += self.layers * (4 + 8)  # heavy (float32) and token (int64) per slot
        return batch * self.kv_heads * slots * per_slot

    def empty_buffer(self, kind: str, batch: int, slots: int, layer: int, allocate=np.empty, zeroed: bool = False):
        """A fresh buffer of ``kind`` for ``layer`` (numpy, from allocate(shape, dtype)): zeros, a token buffer all
        free. zeroed: allocate gives zeros already (the pages then stay untouched until written)."""
        spec = self._buffer_spec("", kind, slots, layer)
        out = allocate(tuple(batch if d == "batch" else d for d in spec.shape), np.dtype(spec.dtype))
        if kind == "token" or not zeroed:
            out[...] = self.FREE if kind == "token" else 0
        return out

    @staticmethod
    def key_rows(buf):
        """A key buffer [B, Hkv, C, r] (numpy) -> its K^ view [B, Hkv, r, C] (no copy)."""
        b, h, c, r = buf.shape
        return buf.reshape(b, h, r, c)

    @staticmethod
    def key_buffer(rows):
        """K^ [B, Hkv, r, C] -> the key buffer [B, Hkv, C, r] holding it (a contiguous copy if needed)."""
        b, h, r, c = rows.shape
        return np.ascontiguousarray(rows).reshape(b, h, c, r)

    def layout(self) -> dict[str, str]:
        """Each buffer kind's layout in words (aqua_config.json's info.layout), from this contract's specs."""
        def declared(kind: str) -> str:
            spec = self._buffer_spec("", kind, "slots", 0)
            width = {"key": self.widths, "value": self.value_widths}.get(kind)
            extra = f" + {self.scale_slots}" if self.scale_slots else ""
            dims = [str(d) for d in spec.shape[:3]] + ([("r" if len(set(width)) > 1 else str(width[0])) + extra]
                                                       if width else [])
            return f"[{', '.join(dims)}] {spec.dtype}"

        out = {"key": f"declared {declared('key')}; memory K^ = RoPE(k) @ P[:, :r] dim-major [batch, kv_heads, r, "
                      "slots]: selecting coordinate c reads one contiguous row, so the attention node reads k/r of "
                      "the K cache",
               "value": f"{declared('value')} in P_v's basis (folded into W_V / W_O)",
               "update": "new tokens at slots total-sequence..total-1; a buffer shared by past and present "
                         "(onnxruntime-genai's past_present_share_buffer, `aqua-export run`) is written in place"}
        if self.scale_slots:
            out["int8"] = ("each token's K^ column and V row: round(x / 2^(c/4)) as int8, then c (its scale's code, "
                           "the smallest quarter power of two >= max |x| / 127): K^'s codes one more dim-major row, "
                           "V's one more column (ops.rules.int8_rows)")
        if self.h2o:
            out["heavy"] = f"{declared('heavy')}: the attention each slot has accumulated"
            out["token"] = f"{declared('token')}: which token a slot holds, {self.FREE} = free"
        return out

    # ---------------------------------------------------------------- onnxruntime-genai
    def genai_io(self) -> tuple[dict, dict]:
        """The decoder's "inputs" / "outputs" sections of genai_config.json (name templates)."""
        capabilities.check(Features.of_contract(self), "genai")
        def template(pattern, kind):
            return pattern.replace("%s", kind)  # genai fills %d with the layer

        return ({"input_ids": self.INPUT_IDS, "attention_mask": self.ATTENTION_MASK,
                 "past_key_names": template(self.PAST, "key"), "past_value_names": template(self.PAST, "value")},
                {"logits": self.LOGITS, "present_key_names": template(self.PRESENT, "key"),
                 "present_value_names": template(self.PRESENT, "value")})

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data) -> "Contract":
        if not isinstance(data, dict):
            raise ConfigError("contract must be a JSON object")
        reject_unknown(cls, data, "contract ")
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"contract: {e}") from None
