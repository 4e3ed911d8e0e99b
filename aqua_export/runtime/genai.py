"""onnxruntime-genai hosting: the files that make a built folder an onnxruntime-genai model, and a runner.

    write_files(folder, cfg, hf_config, generation_config, tok)
        genai_config.json      decoder I/O name templates (contract.Contract.genai_io), head_size = r,
                               context length, search defaults, bos / eos / pad
        config.json            the model's Hugging Face config; generation_config.json its defaults
        libaqua_ort*.so        the native kernels (float32 folders): the loader, named in custom_ops_library, and
                               its instruction-set variants (it picks the one the CPU runs); the graph keeps their
                               function bodies, so a runtime without the library still runs it (GenaiLM says so)
    GenaiLM(folder)            og.Model / og.Generator behind the backends.LM protocol

onnxruntime_genai is imported only when a GenaiLM is made.

How genai drives the graph (contract.py, The KV contract): it feeds input_ids, attention_mask [B, total]
and the past / present buffers by name. With past_present_share_buffer it binds one [B, Hkv, max_length, r]
buffer as both; the KeyCacheUpdate / ValueCacheUpdate kernels see the same memory on both sides and write
only the new slots. Without it, present has exactly ``total`` slots and the past is copied over once per
step (as for every model genai runs that way). Batches are right-padded (genai masks trailing pad tokens);
positions come from the mask inside the graph, so they match HF's for either padding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .. import capabilities
from ..capabilities import Features
from ..config import ConfigError
from ..outputs import atomic_write_bytes
from .folder import FolderConfig
from .sampling import check_finite, emit
from .session import check_serving, native_library, native_variant, no_variant_line, say_once

GENAI_CONFIG = "genai_config.json"
NATIVE_NAME = "libaqua_ort.so"


def genai_config(cfg: FolderConfig, bos: int | None, eos, pad: int | None) -> dict:
    """genai_config.json of a folder (raises for H2O folders, which genai cannot run)."""
    inputs, outputs = cfg.contract.genai_io()
    # the CPU arena on: a prompt's tensors are per-layer and linear in its length (no [T, T], no [T, vocabulary]),
    # and without the arena the C heap fragments over them: a 7,936-token prompt's peak was 1,341-1,829 MB instead of
    # 942 (tools/request_runner.py, DIR@no-arena); the arena keeps that working set for the session's life
    # intra_op_num_threads 0: ONNX Runtime's own default, one thread per physical core of the machine that runs the
    # folder. Without the key genai sets hardware_concurrency() / 2 (its guess that every core is two hyperthreads):
    # one thread on a 2-core machine without SMT, where an 8,000-token prompt took 80.4 s instead of 34.8 s. A count
    # written here would be wrong on the next machine; 0 is right on each.
    session = {"log_id": "onnxruntime-genai", "provider_options": [], "enable_cpu_mem_arena": True,
               "intra_op_num_threads": 0}
    if cfg.dtype == "float32":  # float16 folders run the function bodies (runtime.default_kernel says why)
        session["custom_ops_library"] = NATIVE_NAME
    g = cfg.geometry
    context = cfg.serving_context
    return {
        "model": {
            "bos_token_id": bos, "context_length": context, "eos_token_id": eos, "pad_token_id": pad,
            "type": "decoder",  # genai's generic decoder-only LLM: the graph does everything model-specific
            "vocab_size": cfg.contract.vocab,
            "decoder": {"session_options": session, "filename": "model.onnx", "head_size": cfg.contract.widths[0] + cfg.contract.scale_slots,
                        "hidden_size": g.hidden_size, "num_attention_heads": g.heads,
                        "num_hidden_layers": g.layers, "num_key_value_heads": g.kv_heads,
                        "inputs": inputs, "outputs": outputs},
        },
        "search": {"do_sample": False, "max_length": context, "min_length": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 50, "top_p": 1.0, "early_stopping": True, "length_penalty": 1.0,
                   "diversity_penalty": 0.0, "no_repeat_ngram_size": 0},
    }


def cache_config(hf: dict, cfg: FolderConfig) -> dict:
    """The Hugging Face config of a folder: the model's, but with head_dim and hidden_size / num_attention_heads giving
    the width its KV cache holds per head (r; narrower than the model's head under AQUA-Memory), which is what ONNX
    tools size the cache buffers from (optimum's ORTModelForCausalLM takes hidden_size / num_attention_heads). The
    model's own dimensions are aqua_config.json's geometry; a folder of several widths (--slice-alloc) keeps them."""
    r, g = cfg.contract.widths[0], cfg.geometry
    if not cfg.contract.uniform or r == g.head_dim:
        return hf
    return {**hf, "head_dim": r, "hidden_size": g.heads * r,
            "aqua_export": f"head_dim and hidden_size give the KV cache's width per head ({r} of the model's "
                           f"{g.head_dim}: AQUA-Memory); the model's hidden size is {g.hidden_size} (aqua_config.json)"}


def write_files(folder: Path, cfg: FolderConfig, hf_config, generation_config, tok) -> None:
    """genai_config.json, config.json, generation_config.json and (float32) the native kernel library. config.json is
    the model's, its cache described as the graph holds it (cache_config)."""
    hf = cache_config(json.loads(hf_config.to_json_string()), cfg)
    atomic_write_bytes(folder / "config.json", json.dumps(hf, indent=2, sort_keys=True).encode())
    if generation_config is not None:
        atomic_write_bytes(folder / "generation_config.json", generation_config.to_json_string().encode())
    if capabilities.refusal(Features.of_folder(cfg), "genai"):  # H2O, several widths: --runtime aqua only
        return
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    eos = tok.eos_token_id if eos is None else eos
    bos = getattr(hf_config, "bos_token_id", None)
    bos = tok.bos_token_id if bos is None else bos
    atomic_write_bytes(folder / GENAI_CONFIG, json.dumps(genai_config(cfg, bos, eos, pad), indent=4).encode())
    lib = native_library()
    if cfg.dtype == "float32" and lib is not None:
        for f in native_files(lib):
            shutil.copyfile(f, folder / (NATIVE_NAME if f == lib else f.name))


def native_files(lib: Path) -> list[Path]:
    """The loader ``lib`` and the variants beside it (plugins/ort/loader.cc)."""
    return [lib] + sorted(lib.parent.glob(f"{lib.stem}_*.so"))


def to_right_padding(input_ids: np.ndarray, attention_mask: np.ndarray, pad: int) -> np.ndarray:
    """Padded ids -> the same rows right-padded with ``pad`` (genai's batch layout: it masks trailing pads)."""
    out = np.full_like(input_ids, pad)
    for b in range(input_ids.shape[0]):
        real = input_ids[b][attention_mask[b].astype(bool)]
        out[b, : len(real)] = real
    return out


class GenaiLM:
    """A built folder run by onnxruntime-genai (og.Model / og.Generator)."""

    def __init__(self, folder: str | Path, share_buffer: bool = True, threads: int = 0,
                 serving: tuple[int, int] | None = None):
        self.cfg = FolderConfig.from_folder(folder)
        self.cfg.contract.genai_io()  # H2O, or K^ / V widths per layer: one line naming --runtime aqua
        self.cfg.verify(folder)  # every file the build wrote, of its size
        check_serving(self.cfg, folder, *(serving or (1, self.cfg.serving_context)))
        folder = self.folder = Path(folder)
        if not (folder / GENAI_CONFIG).is_file():
            raise ConfigError(f"{folder} has no {GENAI_CONFIG}: rebuild the folder with this aqua-export")
        import onnxruntime_genai as og

        self.og = og
        try:
            gc = json.loads((folder / GENAI_CONFIG).read_text())
            self.pad = gc["model"]["pad_token_id"]
            self.context = gc["model"]["context_length"]
            config = og.Config(str(self._view(folder, gc)))
            if threads:
                config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
            self.model = og.Model(config)
        except Exception as e:  # JSON, key and onnxruntime-genai's own errors: one line, not a traceback
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"{folder} cannot be loaded by onnxruntime-genai ({type(e).__name__}: {first}): its "
                              f"{GENAI_CONFIG} or model is damaged; rebuild the folder") from None
        self.share_buffer = share_buffer

    def _view(self, folder: Path, gc: dict) -> Path:
        """The folder genai opens: itself, or, when the kernel library its config names is gone, a view of it whose
        config names none (genai refuses a missing library and no overlay removes the key): the custom nodes then
        run their function bodies, said in one line."""
        options = gc["model"]["decoder"].get("session_options", {})
        lib = options.get("custom_ops_library")
        if not lib:
            self.kernels = ("aqua-export: onnxruntime-genai runs the custom nodes' ONNX function bodies (a "
                            f"{self.cfg.dtype} folder names no native kernels)")
            return folder
        if (folder / lib).is_file():
            variant = native_variant(folder / lib)
            self.kernels = (f"aqua-export: onnxruntime-genai runs the custom nodes on {folder}'s native kernels "
                            f"({variant})" if variant else no_variant_line(folder / lib))
            return folder
        self.kernels = (f"aqua-export: {folder} has no {lib} (the native kernels): onnxruntime-genai runs the custom "
                        "nodes' ONNX function bodies (slower)")
        say_once(self.kernels)
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="aqua-genai-")  # lives as long as this object
        view = Path(self._tmp.name)
        for f in folder.iterdir():
            if f.name != GENAI_CONFIG:
                (view / f.name).symlink_to(f.resolve())
        del options["custom_ops_library"]
        (view / GENAI_CONFIG).write_text(json.dumps(gc, indent=4))
        return view

    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray, sampling, eos_token_id: int | None = None,
                 on_token=None, on_logits=None) -> np.ndarray:
        og = self.og
        b, t = input_ids.shape
        params = og.GeneratorParams(self.model)
        opts = {"max_length": min(self.context, t + sampling.max_new_tokens), "batch_size": b,
                "past_present_share_buffer": self.share_buffer, "do_sample": sampling.do_sample}
        if sampling.do_sample:
            opts.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p,
                        random_seed=sampling.seed)
        params.set_search_options(**opts)
        gen = og.Generator(self.model, params)
        gen.append_tokens(to_right_padding(input_ids, attention_mask, self.pad))
        out = []
        done = np.zeros(b, bool)
        for step in range(sampling.max_new_tokens):
            if gen.is_done():
                break
            # the logits the next token is picked from (genai runs the model eagerly: after append / generate)
            logits = np.asarray(gen.get_logits()).reshape(b, -1)
            check_finite(logits, self.folder)
            if on_logits is not None:
                on_logits(step, logits)
            gen.generate_next_token()
            emit(np.asarray(gen.get_next_tokens()).astype(np.int64), done, eos_token_id, step, out, on_token)
            if eos_token_id is not None and done.all():
                break
        return np.stack(out, axis=1) if out else np.zeros((b, 0), np.int64)


class GenaiGraph:
    """Any onnxruntime-genai decoder folder (this project's or genai's own model builder's) driven in ONNX Runtime
    with genai's CPU I/O, read from its genai_config.json: input_ids, attention_mask [B, total], position_ids when
    the graph declares them, and the past / present buffers by their name templates. For what genai itself cannot do
    here: a prefill of windows (perplexity), and a decode step over a context written straight into the buffers."""

    def __init__(self, folder: str | Path, threads: int = 0):
        import onnxruntime as ort

        folder = Path(folder)
        try:
            gc = json.loads((folder / GENAI_CONFIG).read_text())["model"]
            self.dec, self.vocab = gc["decoder"], gc["vocab_size"]
            self.io_in, self.io_out = self.dec["inputs"], self.dec["outputs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{folder} is not an onnxruntime-genai folder ({type(e).__name__} reading its "
                              f"{GENAI_CONFIG}): give a folder this tool or genai's model builder wrote") from None
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        so.log_severity_level = 3
        lib = self.dec.get("session_options", {}).get("custom_ops_library")
        if lib and (folder / lib).is_file():
            so.register_custom_ops_library(str(folder / lib))
        elif lib:
            say_once(f"aqua-export: {folder} has no {lib} (the native kernels): the custom nodes run their ONNX "
                     "function bodies (slower)")
        self.session = ort.InferenceSession(str(folder / self.dec["filename"]), so, providers=["CPUExecutionProvider"])
        self.names = {i.name for i in self.session.get_inputs()}

    def buffers(self, kind: str):
        """(past name, present name) of each layer's ``kind`` buffer (key, value)."""
        return [(self.io_in[f"past_{kind}_names"] % i, self.io_out[f"present_{kind}_names"] % i)
                for i in range(self.dec["num_hidden_layers"])]

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """ids [B, T] from an empty cache -> logits [B, T, V]."""
        b, t = ids.shape
        feed = {self.io_in["input_ids"]: ids.astype(np.int64), self.io_in["attention_mask"]: np.ones((b, t), np.int64)}
        if "position_ids" in self.names:
            feed["position_ids"] = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
        empty = np.zeros((b, self.dec["num_key_value_heads"], 0, self.dec["head_size"]), np.float32)
        for kind in ("key", "value"):
            feed.update({past: empty for past, _ in self.buffers(kind)})
        out = self.session.run([self.io_out["logits"]], feed)[0]
        return out.reshape(b, t, -1)
