"""OrtLM: a built folder served by ONNX Runtime through its graph contract (contract.Contract): sessions
from runtime.session, the cache between forwards from runtime.caches, tokens picked by runtime.sampling."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from .. import capabilities
from ..capabilities import Features
from ..config import ConfigError
from ..contract import Contract
from .caches import H2OCache, SharedCache
from .folder import FolderConfig
from .sampling import SamplingConfig, check_finite, emit, pick
from .session import PREFILL_CHUNK, check_serving, default_kernel, kernel_line, make_session

CACHES = ("shared", "concat")


def last_real(attention_mask: np.ndarray, t: int) -> np.ndarray:
    """Per sequence the index among the T new positions of its last real token (mask 1): the row the graph computes
    logits for (ops/logit_rows.py); T - 1 when none of them is real."""
    new = attention_mask[:, -t:] != 0
    return np.where(new.any(1), t - 1 - np.argmax(new[:, ::-1], axis=1), t - 1)


class Probe(Protocol):
    """An instrument passed to ``OrtLM(probe=...)`` (the parity harness's RuntimeRecorder): it sees what each forward
    computed beyond the logits and the cache. Without one, nothing is recorded."""

    evictions: bool  # AQUA-H2O: see the live tokens after every token (a prompt then runs one token at a time)

    def forward(self, extra: list[np.ndarray]) -> None:
        """The graph's outputs beyond the contract (a debug graph's TopK indices), for one step() call."""

    def evicted(self, live: list[np.ndarray]) -> None:
        """Per layer the live tokens [B, Hkv, seen] (bool) after one token (H2OCache.live)."""


class OrtLM:
    """A causal LM served by ONNX Runtime with the folder's graph contract (contract.Contract).

    cache "shared": past and present bound to one buffer per layer and kind (IOBinding), written in place,
    as onnxruntime-genai's past_present_share_buffer does; "concat": a new present every step.
    AQUA-H2O graphs evict inside (ops/h2o_attention.py): their cache is an H2OCache of fixed-capacity slots, and a
    prompt is one forward. probe: an instrument (Probe) or None.
    """

    def __init__(self, session, cfg: FolderConfig, cache: str = "shared", probe: Probe | None = None,
                 all_rows: bool | None = None):
        if cache not in CACHES:
            raise ConfigError(f"cache must be one of {CACHES}, got {cache!r}")
        self.session, self.cfg = session, cfg
        self.contract: Contract = cfg.contract
        self.layers, self.kv_heads = self.contract.layers, self.contract.kv_heads
        self.dtype = np.dtype(self.contract.dtype).type
        self.h2o_ratio = cfg.aqua.h2o_ratio
        self.h2o = self.contract.h2o
        self.shared = cache == "shared"
        self.folder = None  # set by from_folder: named in error lines
        self.kernels = ""  # set by open: the one line naming the path the custom nodes take (session.kernel_line)
        self.output_names = [o.name for o in session.get_outputs()] if hasattr(session, "get_outputs") else None
        self.n_outputs = 1 + len(self.contract.kinds) * self.layers
        self.probe = probe
        # whether a forward's logits hold every position (a graph opened with rewrites.all_logits, or one computing
        # them all: TensorRT's) or each sequence's last real token's row only (contract last_logits)
        self.all_rows = not self.contract.last_logits if all_rows is None else all_rows
        # the all-logits graph's input (rewrites.all_logits), fed each forward: 1 every row, 0 (a prompt generated
        # from) each sequence's last row alone
        self.row_switch = hasattr(session, "get_inputs") and any(
            i.name == self.contract.ALL_LOGITS for i in session.get_inputs())
        self._check_graph()

    def _check_graph(self) -> None:
        """The config must describe this graph: the contract's buffers per layer, of its heads and width."""
        if not hasattr(self.session, "get_inputs"):
            return
        by_name = {i.name: i for i in self.session.get_inputs()}
        keys = [by_name[n] for n in (self.contract.past(i, "key") for i in range(len(by_name))) if n in by_name]
        extra = self.contract.scale_slots  # an int8 cache's rows carry their scale's code
        widths = [k.shape[3] - extra if len(k.shape) == 4 and isinstance(k.shape[3], int) else None for k in keys]
        heads = {k.shape[1] for k in keys if len(k.shape) == 4}
        h2o = self.contract.past(0, "token") in by_name
        if len(keys) != self.layers or heads - {self.kv_heads} or tuple(widths) != self.contract.widths \
                or h2o != self.h2o:
            raise ConfigError(f"the folder's aqua_config.json does not match its model.onnx ({self.layers} layers, "
                              f"{self.kv_heads} KV heads of widths {list(self.contract.widths)}, H2O {self.h2o} in the "
                              f"config; {len(keys)} layers, {sorted(heads)} KV heads of widths {widths}, H2O {h2o} "
                              "in the graph): rebuild the folder")

    @classmethod
    def from_folder(cls, folder: str | Path, threads: int = 0, kernel: str = "auto", cache: str = "shared",
                    serving: tuple[int, int] | None = None, all_logits: bool = False, **session) -> OrtLM:
        """serving: (batch, tokens) the caller will run, checked against the memory before loading (check_serving;
        default: one sequence of the model's context). all_logits: every position's logits (perplexity, lm-eval).
        session: make_session's other options."""
        cfg = FolderConfig.from_folder(folder)
        cfg.verify(folder)  # every file the build wrote, of its size (`aqua-export check` compares checksums too)
        check_serving(cfg, folder, *(serving or (1, cfg.serving_context)))
        lm = cls.open(Path(folder) / "model.onnx", cfg, threads, kernel, cache, all_logits, **session)
        lm.folder = Path(folder)
        return lm

    @classmethod
    def open(cls, model: str | Path, cfg: FolderConfig, threads: int = 0, kernel: str = "auto", cache: str = "shared",
             all_logits: bool = False, probe: Probe | None = None, **session) -> OrtLM:
        """A session of the graph at ``model`` (all_logits: opened with rewrites.all_logits, every position's logits;
        session: make_session's other options)."""
        asked = kernel
        if kernel == "auto":
            kernel = default_kernel(cfg.dtype)
        capabilities.check(Features.of_folder(cfg), kernel)
        if not (all_logits and cfg.contract.last_logits):
            lm = cls(make_session(model, threads, kernel, **session), cfg, cache, probe, all_rows=all_logits or None)
        else:
            from ..export.rewrites import all_logits as every_row
            from ..export.rewrites import graph_variant

            with graph_variant(Path(model), "all-logits", every_row) as path:  # the session keeps what it loaded
                lm = cls(make_session(path, threads, kernel, **session), cfg, cache, probe, all_rows=True)
        lm.kernels = kernel_line(kernel, asked, cfg.dtype)  # what `aqua-export run` says of the path taken
        return lm

    def empty_past(self, batch: int):
        """Nothing seen yet: a SharedCache (an H2OCache for H2O graphs), or for the concat cache a list of every
        layer's buffers (Contract.kinds order), each of 0 slots."""
        ct = self.contract
        if not self.shared:
            return [ct.empty_buffer(kind, batch, 0, i) for i in range(self.layers) for kind in ct.kinds]
        return H2OCache(batch, ct, self.dtype, self.h2o_ratio) if self.h2o else SharedCache(batch, ct, self.dtype)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, past, last_row: bool = False):
        """One forward. input_ids [B, T], attention_mask [B, P+T] (every token seen, padding 0); past as from
        empty_past. Returns (logits, present): logits [B, T, V] when the session computes every row (all_rows), else
        [B, 1, V], each sequence's last real token's (what the next token is picked from: contract.Contract).
        last_row: only each sequence's last real token's row is read (a prompt being generated from): an all-logits
        session's head computes that row alone (row_switch) and leaves the others of [B, T, V] unspecified."""
        if not self.shared:
            out = self._run(input_ids, attention_mask, past, last_row)
            self._record(out[self.n_outputs:])
            return self._rows(out[0], attention_mask), out[1:self.n_outputs]
        if self.probe is not None and self.probe.evictions and input_ids.shape[1] > 1:
            t, logits, extra = input_ids.shape[1], [], []  # token by token: the probe sees every eviction
            for j in range(t):
                out, past, ex = self._step_shared(input_ids[:, j:j + 1],
                                                  attention_mask[:, :attention_mask.shape[1] - t + j + 1], past)
                self.probe.evicted([past.live(i) for i in range(self.layers)])
                logits.append(out)
                extra.append(ex)
            self._record([np.concatenate(x, axis=-2) for x in zip(*extra)])
            logits = np.concatenate(logits, axis=1)  # a row per token: every position
            return logits if self.all_rows else self._rows(logits, attention_mask, pick=True), past
        logits, past, extra = self._step_shared(input_ids, attention_mask, past, last_row)
        if self.probe is not None and self.probe.evictions:
            self.probe.evicted([past.live(i) for i in range(self.layers)])
        self._record(extra)
        return logits, past

    def _rows(self, logits: np.ndarray, attention_mask: np.ndarray, pick: bool = False) -> np.ndarray:
        """A forward's [B, T, V] logits as step returns them: all of them (all_rows), or each sequence's last real
        token's [B, 1, V] (the last new position whose mask is 1; the last one when none is), the rows the graph
        computed (pick: from logits of every row)."""
        if (self.all_rows and not pick) or logits.shape[1] == 1:
            return logits
        return logits[np.arange(logits.shape[0]), last_real(attention_mask, logits.shape[1])][:, None]

    def _record(self, extra: list[np.ndarray]) -> None:
        if self.probe is not None:
            self.probe.forward(extra)

    def _run(self, input_ids, attention_mask, past, last_row: bool = False) -> list[np.ndarray]:
        ct = self.contract
        feed = {ct.INPUT_IDS: input_ids.astype(np.int64), ct.ATTENTION_MASK: attention_mask.astype(np.int64)}
        if self.row_switch:
            feed[ct.ALL_LOGITS] = np.array([0 if last_row else 1], np.int64)
        names = [ct.past(i, kind) for i in range(self.layers) for kind in ct.kinds]
        feed.update(zip(names, past))
        return self.session.run(None, feed)

    def _step_shared(self, input_ids, attention_mask, cache: SharedCache, last_row: bool = False):
        """past and present bound to the same buffers (IOBinding): the graph writes the new entries in place.
        Returns (logits [B, T, V] or each sequence's last row [B, 1, V], cache, the outputs beyond the contract). The
        logits go to a buffer of ours, so that of a long prompt's [B, T, V] only the rows read are ever touched
        (ops/logit_rows.py)."""
        import onnxruntime as ort

        ct = self.contract
        b, t = input_ids.shape
        mask = np.ascontiguousarray(attention_mask[:, -(cache.length + t):], dtype=np.int64)
        cache.reserve(cache.slots_for(mask))
        io = self.session.io_binding()
        io.bind_cpu_input(ct.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        io.bind_cpu_input(ct.ATTENTION_MASK, mask)
        if self.row_switch:
            io.bind_cpu_input(ct.ALL_LOGITS, np.array([0 if last_row else 1], np.int64))
        logits = np.empty((b, t, ct.vocab), self.dtype)
        io.bind_ortvalue_output(ct.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        extra = self.output_names[self.n_outputs:]
        for name in extra:  # debug outputs beyond the contract (parity's TopK indices)
            io.bind_output(name)
        cache.bind(io)
        self.session.run_with_iobinding(io)
        outs = io.get_outputs()
        cache.after(t)
        return self._rows(logits, mask), cache, [o.numpy() for o in outs[1:1 + len(extra)]]

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, last_row: bool = False):
        """Prompts [B, T] (attention_mask [B, T]) into a fresh cache -> (the last forward's logits, past), as step
        returns them (last_row: as step's). Forwards of PREFILL_CHUNK tokens when every row ends at the last column
        (its last token then falls in the last chunk; right-padded rows are one forward) and no probe watches;
        AQUA-H2O: one forward."""
        t = input_ids.shape[1]
        chunk = t
        if t > PREFILL_CHUNK and self.probe is None and not self.h2o and bool((attention_mask[:, -1] != 0).all()):
            chunk = PREFILL_CHUNK
        past = self.empty_past(input_ids.shape[0])
        for s in range(0, t, chunk):
            logits, past = self.step(input_ids[:, s:s + chunk], attention_mask[:, :s + chunk], past, last_row)
        return logits, past

    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray, sampling: SamplingConfig,
                 eos_token_id: int | None = None, on_token=None, on_logits=None, stop=None) -> np.ndarray:
        """Padded prompts [B, T] (padding left or right: positions come from the mask) -> generated ids
        [B, N]; every row continues after the last column. on_token(step, ids[B]) streams; on_logits(step,
        logits[B, V]) sees the logits each token is picked from; stop(ids [B, n]) ends generation early when
        true (lm-eval's stop sequences)."""
        rng = np.random.default_rng(sampling.seed if sampling.seed >= 0 else None)  # < 0: fresh, as genai
        b = input_ids.shape[0]
        mask = attention_mask.astype(np.int64)
        logits, past = self.prefill(input_ids, mask, last_row=True)
        logits = self._rows(logits, mask, pick=True)  # a session computing every row: each prompt's last token's
        done = np.zeros(b, dtype=bool)
        out = []
        for step in range(sampling.max_new_tokens):
            check_finite(logits[:, -1, :], self.folder)
            if on_logits is not None:
                on_logits(step, logits[:, -1, :])
            nxt = emit(pick(logits[:, -1, :], sampling, rng), done, eos_token_id, step, out, on_token)
            if done.all() or step == sampling.max_new_tokens - 1 or (stop is not None and stop(np.stack(out, 1))):
                break
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
            logits, past = self.step(nxt[:, None], mask, past)
        return np.stack(out, axis=1) if out else np.zeros((b, 0), np.int64)
