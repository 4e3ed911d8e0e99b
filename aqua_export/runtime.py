"""ONNX Runtime inference from a built folder: sessions, the generation loop, streaming.

onnxruntime is imported here and only here (plus parity), when a session is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .caches import H2OCache, SharedCache
from .config import ConfigError
from .contract import Contract
from .folder import FolderConfig


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy when do_sample is False; otherwise temperature / top-k / top-p sampling from a seeded generator."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens} generates nothing: give 1 or more")
        if not self.temperature > 0:
            raise ConfigError("--temperature must be > 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k} is negative: give 0 (all tokens) or a count of tokens")

    def check_vocabulary(self, vocab: int) -> None:
        """top_k counts tokens of this vocabulary (0: all of them)."""
        if self.top_k > vocab:
            raise ConfigError(f"--top-k {self.top_k} exceeds the model's vocabulary of {vocab} tokens: give 0 (all) "
                              f"up to {vocab}")


def providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


KERNELS = ("auto", "native", "function")
NATIVE_ENV = "AQUA_ORT_KERNEL"  # path of a libaqua_ort.so to use instead of the installed one


def native_library() -> Path | None:
    """The built native kernels of the custom nodes (plugins/ort, built by `make setup`), or None."""
    env = os.environ.get(NATIVE_ENV)
    if env:
        if not Path(env).is_file():
            raise ConfigError(f"${NATIVE_ENV}={env} does not exist: unset it or run `make plugin`")
        with open(env, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise ConfigError(f"${NATIVE_ENV}={env} is not a shared library: unset it or point it at a "
                                  "libaqua_ort.so built by `make plugin`")
        return Path(env)
    lib = Path(__file__).parent / "_native" / "libaqua_ort.so"
    return lib if lib.is_file() else None


def available_memory() -> int:
    """Bytes the kernel says a new process can take now without swapping (/proc/meminfo's MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def check_serving(cfg: FolderConfig, folder, batch: int, slots: int) -> None:
    """Before a folder is loaded to serve ``batch`` sequences of up to ``slots`` tokens: a float16 folder needs a GPU
    (ONNX Runtime's CPU provider keeps a float32 copy of every float16 weight it multiplies: twice the folder), and
    the weights plus the cache must fit the memory available now; otherwise one line with the numbers."""
    if cfg.dtype == "float16" and "CUDAExecutionProvider" not in providers():
        raise ConfigError(f"{folder} is float16, the GPU format: on a CPU ONNX Runtime keeps a float32 copy of every "
                          "float16 weight (twice the folder in memory, no faster); serve a build with --weights int4 "
                          "(or --dtype float32) on CPU")
    weights = sum(rec["bytes"] for name, rec in (cfg.files or {}).items() if name.startswith("model.onnx"))
    cache = cfg.contract.cache_bytes(batch, slots)
    free = available_memory()
    if weights + cache > free:
        raise ConfigError(f"{folder} needs {weights / 2**30:.2f} GiB of weights and {cache / 2**30:.2f} GiB of cache for "
                          f"{batch} x {slots} tokens, and {free / 2**30:.2f} GiB of memory is available: serve fewer or "
                          "shorter sequences, or a smaller folder (--weights int4)")


def default_kernel(dtype: str) -> str:
    """"native" for float32 models when the native kernel is built, else "function". float16: ONNX Runtime's
    CPU provider runs the body's MatMul in float32 behind inserted casts and keeps the scores in float32 into
    the softmax, while a float16 kernel must round them to float16 (less accurate), so the body is used."""
    return "native" if dtype == "float32" and native_library() is not None else "function"


def make_session(model: str | Path | bytes, threads: int = 0, kernel: str = "auto", spin: bool = True,
                 lean: bool = False):
    """An ORT session (CUDA when onnxruntime-gpu and a GPU are present, else CPU).

    kernel: "native" registers the C++ TopKGatherDot kernel (error when not built), "function" runs the
    model's portable function body, "auto" is native when built. spin=False stops the intra-op threads
    from busy-waiting between runs (benchmarks holding several sessions, so they do not steal cores).
    lean=True (parity's low-memory float16 variant): Cast nodes on weights stay run-time work instead of
    ONNX Runtime storing their float32 results, and no memory arena, so each cast weight is freed after its
    node (an arena keeps its peak, which here grows towards the float32 model, for the session's life).
    """
    import onnxruntime as ort

    if kernel not in KERNELS:
        raise ConfigError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if lean:
        so.enable_cpu_mem_arena = False
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    lib = native_library() if kernel != "function" else None
    if kernel == "native" and lib is None:
        raise ConfigError("the native kernels are not built: run `make plugin` (or use kernel='function')")
    if lib is not None:
        try:
            so.register_custom_ops_library(str(lib))
        except Exception as e:  # ORT's own exception types: a library for another CPU or ONNX Runtime
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"ONNX Runtime cannot load the native kernels {lib} ({first}): rebuild them with `make "
                              "plugin`, or run with --kernel function") from None
    src = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(src, sess_options=so, providers=providers(),
                                    disabled_optimizers=["ConstantFolding"] if lean else None)
    except Exception as e:  # ORT raises its own exception types (InvalidProtobuf, Fail, NoSuchFile, ...)
        if isinstance(model, bytes):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{model} cannot be loaded by ONNX Runtime ({type(e).__name__}: {first[:200]}): the file is "
                          "corrupt, truncated or not this folder's model; rebuild the folder") from None


CACHES = ("shared", "concat")


class OrtLM:
    """A causal LM served by ONNX Runtime with the folder's graph contract (contract.Contract).

    cache "shared": past and present bound to one buffer per layer and kind (IOBinding), written in place,
    as onnxruntime-genai's past_present_share_buffer does; "concat": a new present every step.
    AQUA-H2O graphs evict inside (h2o.py): their cache is an H2OCache of fixed-capacity slots, and a prompt
    is one forward.
    """

    def __init__(self, session, cfg: FolderConfig, cache: str = "shared"):
        if cache not in CACHES:
            raise ConfigError(f"cache must be one of {CACHES}, got {cache!r}")
        self.session, self.cfg = session, cfg
        self.contract: Contract = cfg.contract
        self.layers, self.kv_heads = self.contract.layers, self.contract.kv_heads
        self.dtype = np.float16 if self.contract.dtype == "float16" else np.float32
        self.h2o_ratio = cfg.aqua.h2o_ratio
        self.h2o = self.contract.h2o
        self.shared = cache == "shared"
        self.folder = None  # set by from_folder: named in error lines
        self.output_names = [o.name for o in session.get_outputs()] if hasattr(session, "get_outputs") else None
        self.n_outputs = 1 + len(self.contract.kinds) * self.layers
        self.last_extra: list[list[np.ndarray]] = []  # outputs beyond the contract (debug graphs), per forward
        self._check_graph()

    def _check_graph(self) -> None:
        """The config must describe this graph: the contract's buffers per layer, of its heads and width."""
        if not hasattr(self.session, "get_inputs"):
            return
        by_name = {i.name: i for i in self.session.get_inputs()}
        keys = [by_name[n] for n in (self.contract.past(i, "key") for i in range(len(by_name))) if n in by_name]
        widths = [k.shape[3] if len(k.shape) == 4 else None for k in keys]
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
                    serving: tuple[int, int] | None = None) -> "OrtLM":
        """serving: (batch, tokens) the caller will run, checked against the memory before loading (check_serving;
        default: one sequence of the model's context)."""
        cfg = FolderConfig.from_folder(folder)
        cfg.verify(folder)  # every file the build wrote, of its size (`aqua-export check` compares checksums too)
        check_serving(cfg, folder, *(serving or (1, cfg.context_length or 4096)))
        if kernel == "auto":
            kernel = default_kernel(cfg.dtype)
        lm = cls(make_session(Path(folder) / "model.onnx", threads, kernel), cfg, cache)
        lm.folder = Path(folder)
        return lm

    def empty_past(self, batch: int, log: list | None = None):
        """Nothing seen yet: a SharedCache (an H2OCache for H2O graphs; log: see H2OCache), or for the concat
        cache a list of every layer's buffers (Contract.kinds order), each of 0 slots."""
        ct = self.contract
        if not self.shared:
            return [ct.empty_buffer(kind, batch, 0, i) for i in range(self.layers) for kind in ct.kinds]
        return H2OCache(batch, ct, self.dtype, self.h2o_ratio, log) if self.h2o else SharedCache(batch, ct, self.dtype)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, past):
        """One forward. input_ids [B, T], attention_mask [B, P+T] (every token seen, padding 0); past as from
        empty_past. Returns (logits [B, T, V], present)."""
        if not self.shared:
            self.last_extra = []
            out = self._run(input_ids, attention_mask, past)
            return out[0], out[1:self.n_outputs]
        if getattr(past, "log", None) is not None and input_ids.shape[1] > 1:  # evictions recorded token by token
            t, logits, extra = input_ids.shape[1], [], []
            for j in range(t):
                out, past = self._step_shared(input_ids[:, j:j + 1], attention_mask[:, :attention_mask.shape[1] - t + j + 1],
                                              past)
                logits.append(out)
                extra.append(self.last_extra[0])
            self.last_extra = [[np.concatenate(x, axis=-2) for x in zip(*extra)]]
            return np.concatenate(logits, axis=1), past
        return self._step_shared(input_ids, attention_mask, past)

    def _run(self, input_ids, attention_mask, past) -> list[np.ndarray]:
        ct = self.contract
        feed = {ct.INPUT_IDS: input_ids.astype(np.int64), ct.ATTENTION_MASK: attention_mask.astype(np.int64)}
        names = [ct.past(i, kind) for i in range(self.layers) for kind in ct.kinds]
        feed.update(zip(names, past))
        out = self.session.run(None, feed)
        self.last_extra.append(out[self.n_outputs:])
        return out

    def _step_shared(self, input_ids, attention_mask, cache: "SharedCache"):
        """past and present bound to the same buffers (IOBinding): the graph writes the new entries in place."""
        ct = self.contract
        t = input_ids.shape[1]
        mask = np.ascontiguousarray(attention_mask[:, -(cache.length + t):], dtype=np.int64)
        cache.reserve(cache.slots_for(mask))
        io = self.session.io_binding()
        io.bind_cpu_input(ct.INPUT_IDS, np.ascontiguousarray(input_ids, dtype=np.int64))
        io.bind_cpu_input(ct.ATTENTION_MASK, mask)
        io.bind_output(ct.LOGITS)
        extra = self.output_names[self.n_outputs:]
        for name in extra:  # debug outputs beyond the contract (parity's TopK indices)
            io.bind_output(name)
        cache.bind(io)
        self.session.run_with_iobinding(io)
        outs = io.get_outputs()
        cache.after(t)
        self.last_extra = [[o.numpy() for o in outs[1:1 + len(extra)]]]
        return outs[0].numpy(), cache

    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray, sampling: SamplingConfig,
                 eos_token_id: int | None = None, on_token=None, on_logits=None, stop=None) -> np.ndarray:
        """Padded prompts [B, T] (padding left or right: positions come from the mask) -> generated ids
        [B, N]; every row continues after the last column. on_token(step, ids[B]) streams; on_logits(step,
        logits[B, V]) sees the logits each token is picked from; stop(ids [B, n]) ends generation early when
        true (lm-eval's stop sequences)."""
        rng = np.random.default_rng(sampling.seed)
        b = input_ids.shape[0]
        mask = attention_mask.astype(np.int64)
        logits, past = self.step(input_ids, mask, self.empty_past(b))
        last_real = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)  # the prompt's last token, per row
        logits = logits[np.arange(b), last_real][:, None]
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


def check_finite(logits: np.ndarray, folder) -> None:
    """Logits a token is picked from must be numbers: NaN or inf means damaged weights (a folder whose data file
    was overwritten keeps its size), or a float16 folder whose activations overflowed. Shared by every runtime."""
    if not np.isfinite(logits).all():
        raise ConfigError(f"the model in {folder or 'this folder'} computed logits that are not numbers (NaN or inf): "
                          f"its weights are damaged (see `aqua-export check {folder or 'FOLDER'}`), or a float16 "
                          "folder overflowed: rebuild the folder")


def emit(nxt: np.ndarray, done: np.ndarray, eos: int | None, step: int, out: list, on_token) -> np.ndarray:
    """One generated token per row: rows already finished repeat eos, ``done`` (updated in place) marks rows
    that produced it; the tokens are appended to ``out`` and streamed. Shared by every runtime's loop."""
    if eos is not None:
        nxt = np.where(done, eos, nxt)
        done |= nxt == eos
    out.append(nxt)
    if on_token is not None:
        on_token(step, nxt)
    return nxt


def pick(logits: np.ndarray, s: SamplingConfig, rng) -> np.ndarray:
    """logits [B, V] -> token ids [B]; greedy ties go to the lower id (np.argmax)."""
    if not s.do_sample:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / s.temperature
    if s.top_k:
        kth = np.sort(z, axis=-1)[:, -s.top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if s.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, -1)
        cut = sp.cumsum(-1) - sp > s.top_p
        sp[cut] = 0
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp, -1)
        p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # tokenizers / transformers raise many types for a damaged file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"the tokenizer in {folder} cannot be loaded ({type(e).__name__}: {first}): rebuild the "
                          "folder") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.pad_token is None:
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
