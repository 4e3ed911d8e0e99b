"""The caches the ONNX Runtime loop keeps between forwards, each owning its layout and how it grows.

    SharedCache   one buffer per layer and kind, bound as both past and present (written in place by the
                  graph); the capacity grows in steps, the graph reads only what it needs
    H2OCache      the same buffers plus AQUA-H2O's state (heavy, token): the graph evicts inside; the cache
                  only sizes the slots (ops.counts.slots_needed) and reads which tokens are live
    (concat)      a plain list of every layer's buffers, replaced by each forward's presents

The layouts are contract.Contract's: per layer the kinds Contract.kinds, key / value declared [B, Hkv, slots, r]
(a key buffer's memory K^ dim-major), heavy / token [B, Hkv, slots].
"""

from __future__ import annotations

import mmap

import numpy as np

from ..contract import Contract
from ..ops.counts import slots_needed


HUGE = 2 << 20  # a transparent huge page (x86-64, most Arm64 kernels)


def large_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros; at least a huge page of them as large_empty's anonymous mapping, which the kernel backs with zero pages
    only once written: a fixed-capacity buffer (RowCache) takes memory as its slots fill, not all at once."""
    dtype = np.dtype(dtype)
    if int(np.prod(shape)) * dtype.itemsize < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, dtype)
    return large_empty(shape, dtype)  # an anonymous mapping reads as zeros


def large_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array; one of at least a huge page in memory the kernel is asked to back with huge pages
    (madvise(MADV_HUGEPAGE), Linux with transparent huge pages in "madvise" mode, Debian's default). Token selection
    reads one 64-byte line per K^ row and chosen page, each row's lines a whole cache row apart: with 4 KiB pages
    nearly every line is a TLB miss too. Elsewhere (no THP, no madvise) a plain array."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    if n < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    region = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: ordinary pages
        pass
    raw = np.frombuffer(region, np.uint8)  # keeps the mapping alive as long as the array
    start = -raw.ctypes.data % HUGE
    return raw[start:start + n].view(dtype).reshape(shape)


class SharedCache:
    """Buffers shared by a graph's past and present, as OrtValues (contract.Contract, The KV contract).

    arrays[kind][i]: layer i's buffer of that kind, C slots; ``length`` tokens have been seen (the slots a
    dense cache has filled). C grows in steps of GROW slots (one copy each time); the graph reads only the
    filled slots, so a larger C costs memory, not time.
    """

    GROW = 256

    def __init__(self, batch: int, contract: Contract, dtype):
        self.batch, self.contract, self.dtype = batch, contract, dtype
        self.capacity = self.length = 0
        self.arrays: dict[str, list[np.ndarray]] = {k: [] for k in contract.kinds}
        self.ort: dict[str, list] = {k: [] for k in contract.kinds}  # OrtValues over the arrays (no copy)

    key_arrays = property(lambda self: self.arrays["key"])
    value_arrays = property(lambda self: self.arrays["value"])

    def slots_for(self, attention_mask: np.ndarray) -> int:
        """Slots the next forward needs; attention_mask [B, total] covers every token seen, the new ones last."""
        return attention_mask.shape[1]

    def reserve(self, needed: int) -> None:
        import onnxruntime as ort

        if needed <= self.capacity:
            return
        cap = -(-needed // self.GROW) * self.GROW
        self.ort = {k: [] for k in self.arrays}  # its OrtValues hold the old buffers
        regrow(self.contract, self.arrays, self.batch, cap, large_empty)
        self.ort = {k: [ort.OrtValue.ortvalue_from_numpy(a) for a in v] for k, v in self.arrays.items()}
        self.capacity = cap

    def bind(self, io) -> None:
        """Every buffer as past and present of an IOBinding."""
        ct = self.contract
        for i in range(ct.layers):
            for kind in ct.kinds:
                io.bind_ortvalue_input(ct.past(i, kind), self.ort[kind][i])
                io.bind_ortvalue_output(ct.present(i, kind), self.ort[kind][i])

    def after(self, new_tokens: int) -> None:
        """The graph has run on ``new_tokens`` more tokens."""
        self.length += new_tokens

    def tensors(self) -> list[np.ndarray]:
        """[key_0, value_0, ...] as a concat present of ``length`` slots (copies; for inspection and tests)."""
        ct, out = self.contract, []
        for k, v in zip(self.key_arrays, self.value_arrays):
            out += [ct.key_buffer(ct.key_rows(k)[..., : self.length]), v[:, :, : self.length].copy()]
        return out


class H2OCache(SharedCache):
    """AQUA-H2O's slots (contract.Contract, The H2O state): the graph writes, scores and evicts in place.

    ratio: the share of real tokens kept (the slots a forward needs: counts.slots_needed).
    """

    def __init__(self, batch: int, contract: Contract, dtype, ratio: float):
        super().__init__(batch, contract, dtype)
        self.ratio = ratio

    def slots_for(self, attention_mask: np.ndarray) -> int:
        return slots_needed(self.ratio, (attention_mask != 0).sum(1))

    def live(self, i: int) -> np.ndarray:
        """Layer i's live tokens [B, Hkv, length] (bool, by token index)."""
        tok = self.arrays["token"][i]
        out = np.zeros(tok.shape[:2] + (self.length + 1,), bool)  # the last column takes the free slots' -1
        np.put_along_axis(out, np.where(tok >= 0, tok, self.length), True, axis=-1)
        return out[..., : self.length]


class RowCache:
    """Continuous batching's buffers (serving.engine): up to ``rows`` sequences of up to ``capacity`` slots, past and
    present of a forward over the first n rows (numpy views: the batch axis is outermost, so rows 0..n-1 are one
    contiguous block; the live sequences are kept packed there).

    Memory is taken as the sequences come and grow, not reserved at the limits: the buffers hold ``held`` rows of
    ``slots`` slots, regrown (one copy of what they hold) when a forward needs more rows or slots, each time by at
    least half the rows and a quarter of the slots (and GROW), up to the limits. A mapping of zero pages reserved at the limits would not do
    it: a K^ buffer is dim-major (a row's slots of one coordinate are contiguous), so writing one token touches a
    page per coordinate, and a huge page per 2 MiB of them.

    Every row's tokens sit right-aligned at slots [start, total), the same ``total`` for all (the contract writes a
    forward's new tokens at total - sequence .. total - 1 of every row); slots before a row's start are masked out
    (attention_mask 0), and positions come from the mask and token selection's pages from the first visible slot
    (ops.rules.page_origin), so where a row starts changes nothing it computes."""

    GROW = SharedCache.GROW

    def __init__(self, contract: Contract, rows: int, capacity: int):
        self.contract, self.rows, self.capacity = contract, rows, capacity
        self.held = self.slots = self.regrown = 0
        self.arrays: dict[str, list[np.ndarray]] = {k: [] for k in contract.kinds}
        self._ort: dict[int, dict[str, list]] = {}  # n -> OrtValues over the first n rows (no copy)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layers in self.arrays.values() for a in layers)

    def reserve(self, rows: int, slots: int) -> None:
        """At least ``rows`` rows of ``slots`` slots held (within the limits; past them is the engine's bug)."""
        if rows > self.rows or slots > self.capacity:
            raise ValueError(f"{rows} rows of {slots} slots asked of a row cache of {self.rows} x {self.capacity}")
        if rows <= self.held and slots <= self.slots:
            return
        held = min(self.rows, max(rows, self.held + max(1, self.held // 2)))
        grown = -(-max(slots, self.slots + max(self.GROW, self.slots // 4)) // self.GROW) * self.GROW
        cap = min(self.capacity, grown) if slots > self.slots else self.slots
        self._ort.clear()  # its OrtValues hold the old buffers
        regrow(self.contract, self.arrays, held, cap, large_zeros, zeroed=True)
        self.held, self.slots = held, cap
        self.regrown += 1

    def view(self, n: int, total: int) -> _Rows:
        """Rows 0..n-1 holding ``total`` slots, as OrtLM.step takes a cache (its next forward writes slots from
        total on)."""
        return _Rows(self, n, total)

    def bind(self, io, n: int) -> None:
        """The first n rows of every buffer as past and present of an IOBinding."""
        import onnxruntime as ort

        if n not in self._ort:
            self._ort[n] = {k: [ort.OrtValue.ortvalue_from_numpy(a[:n]) for a in v] for k, v in self.arrays.items()}
        ct = self.contract
        for i in range(ct.layers):
            for kind in ct.kinds:
                io.bind_ortvalue_input(ct.past(i, kind), self._ort[n][kind][i])
                io.bind_ortvalue_output(ct.present(i, kind), self._ort[n][kind][i])

    def shift(self, n: int, lo: int, hi: int, by: int) -> None:
        """Slots [lo, hi) of rows 0..n-1 moved ``by`` slots (either way; numpy copies through a buffer where the two
        ranges overlap)."""
        self.reserve(n, hi + by)
        for kind, layers in self.arrays.items():
            for a in layers:
                s = slot_view(self.contract, kind, a)
                s[:n, ..., lo + by:hi + by] = s[:n, ..., lo:hi]

    def put(self, row: int, src: SharedCache, at: int) -> None:
        """A sequence prefilled on its own (a one-row SharedCache of ``src.length`` tokens) into ``row`` at slots
        [at, at + length)."""
        self.reserve(row + 1, at + src.length)
        copy_slots(self.contract, (self.arrays, row, at), (src.arrays, 0, 0), src.length)

    def move(self, dst: int, src: int, lo: int, hi: int) -> None:
        """Row src's slots [lo, hi) into row dst (a finished row's place taken by the last live one)."""
        copy_slots(self.contract, (self.arrays, dst, lo), (self.arrays, src, lo), hi - lo)


def regrow(contract: Contract, arrays: dict, rows: int, slots: int, allocate, zeroed: bool = False) -> None:
    """Every layer's buffers of ``arrays`` ({kind: [layer buffers]}) replaced in place by buffers of ``rows`` rows and
    ``slots`` slots (contract.empty_buffer's allocate and zeroed), what the old ones held in their first rows and
    slots; a layer at a time, so the old and new buffers together are one layer's more than either, never twice the
    cache. An empty list gets its layers."""
    for kind, layers in arrays.items():
        for i in range(contract.layers):
            fresh = contract.empty_buffer(kind, rows, slots, i, allocate, zeroed=zeroed)
            if i == len(layers):
                layers.append(fresh)
                continue
            old = layers[i]
            b, c = old.shape[0], old.shape[2]  # every kind is declared [B, Hkv, slots, ...]
            if kind == "key":  # K^ dim-major: its slots are the last axis of the rows' view
                contract.key_rows(fresh)[:b, ..., :c] = contract.key_rows(old)
            else:
                fresh[:b, :, :c] = old
            layers[i] = fresh


def slot_view(contract: Contract, kind: str, a: np.ndarray) -> np.ndarray:
    """A buffer with its slot axis last (K^ dim-major [B, Hkv, r, C]; V [B, Hkv, C, rv] seen as [B, Hkv, rv, C])."""
    return contract.key_rows(a) if kind == "key" else np.moveaxis(a, 2, 3)


def copy_slots(contract: Contract, dst: tuple, src: tuple, m: int) -> None:
    """m slots of one row between buffers of the same kinds and layers: dst and src are (arrays {kind: [layer
    buffers]}, row, first slot)."""
    (da, dr, dat), (sa, sr, sat) = dst, src
    for kind in da:
        for a, b in zip(da[kind], sa[kind]):
            slot_view(contract, kind, a)[dr, ..., dat:dat + m] = slot_view(contract, kind, b)[sr, ..., sat:sat + m]


class _Rows:
    """The first n rows of a RowCache as OrtLM's shared-buffer forward drives a cache (SharedCache's methods)."""

    def __init__(self, cache: RowCache, n: int, total: int):
        self.cache, self.n, self.length = cache, n, total

    def slots_for(self, attention_mask: np.ndarray) -> int:
        return attention_mask.shape[1]

    def reserve(self, needed: int) -> None:
        self.cache.reserve(self.n, needed)  # past its capacity raises: the engine compacts before

    def bind(self, io) -> None:
        self.cache.bind(io, self.n)

    def after(self, new_tokens: int) -> None:
        self.length += new_tokens
