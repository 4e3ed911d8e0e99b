"""The prefix cache: prompts' cache rows kept after their prefill, so a prompt that starts the same way (a shared
system prompt, the earlier turns of a chat) copies them instead of computing them again.

Exact by construction: a prompt is prefilled in chunks of ``chunk`` tokens counted from its first token, and an entry
holds a prompt's first M tokens with M a multiple of ``chunk`` (the rows as its prefill wrote them, which later chunks
never rewrite). A later prompt whose first m tokens equal an entry's (m a multiple of ``chunk``, below its length)
starts from those m rows and prefills its own chunks from m on: the forwards it runs are the ones it would have run
from its first token. Rows written by decode steps are never kept (another kernel computed them).

Admitted on a second sighting: a prompt is kept only when an earlier prompt started with the same first chunk (a
ledger of first chunks' hashes, SEEN of them), so prompts that share nothing with any other (a load of distinct
requests) cost no memory. The price: the first prompt of a shared start is not kept, so the second one with it still
prefills in full (a system prompt's second request; the first turn of a chat that fills a whole chunk); from the
third on, as without the ledger.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..contract import Contract
from ..runtime.caches import SharedCache, copy_slots

SEEN = 4096  # first chunks remembered (a 16-byte digest each), least recently seen forgotten first


class PrefixCache:
    """Entries (tokens [M], a one-row SharedCache of M slots) up to ``budget`` bytes of cache, least recently used
    evicted first; admitted on a second sighting of their first chunk (module docstring). budget 0: nothing is
    kept."""

    def __init__(self, contract: Contract, dtype, chunk: int, budget: int):
        self.contract, self.dtype, self.chunk, self.budget = contract, dtype, chunk, budget
        self.entries: OrderedDict[int, tuple[np.ndarray, SharedCache]] = OrderedDict()
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.used = self.hits = self.reused_tokens = self.first_sightings = 0
        self._next = 0

    def _bytes(self, m: int) -> int:
        return self.contract.cache_bytes(1, m)

    def lookup(self, ids: np.ndarray) -> tuple[int, SharedCache | None]:
        """(m, entry): the most tokens of ``ids`` an entry holds, a multiple of ``chunk`` and below len(ids) (the
        last token's forward gives the logits the first token is picked from), and that entry; (0, None) if none."""
        best, found, key = 0, None, None
        limit = (len(ids) - 1) // self.chunk * self.chunk
        for k, (tokens, cache) in self.entries.items():
            n = min(len(tokens), limit)
            if n <= best:
                continue
            differ = np.flatnonzero(tokens[:n] != ids[:n])
            m = (int(differ[0]) if differ.size else n) // self.chunk * self.chunk
            if m > best:
                best, found, key = m, cache, k
        if key is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            self.reused_tokens += best
        return best, found

    def _sighted(self, ids: np.ndarray) -> bool:
        """Whether a prompt starting with ids[:chunk] was seen before; this one is remembered either way."""
        key = hashlib.blake2b(np.ascontiguousarray(ids[:self.chunk], np.int64).tobytes(), digest_size=16).digest()
        before = key in self.seen
        self.seen[key] = None
        self.seen.move_to_end(key)
        if len(self.seen) > SEEN:
            self.seen.popitem(last=False)
        self.first_sightings += not before
        return before

    def keep(self, ids: np.ndarray, prefilled: SharedCache) -> None:
        """A prompt just prefilled into ``prefilled`` (one row): its first whole chunks kept when its first chunk was
        seen before, unless an entry already holds them all or they exceed the budget; older entries evicted to make
        room."""
        m = len(ids) // self.chunk * self.chunk
        if m == 0 or self._bytes(m) > self.budget or not self._sighted(ids):
            return
        for tokens, _ in self.entries.values():
            if len(tokens) >= m and np.array_equal(tokens[:m], ids[:m]):
                return
        while self.entries and self.used + self._bytes(m) > self.budget:
            tokens, _ = self.entries.popitem(last=False)[1]
            self.used -= self._bytes(len(tokens))
        copy = SharedCache(1, self.contract, self.dtype)
        copy.reserve(m)
        copy_slots(self.contract, (copy.arrays, 0, 0), (prefilled.arrays, 0, 0), m)
        copy.length = m
        self.entries[self._next] = (np.array(ids[:m]), copy)
        self._next += 1
        self.used += self._bytes(m)

