"""The one-command build: calibrate (or reuse) -> export -> parity -> a ready-to-serve folder, atomically.

Folder contents: model.onnx (+ model.onnx.data when large), projection.safetensors, aqua_config.json,
the tokenizer files, parity.json. It is assembled in a temporary sibling folder and renamed into
place only when every stage succeeded, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from . import __version__, calibrate, models
from .config import AquaConfig, ConfigError
from .safetensors_io import check_writable_parent

STAGES = 5

LAYOUT_WHY = ("K^ is stored dim-major [batch, kv_heads, r, past]: selecting coordinate c of every cached key "
              "reads one contiguous row of `past` values, so a fused TopKGatherDot kernel reads only k/r of the "
              "K cache; a row-major [past, r] cache turns selection into a strided gather (SparQ measured this "
              "as slow). V stays [batch, kv_heads, past, r]: the value product reads whole rows.")


def default_out(model_name: str, config: AquaConfig) -> Path:
    name = f"{model_name}-k{config.k_ratio:g}"
    if config.slice_ratio:
        name += f"-s{config.slice_ratio:g}"
    if config.h2o_ratio < 1:
        name += f"-h{config.h2o_ratio:g}"
    return Path("engines") / name


KV_CACHE_WHY = {
    "shared": ("past_key_values.{i}.* and present.{i}.* are one buffer of capacity C (bound to both with IOBinding); "
               "the graph writes the new entries at cache_position (ScatterElements, done in place) and attends "
               "over the C slots with attention_mask [B, C] masking the unused ones: no copy of the cache per "
               "step (runtime.SharedCache grows C in steps of 256)"),
    "concat": "present = Concat(past, new): new tensors every step (simple I/O; H2O and TensorRT use it)",
}


def _stage(i: int, text: str, total: int = STAGES) -> float:
    print(f"[{i}/{total}] {text}", flush=True)
    return time.perf_counter()


def check_out_dir(out: Path) -> None:
    check_writable_parent(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder: choose another path")


def build(model_spec: str, config: AquaConfig, *, projection_path: str | None = None,
          calib_texts: list[str] | None = None, calib_tokens: int = 16384, out: str | None = None,
          dtype: str = "float32", backend: str = "onnx", parity_steps: int = 64, parity_prompt: int = 256,
          trt_limits: tuple[int, int, int] = (8, 4096, 1024), kv_cache: str = "auto") -> Path:
    """trt_limits: (max batch, max context, max prompt) of the TensorRT engine's optimization profiles.
    kv_cache: "shared" (past/present one buffer, updated in place by ONNX Runtime), "concat" (present =
    past + new), "auto" = shared unless H2O (which compacts its cache) or TensorRT (engine I/O is concat)."""
    if parity_prompt < 16 or parity_steps < 1:
        raise ConfigError("--parity-prompt-tokens must be >= 16 and --parity-steps >= 1")
    if kv_cache == "auto":
        kv_cache = "concat" if config.h2o_ratio < 1 or backend == "tensorrt" else "shared"
    if kv_cache not in ("concat", "shared"):
        raise ConfigError(f"unknown --kv-cache {kv_cache!r}: use auto, shared or concat")
    if kv_cache == "shared" and config.h2o_ratio < 1:
        raise ConfigError("AQUA-H2O compacts its cache between tokens: use --kv-cache concat (or auto) with --h2o-ratio")
    if kv_cache == "shared" and backend == "tensorrt":
        raise ConfigError("the TensorRT engine runner uses --kv-cache concat: drop --kv-cache shared")
    if backend == "tensorrt":
        from .tensorrt_backend import require_tensorrt

        require_tensorrt()  # before any work: no TensorRT, one line and nothing written
    elif backend != "onnx":
        raise ConfigError(f"unknown --backend {backend!r}: use onnx or tensorrt")
    dtypes = {"float32": torch.float32, "float16": torch.float16}
    if dtype not in dtypes:
        raise ConfigError(f"unknown --dtype {dtype!r}: use float32 or float16")
    if projection_path and calib_texts:
        raise ConfigError("give either --projection or --calib-text, not both")
    projection = calibrate.load_projection(projection_path) if projection_path else None
    out_dir = Path(out) if out else default_out(models.short_name(model_spec), config)
    check_out_dir(out_dir)

    t0 = _stage(1, f"loading {model_spec}")
    model, tok = models.load(model_spec)
    t_load = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        t0 = _stage(2, "projection: " + (f"reusing {projection_path}" if projection else
                                        f"calibrating on {', '.join(calib_texts or ['builtin:python-reference'])}"))
        if projection is None:
            tensors, meta = calibrate.calibrate(model, tok, texts=calib_texts or ["builtin:python-reference"],
                                                tokens=calib_tokens)
            calibrate.write(tmp / "projection.safetensors", tensors, meta)
            projection = calibrate.load_projection(tmp / "projection.safetensors")
        else:
            projection.check_model(model)
            shutil.copyfile(projection_path, tmp / "projection.safetensors")
        t_cal = time.perf_counter() - t0

        d = models.attention_geometry(model)["head_dim"]
        t0 = _stage(3, f"exporting ONNX (k={config.selected_width(d)} of r={config.retained_width(d)})")
        from .export import DOMAIN, OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION, export_onnx, io_names

        proto = export_onnx(model, projection, config, tmp / "model.onnx", dtype=dtypes[dtype], kv_cache=kv_cache)
        t_export = time.perf_counter() - t0
        tok.save_pretrained(tmp)
        geo = models.attention_geometry(model)
        import onnx
        import onnxruntime
        import transformers

        cfg = {
            "format_version": 1,
            "model": model_spec,
            "aqua": config.to_dict(),
            "fingerprint": models.fingerprint(model),
            "geometry": geo,
            "dtype": dtype,
            "cache": {"width": config.retained_width(d), "selected": config.selected_width(d), "kv_cache": kv_cache,
                      "kv_cache_why": KV_CACHE_WHY[kv_cache],
                      "key_layout": "[batch, kv_heads, r, past] dim-major K^ = RoPE(k) @ P[:, :r]",
                      "value_layout": "[batch, kv_heads, past, r] values in P_v's basis (folded into W_V / W_O)",
                      "why_dim_major": LAYOUT_WHY,
                      **({"h2o": {"ratio": config.h2o_ratio,
                                  "valid_layout": "past_key_values.{i}.valid [batch, kv_heads, past] bool: slot live",
                                  "weights": "attention_weights.{i} [batch, kv_heads, T, past+T]: softmax summed over "
                                             "the group's query heads",
                                  "eviction": "runtime, between tokens (runtime.H2OCache): keep ceil(ratio*n) per "
                                              "sequence, floor(half) most recent, the rest by accumulated weights; "
                                              "the graph runs one token per forward"}}
                         if config.h2o_ratio < 1 else {})},
            "operator": {"domain": DOMAIN, "op_type": OP_TYPE, "plugin_namespace": PLUGIN_NAMESPACE,
                         "plugin_version": PLUGIN_VERSION, "nodes": sum(1 for n in proto.graph.node if n.op_type == OP_TYPE)},
            "io": dict(zip(("inputs", "outputs"), io_names(geo["layers"], config.h2o_ratio < 1, kv_cache == "shared"))),
            "passes": ["fold attention scale into W_Q", "fold P_v / P_v^T into W_V / W_O (sliced to r)",
                       "P after RoPE (cannot fold under rotary embeddings)", "TopKGatherDot per layer"],
            "tools": {"aqua-export": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                      "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
            "timings_s": {"load": round(t_load, 1), "calibrate": round(t_cal, 1), "export": round(t_export, 1)},
        }
        (tmp / "aqua_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))

        t0 = _stage(4, f"parity: ONNX Runtime vs the PyTorch reference ({parity_prompt}-token prompt, "
                       f"{parity_steps} decode steps)")
        from .parity import run_parity
        from .runtime import OrtLM, make_session

        from .runtime import default_kernel

        kernel = default_kernel(dtype)
        lm = OrtLM(make_session(tmp / "model.onnx", kernel=kernel), cfg)
        res = run_parity(lm, model, tok, projection, config, proto, prompt_tokens=parity_prompt, steps=parity_steps,
                         dtype=dtype, kernel=kernel)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / "parity.json").write_text(json.dumps(res, indent=1, sort_keys=True))
        r = res["ort_vs_reference"]
        print(f"      ORT vs reference: max |dlogit| prefill {r['max_abs_logit_diff_prefill']:.2e}, decode "
              f"{r['max_abs_logit_diff_decode']:.2e}, top-1 {r['top1_agreement']:.3f}")
        sel = res["selection"]
        if "rows" in sel and sel.get("gated") is False:
            print(f"      selection: {sel['rows_differing']} of {sel['rows']} query rows ranked differently from the "
                  f"float32 reference (float16 rounding of q^); greedy tokens identical: {sel['pass']}")
        elif "rows" in sel:
            print(f"      selection: {sel['rows_differing']} of {sel['rows']} query rows chose differently, all float "
                  f"near-ties (largest gap {sel['max_gap_of_differing']:.1e} <= {res['near_tie']:.0e})"
                  if sel["pass"] else f"      selection: differing rows are not near-ties (gap {sel['max_gap_of_differing']:.1e})")
        if "eviction" in res:
            e = res["eviction"]
            print(f"      H2O eviction (replayed from ORT): the reference's own choice differs in {e['decisions_differing']} "
                  f"of {e['decisions']} decisions, largest accumulator gap {e['max_gap_of_differing']:.1e}")
        if "native_vs_function_body" in res:
            n = res["native_vs_function_body"]
            print(f"      native kernel vs function body: max |dlogit| prefill {n['max_abs_logit_diff_prefill']:.2e}, "
                  f"decode {n['max_abs_logit_diff_decode']:.2e}, top-1 {n['top1_agreement']:.3f}")
        if "pass" in res["ort_k1_vs_hf"]:
            h = res["ort_k1_vs_hf"]
            ref = h.get("reference", "HF transformers in float32, same graph with k = r")
            print(f"      ORT at k=r vs {ref}: max |dlogit| prefill {h['max_abs_logit_diff_prefill']:.2e}, decode "
                  f"{h['max_abs_logit_diff_decode']:.2e}, top-1 {h['top1_agreement']:.3f}")
            if "hf_float32_vs_hf_float64" in res:
                a, b = res["ort_k1_vs_hf_float32"], res["hf_float32_vs_hf_float64"]
                print(f"      (ORT vs HF float32: {a['max_abs_logit_diff_prefill']:.2e}; HF float32 vs float64: "
                      f"{b['max_abs_logit_diff_prefill']:.2e})")
        if not res["pass"]:
            raise ConfigError("parity failed (see numbers above): the export does not match the reference")

        if backend == "tensorrt":
            from .tensorrt_backend import build_engine

            _stage(5, f"building the TensorRT engine (batch <= {trt_limits[0]}, context <= {trt_limits[1]}, "
                      f"prompt <= {trt_limits[2]})", STAGES + 1)
            build_engine(tmp, *trt_limits)
        _stage(STAGES + (backend == "tensorrt"), f"writing {out_dir}", STAGES + (backend == "tensorrt"))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(tmp: Path, out: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the folder is meant to be shared/served
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
