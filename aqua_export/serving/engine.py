"""Continuous batching over one folder's graph: sequences join the running batch at a step boundary and leave it when
they finish, over one cache of bounded capacity (runtime.caches.RowCache, one row per live sequence; its memory
taken as sequences come and grow).

One thread runs the model (Engine.run); requests arrive from any thread (submit, cancel). Each turn of the loop:

  1. a waiting sequence starts its prefill when a row is free: the prefix cache gives it the rows it already holds
     (serving.prefix), then its prompt runs in chunks of ``chunk`` tokens on a one-row cache of its own, one chunk a
     turn, so one long prompt never stalls the others' decode for more than a chunk;
  2. a prefill that has run its last chunk picks its first token and joins the batch: its rows are copied into a free
     row, right-aligned to the batch's ``total`` (the contract writes every row's new token at slot ``total``);
  3. one decode step of every live sequence (batch n), each row's token picked with its own sampling settings.

Slots: a row's tokens sit at [start, total); slots before start are masked (attention_mask 0). When a prompt is
longer than ``total`` the rows move right to make room; when ``total`` reaches the end of the slots the cache holds
they move left by the smallest start (if that frees COMPACT_SLOTS, else the cache grows; at the capacity always: each
sequence is at most ``context`` tokens, the capacity context + a margin, so that frees at least the margin). Positions come from the mask and token selection's pages from each row's first visible slot
(ops.rules.page_origin), so where a row starts changes nothing it computes (docs/design.md, Serving many users).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import capabilities
from ..capabilities import Features
from ..config import ConfigError
from ..ops.spec import PAGE  # the margin and the capacity are whole pages
from ..runtime.caches import RowCache, SharedCache, copy_slots
from ..runtime.sampling import SamplingConfig, check_finite, pick
from .prefix import PrefixCache

COMPACT_SLOTS = 4 * PAGE  # the fewest slots a compaction before growing the rows must free (a memmove of the live rows)


class Busy(Exception):
    """The queue is full (the server answers 429)."""


@dataclass(eq=False)
class Sequence:
    """One request: its prompt ids [P], sampling settings, the tokens it may stop at, and where its tokens go.

    on_event(token, finish): each generated token (finish None), then once (None, reason) with reason "stop" (a stop
    token), "length" (max_new_tokens or the context), "cancelled" or "error: ..." (the model failed)."""

    ids: np.ndarray
    sampling: SamplingConfig
    on_event: Callable[[int | None, str | None], None]
    stop_ids: frozenset = frozenset()
    out: list = field(default_factory=list)
    start: int = 0  # its first slot in the row cache
    done: bool = False
    cancelled: bool = False
    times: dict = field(default_factory=dict)  # submitted, first_token (time.perf_counter)

    def __post_init__(self):
        self.ids = np.asarray(self.ids, np.int64).reshape(-1)
        seed = self.sampling.seed
        self.rng = np.random.default_rng(seed if seed >= 0 else None)

    def finish(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.on_event(None, reason)


def check_engine(cfg, max_seqs: int, chunk: int, queue: int) -> None:
    """What an Engine refuses, one line naming the fix: a folder (cfg: its FolderConfig) the capability table says
    serve cannot run, a limit out of range. `aqua-export serve` asks before loading the model; Engine when made."""
    for flag, value, least in (("--max-seqs", max_seqs, 1), ("--chunk", chunk, 1), ("--queue", queue, 0)):
        if value < least:
            raise ConfigError(f"{flag} {value}: give {least} or more")
    capabilities.check(Features.of_folder(cfg), "serve")


class Engine:
    """lm: an OrtLM of a folder (runtime.lm; shared buffers). max_seqs: sequences decoded together (rows of the
    cache); context: the most tokens of one sequence, prompt and generated (the folder's context by default); chunk:
    prompt tokens a prefill forward takes; queue: requests waiting for a row before submit refuses (Busy);
    prefix_bytes: the prefix cache's budget (0: none); margin: slots per row beyond the context (capacity_for)."""

    def __init__(self, lm, max_seqs: int = 8, context: int | None = None, chunk: int = 512, queue: int = 64,
                 prefix_bytes: int = 0, margin: int | None = None):
        check_engine(lm.cfg, max_seqs, chunk, queue)
        self.lm, self.max_seqs, self.chunk, self.queue = lm, max_seqs, chunk, queue
        self.context = context or lm.cfg.serving_context
        self.rows = RowCache(lm.contract, max_seqs, self.capacity_for(self.context, margin))
        self.private = SharedCache(1, lm.contract, lm.dtype)  # grows with the prompts it holds
        self.prefix = PrefixCache(lm.contract, lm.dtype, chunk, prefix_bytes)
        self.waiting: deque[Sequence] = deque()
        self.live: list[Sequence] = []
        self.filling: Sequence | None = None
        self.filled = 0  # prompt tokens of `filling` in the private cache
        self.total = 0
        self.steps = self.generated = self.finished = self.cancelled = 0
        self.moves = {"right": 0, "left": 0}  # rows moved for a longer prompt / to compact
        self.cond = threading.Condition()
        self.stopping = False

    @staticmethod
    def capacity_for(context: int, margin: int | None = None) -> int:
        """Slots per row: the context in whole pages and a margin (by default an eighth, at least 256 slots), so
        that moving the rows left (when ``total`` reaches the end) is needed at most once every margin steps."""
        margin = max(context // 8, 256) if margin is None else max(margin, 1)
        return -(-context // PAGE) * PAGE + -(-margin // PAGE) * PAGE

    # ------------------------------------------------------------------ from any thread
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence (Busy when ``queue`` already wait). Its length is the caller's to check (fits)."""
        if not self.fits(len(seq.ids), seq.sampling.max_new_tokens):
            raise ConfigError(f"{len(seq.ids)} prompt tokens + {seq.sampling.max_new_tokens} to generate exceed the "
                              f"context of {self.context} tokens")
        with self.cond:
            if len(self.waiting) >= self.queue:
                raise Busy(f"{len(self.waiting)} requests are waiting")
            seq.times["submitted"] = time.perf_counter()
            self.waiting.append(seq)
            self.cond.notify()

    def fits(self, prompt: int, new: int) -> bool:
        return 1 <= prompt and prompt + new <= self.context

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence at the next step boundary (its row freed there); finish(\"cancelled\") is sent."""
        with self.cond:
            seq.cancelled = True
            self.cond.notify()

    def stop(self) -> None:
        """End run() once nothing is waiting or running (a graceful shutdown: no new work should be submitted)."""
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def busy(self) -> int:
        return len(self.waiting) + len(self.live) + (self.filling is not None)

    # ------------------------------------------------------------------ the model's thread
    def run(self) -> None:
        while True:
            with self.cond:
                while not self.busy() and not self.stopping:
                    self.cond.wait()
                if self.stopping and not self.busy():
                    return
            try:
                self.turn()
            except Exception as e:  # the model failed (NaN logits, ORT): every sequence in flight is told, then on
                for s in [*self.live, *([self.filling] if self.filling else [])]:
                    self._finish(s, f"error: {e}")
                self.live, self.filling, self.total = [], None, 0

    def turn(self) -> None:
        """One turn of the loop (module docstring)."""
        self._drop_cancelled()
        if self.filling is None and len(self.live) < self.max_seqs:
            with self.cond:
                seq = self.waiting.popleft() if self.waiting else None
            if seq is not None:
                self._begin(seq)
        if self.filling is not None:
            self._prefill_chunk()
        if self.live:
            self._decode()

    def _drop_cancelled(self) -> None:
        with self.cond:
            for s in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(s)
                self._finish(s, "cancelled")
        if self.filling is not None and self.filling.cancelled:
            self._finish(self.filling, "cancelled")
            self.filling = None
        for i in reversed(range(len(self.live))):
            if self.live[i].cancelled:
                self._leave(i, "cancelled")

    def _begin(self, seq: Sequence) -> None:
        self.filling, self.private.length = seq, 0
        m, entry = self.prefix.lookup(seq.ids) if self.prefix.budget else (0, None)
        if m:
            copy_slots(self.lm.contract, (self.private.arrays, 0, 0), (entry.arrays, 0, 0), m)
            self.private.length = m
        self.filled = m

    def _prefill_chunk(self) -> None:
        seq, a = self.filling, self.filled
        b = min(a + self.chunk, len(seq.ids))
        logits, _ = self.lm.step(seq.ids[None, a:b], np.ones((1, b), np.int64), self.private)
        self.filled = b
        if b < len(seq.ids):
            return
        self.filling = None
        if self.prefix.budget:
            self.prefix.keep(seq.ids, self.private)
        seq.times["first_token"] = time.perf_counter()
        if self._emit(seq, logits[0, -1]) is None:
            self._join(seq)

    def _join(self, seq: Sequence) -> None:
        """The private cache's prompt rows into row n, ending at ``total`` (the rows moved right if it is longer)."""
        p, n = len(seq.ids), len(self.live)
        if p > self.total:
            if n:
                lo = min(s.start for s in self.live)
                self.rows.shift(n, lo, self.total, p - self.total)
                self.moves["right"] += 1
                for s in self.live:
                    s.start += p - self.total
            self.total = p
        seq.start = self.total - p
        self.rows.put(n, self.private, seq.start)
        self.live.append(seq)

    def _decode(self) -> None:
        n = len(self.live)
        lo = min(s.start for s in self.live)
        # at the end of the slots the rows hold, compact (every row left by the smallest start) when that frees a few
        # pages, else the rows grow: the live rows span at most the context, so the slots held follow the longest live
        # sequence, not the batch's ``total``, which every join pushes right; at the capacity, always compact
        if self.total + 1 > self.rows.slots and (lo >= COMPACT_SLOTS or self.total + 1 > self.rows.capacity):
            self.rows.shift(n, lo, self.total, -lo)
            self.moves["left"] += 1
            for s in self.live:
                s.start -= lo
            self.total -= lo
        ids = np.array([[s.out[-1]] for s in self.live], np.int64)
        mask = np.zeros((n, self.total + 1), np.int64)
        for i, s in enumerate(self.live):
            mask[i, s.start:] = 1
        logits, _ = self.lm.step(ids, mask, self.rows.view(n, self.total))
        self.total += 1
        self.steps += 1
        for i in reversed(range(n)):  # from the end: a row that leaves takes the last row's place
            reason = self._emit(self.live[i], logits[i, -1])
            if reason is not None:
                self._leave(i, None)

    def _emit(self, seq: Sequence, logits: np.ndarray) -> str | None:
        """Pick and send seq's next token from logits [V]; the reason it finished, or None."""
        check_finite(logits[None], self.lm.folder)
        tok = int(pick(logits[None], seq.sampling, seq.rng)[0])
        seq.out.append(tok)
        self.generated += 1
        seq.on_event(tok, None)
        reason = "stop" if tok in seq.stop_ids else "length" if (
            len(seq.out) >= seq.sampling.max_new_tokens or len(seq.ids) + len(seq.out) >= self.context) else None
        if reason is not None:
            self._finish(seq, reason)
        return reason

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.done:
            self.finished += 1
            self.cancelled += reason == "cancelled"
            seq.finish(reason)

    def _leave(self, i: int, reason: str | None) -> None:
        """Row i's sequence leaves (finished with ``reason`` unless already); the last live row moves into its place."""
        seq, last = self.live[i], len(self.live) - 1
        if reason is not None:
            self._finish(seq, reason)
        if i != last:
            self.rows.move(i, last, self.live[last].start, self.total)
            self.live[i] = self.live[last]
        self.live.pop()
        if not self.live:
            self.total = 0
