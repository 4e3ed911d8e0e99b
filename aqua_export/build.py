"""The one-command build: calibrate (or reuse) -> export -> parity -> a ready-to-serve folder, atomically.

Folder contents: model.onnx (+ model.onnx.data when large), projection.safetensors, aqua_config.json
(folder.FolderConfig), the tokenizer files, parity.json, and what onnxruntime-genai loads: genai_config.json,
config.json, generation_config.json, libaqua_ort.so (runtime/genai.py). It is assembled in a temporary
sibling folder and renamed into place only when every stage succeeded, so a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from . import __version__, calibrate, models, settings
from .config import AquaConfig, ConfigError
from .export.exporter import contract_for, export_onnx
from .fold import INT8_KEY_SPLIT
from .meter import StageMeter, stage_bar
from .options import BuildOptions
from .ops.catalogue import OPS
from .ops.spec import FLOAT_TYPES, PLUGIN_NAMESPACE, PLUGIN_VERSION
from .outputs import atomic_write_bytes, check_free_space, check_writable, claim, critical
from .parity.harness import check_run, parity_lengths, prompt_length, run_parity
from .parity.report import summary_lines
from .projection import load_projection
from .projection import write as write_projection
from .runtime import genai
from .runtime.folder import FolderConfig, Geometry, built_files, file_sha256, foreign_files
from .runtime.session import default_kernel
from .runtime.tensorrt import build_engine
from .runtime.tensorrt_plugin import require_tensorrt
from .runtime.text import write_tokenizer
from .slice_costs import add_costs, add_select_costs

STAGES = 5
CALIB_TOKENS = 16384  # calibration tokens unless asked (--calib-tokens)
DTYPES = {name: getattr(torch, name) for name in FLOAT_TYPES}  # --dtype name -> torch dtype
WEIGHT_CHOICES = ("{fmt.name} blocks of {fmt.block} ({zero}) for every linear layer after the folds, the MoE experts "
                  "(QMoE) and the output layer (MatMulNBits, accuracy_level {fmt.accuracy_level}), and the embedding "
                  "(GatherBlockQuantized); norms, biases, the projections P and a MoE router stay float32")



def default_out(model_name: str, config: AquaConfig, o: BuildOptions, calibration: str = "") -> Path:
    """engines/<model>-k<R> and a part per setting that differs from its default (name_parts), so two builds that
    differ never share a folder. calibration: "proj-<hash>" / "calib-<hash>" when P does not come from the default
    calibration (build says which)."""
    return Path("engines") / "-".join([f"{model_name}-k{config.k_ratio:g}", *name_parts(config, o),
                                       *([calibration] if calibration else [])])


def name_parts(config: AquaConfig, o: BuildOptions) -> list[str]:
    """The parts of a default folder name after -k<R>: every setting that changes the built graph or engine, once it
    differs from its default (each mechanism's, settings/; each build option's, options.py)."""
    return settings.name_parts(config) + o.name_parts()


def calibration_tag(projection_path: str | None, calib_texts: list[str] | None, calib_tokens: int) -> str:
    """A default folder name's part for where P comes from: "" for the default calibration, else a short hash of
    the projection file, or of the calibration texts and token count."""
    if projection_path:
        return "proj-" + file_sha256(Path(projection_path))[:8]
    if calib_texts or calib_tokens != CALIB_TOKENS:
        texts = [t if t.startswith("builtin:") else file_sha256(Path(t)) for t in calib_texts or []]
        key = json.dumps([texts, calib_tokens])
        return "calib-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return ""


def _stage(i: int, text: str, total: int = STAGES) -> None:
    print(f"[{i}/{total}] {text}", flush=True)


def check_out_dir(out: Path, force: bool) -> None:
    """Never replace what this tool did not write: an existing non-empty --out must be a folder a build finished
    (its aqua_config.json lists the files it wrote), hold nothing else, and --force must be given."""
    check_writable(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder: choose another path")
    if not out.is_dir() or not any(out.iterdir()):
        return
    files = built_files(out)  # a folder an older aqua-export built is replaced as well
    if files is None:
        raise ConfigError(f"--out {out} is a folder with files this tool did not write (not one a build of "
                          "aqua-export finished): choose a new or empty folder")
    foreign = foreign_files(out, files)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(f"--out {out} holds files this tool did not write ({shown}): move them out or choose "
                          "another --out (nothing is replaced)")
    if not force:
        raise ConfigError(f"--out {out} holds a built folder already: pass --force to replace it, or choose "
                          "another --out")


def _estimated_bytes(model, o: BuildOptions) -> int:
    """What a folder of ``model`` built with ``o`` holds, about: its weights (plus a projection and a tokenizer, small);
    quantized: bits / 8 per weight plus a float32 scale per block."""
    params = sum(p.numel() for p in model.parameters())
    if o.weights.quantized:
        return int(params * (o.weights.bits / 8 + 4 / o.weights.block))
    return params * DTYPES[o.dtype].itemsize


def check_options(o: BuildOptions, config: AquaConfig) -> None:
    """Validate before any work: the options themselves (options.BuildOptions.check), then TensorRT's presence."""
    o.check(config)
    if o.runtime == "tensorrt":
        require_tensorrt()  # before any work: no TensorRT, one line and nothing written


def build(model_spec: str, config: AquaConfig, *, projection_path: str | None = None,
          calib_texts: list[str] | None = None, calib_tokens: int = CALIB_TOKENS, out: str | None = None,
          options: BuildOptions = BuildOptions()) -> Path:
    """Calibrate (or reuse ``projection_path``) -> export -> parity -> ``out``, atomically.

    options.external_data: True writes the weights to model.onnx.data whatever the size; None does so
    when they exceed what one ONNX protobuf holds. trt_limits: (max batch, max context, max prompt) of the
    TensorRT engine's optimization profiles."""
    o = options
    check_options(o, config)
    if projection_path and calib_texts:
        raise ConfigError("give either --projection or --calib-text, not both")
    if calib_tokens < 1:
        raise ConfigError(f"--calib-tokens {calib_tokens}: calibrate on 1 or more tokens (default {CALIB_TOKENS})")
    projection = load_projection(projection_path) if projection_path else None
    # what the model's config decides, before its weights load: the settings it takes, the projection's model, the
    # parity run in its context (harness.check_run)
    hf_config = models.load_config(model_spec)
    models.architecture_of(hf_config).check_settings(hf_config, config)
    if projection is not None:
        projection.check_config(hf_config)
    context = models.context_of(hf_config)
    o = dataclasses.replace(o, **dict(zip(("parity_prompt", "parity_steps"),
                                          parity_lengths(o.parity_prompt, o.parity_steps, context))))
    check_run(config, o.parity_prompt, o.parity_steps, context)
    out_dir = Path(out) if out else default_out(models.short_name(model_spec), config, o,
                                                calibration_tag(projection_path, calib_texts, calib_tokens))
    if out_dir.is_symlink():  # a link to a built folder (engines/current): that folder is what is replaced, the link
        out_dir = out_dir.resolve()  # stays (renaming the link itself away swapped it for a real folder)
    check_out_dir(out_dir, o.force)
    with claim(out_dir):  # a second build to the same --out fails now, not by replacing this one's folder
        check_out_dir(out_dir, o.force)  # what it holds may have changed before the claim
        _remove_leftovers(out_dir)
        return _build(model_spec, config, projection, projection_path, calib_texts, calib_tokens, out_dir, o)


def _leftover(out: Path, entry: Path) -> bool:
    """Whether ``entry`` beside ``out`` is a build's temporary folder for ``out``: ``.<name>.<8 of mkdtemp's
    characters>.tmp`` (the folder being assembled) or ``.<name>.old-<pid>`` (the folder being replaced)."""
    name = re.escape(out.name)
    return bool(re.fullmatch(rf"\.{name}\.[a-z0-9_]{{8}}\.tmp|\.{name}\.old-\d+", entry.name)) and entry.is_dir()


def _remove(path: Path) -> None:
    """A folder, or a link (which rmtree refuses: an older build renamed a linked --out away and left it)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _remove_leftovers(out: Path) -> None:
    """What a build to ``out`` that was killed (SIGKILL, a power cut: no cleanup ran) left beside it. Called under
    the claim on ``out``, so no live build of it owns any."""
    for entry in sorted(out.parent.iterdir()) if out.parent.is_dir() else []:
        if _leftover(out, entry):
            print(f"[aqua-export] removing {entry}, left by a build of {out} that was killed", flush=True)
            _remove(entry)


def _build(model_spec, config, projection, projection_path, calib_texts, calib_tokens, out_dir: Path,
           o: BuildOptions) -> Path:
    meter = StageMeter()
    total = STAGES + (o.runtime == "tensorrt")
    _stage(1, f"loading {model_spec}", total)
    meter.start("load")
    model, tok = models.load(model_spec, dtype="auto")  # the checkpoint's own dtype: no float32 copy
    check_free_space(out_dir.parent, _estimated_bytes(model, o), f"the folder {out_dir}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    calib_texts = calib_texts or ["builtin:python-reference"]
    try:
        _stage(2, "projection: " + (f"reusing {projection_path}" if projection else
                                   f"calibrating on {', '.join(calib_texts)}"), total)
        meter.start("calibrate")
        if projection is None:
            tensors, meta = calibrate.calibrate(model, tok, texts=calib_texts, tokens=calib_tokens)
            write_projection(tmp / "projection.safetensors", tensors, meta)
            projection = load_projection(tmp / "projection.safetensors")
        else:
            projection.check_model(model)
            shutil.copyfile(projection_path, tmp / "projection.safetensors")
        if config.slice_alloc == "measured" and config.slice_ratio and projection.slice_cost is None:
            projection = add_costs(model, tok, projection, tmp / "projection.safetensors", calib_texts)
        if config.allocates_k and config.k_alloc == "measured" and not projection.has_select_costs(config.selection):
            projection = add_select_costs(model, tok, projection, tmp / "projection.safetensors", calib_texts,
                                          config.selection)
        d = models.attention_geometry(model)["head_dim"]
        spread = f", spread by --k-alloc {config.k_alloc}" if config.allocates_k else ""
        _stage(3, f"exporting ONNX (k={config.selected_width(d)} of r={config.retained_width(d)}{spread})", total)
        meter.start("export")
        cfg = export_folder(model, tok, projection, config, o, tmp, model_spec)
        # one model in memory at a time: the PyTorch model goes while ONNX Runtime runs, and comes back after
        del model
        gc.collect()
        prompt = prompt_length(config, o.parity_prompt, o.parity_steps, cfg.context_length)
        longer = ", longer than asked so that token selection leaves pages out" if prompt > o.parity_prompt else ""
        _stage(4, f"parity: ONNX Runtime vs the PyTorch reference ({prompt}-token prompt{longer}, "
                  f"{o.parity_steps} decode steps)", total)
        meter.start("parity")
        _parity(tmp, cfg, tok, projection, config, o, model_spec)
        if o.runtime == "tensorrt":

            _stage(5, f"building the TensorRT engine (batch <= {o.trt_limits[0]}, context <= {o.trt_limits[1]}, "
                      f"prompt <= {o.trt_limits[2]})", total)
            meter.start("tensorrt")
            build_engine(tmp, *o.trt_limits)
        meter.stop()
        _stage(total, f"writing {out_dir}", total)
        dataclasses.replace(cfg, info={**cfg.info, "resources": meter.report()}).seal(tmp)
        check_out_dir(out_dir, force=True)  # still nothing of a user's in it
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_folder(model, tok, projection, config: AquaConfig, o: BuildOptions, tmp: Path, model_spec: str) -> FolderConfig:
    """Write model.onnx (+ .data), the tokenizer, aqua_config.json and the onnxruntime-genai files into ``tmp``."""
    geo = models.attention_geometry(model)
    bar = stage_bar(geo["layers"], "export", "layer")
    proto = export_onnx(model, projection, config, tmp / "model.onnx", dtype=DTYPES[o.dtype],
                        external_data=o.external_data, progress=lambda i, n: bar.update(1),
                        fused=o.runtime != "tensorrt", weights=o.weights, cache_dtype=o.cache_dtype, ops=o.ops)
    bar.close()
    write_tokenizer(tok, tmp)
    contract = contract_for(model, config, DTYPES[o.dtype], projection, o.cache_dtype, o.runtime != "tensorrt")
    cfg = FolderConfig(model=model_spec, aqua=config, geometry=Geometry(**geo), contract=contract,
                       context_length=getattr(model.config, "max_position_embeddings", None),
                       fingerprint=models.fingerprint(model), info=_info(proto, contract, config, o, tmp),
                       weights=o.weights)
    # written now for stages that read the folder (TensorRT); rewritten at the end with the resources used
    cfg.write(tmp)
    genai.write_files(tmp, cfg, model.config, getattr(model, "generation_config", None), tok)
    return cfg


def _weighted_fold(contract) -> str:
    """The info line of a weighted rule's fold (fold.selection_bases)."""
    where = (f"P (q^ * w; the int8 cache holds k^ / w^{INT8_KEY_SPLIT}, divided by AquaAttention's key_weights)"
             if contract.cache_dtype == "int8" else "P (q^ * w, k^ / w)")
    return f"rms(k^) folded into {where}: the weighted rule as magnitude"


def _info(proto, contract, config: AquaConfig, o: BuildOptions, tmp: Path) -> dict:
    """aqua_config.json's info: what the graph holds and how it was made, in words."""
    import onnx
    import onnxruntime  # only its version: the build stage runs it for parity anyway
    import transformers

    info = {
        "layout": contract.layout(),
        "operators": {op.name: sum(1 for n in proto.graph.node if n.op_type == op.name) for op in OPS},
        "plugin": {"namespace": PLUGIN_NAMESPACE, "version": PLUGIN_VERSION},
        "passes": ["fold attention scale into W_Q", "fold P_v / P_v^T into W_V / W_O (sliced to r)",
                   "P after RoPE (cannot fold under rotary embeddings)",
                   *([_weighted_fold(contract)] if config.weighted_selection and config.k_ratio < 1 else []),
                   "H2OAttention per layer" if config.evicts else
                   "AquaAttention per layer" if o.runtime != "tensorrt" else
                   "TopKGatherDot, Softmax, ValueProduct per layer"],
        "graph_ops": o.ops,
        "weights": "model.onnx.data (external data)" if (tmp / "model.onnx.data").exists() else "inline in model.onnx",
        **{p.key: p.value for p in proto.metadata_props if p.key == "float16_cast"},
        "tools": {"aqua-export": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                  "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
    }
    if config.slice_alloc != "uniform" and config.slice_ratio:
        info["slice_alloc"] = (f"{config.slice_alloc}: layer widths chosen where slicing costs least, the cache's bytes "
                               "those of uniform slicing (allocate.py); onnxruntime-genai takes one width: --runtime aqua")
    if config.allocates_k:
        info["k_alloc"] = (f"{config.k_alloc}: k per layer chosen where a narrower selection costs least, their sum "
                           "uniform's (allocate.py): " + ", ".join(map(str, contract.selected)))
    if config.evicts:
        info["h2o"] = ("eviction inside the graph (H2OAttention, fixed-capacity slots updated in place): keep "
                       "ceil(ratio*n) per sequence and KV head, floor(half) the most recent, the rest by accumulated "
                       "attention; a prompt is one forward, evicting as token-by-token decoding does")
    if o.weights.quantized:
        zero = "symmetric" if o.weights.symmetric else "with zero points"
        info["weights"] += f"; {WEIGHT_CHOICES.format(fmt=o.weights, zero=zero)}"
    return info


def _parity(tmp: Path, cfg: FolderConfig, tok, projection, config: AquaConfig, o: BuildOptions, model_spec: str) -> None:

    res = run_parity(tmp / "model.onnx", cfg, tok, projection, config, lambda: models.load(model_spec, dtype="auto")[0],
                     prompt_tokens=o.parity_prompt, steps=o.parity_steps, dtype=o.dtype, kernel=default_kernel(o.dtype),
                     progress=lambda text: print(f"      ... {text}", flush=True))
    atomic_write_bytes(tmp / "parity.json", json.dumps(res, indent=1, sort_keys=True).encode())
    for line in summary_lines(res):
        print(f"      {line}")
    if not res["pass"]:
        raise ConfigError("parity failed (see numbers above): the export does not match the reference")


def _replace_dir(tmp: Path, out: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the folder is meant to be shared/served
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    with critical():  # a signal between the two renames would leave no folder at --out
        os.replace(out, old)
        os.replace(tmp, out)
    _remove(old)
