"""Command line.

    aqua-export --model M --k-ratio R [...]        build a ready-to-serve folder (the main job)
    aqua-export {calibrate,eval,lm-eval,retention,run,bench,parity} ...

Every bad input ends in one line on stderr, ``aqua-export: error: ...``, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import AquaConfig, ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``aqua-export: error: ...`` line (exit 2) like every other error."""

    def error(self, message):
        self.exit(2, f"aqua-export: error: {message} (see {self.prog} --help)\n")


def _model_arg(p):
    p.add_argument("--model", default="llama", help="HF model id (org/name), local HF folder, .gguf file, or 'llama' "
                                                    "(the embedded SmolLM2-135M-Instruct; default)")


def _config_args(p, k_default: float = 1.0):
    from .config import SELECTIONS, SLICE_ALLOCS

    p.add_argument("--k-ratio", type=float, default=k_default,
                   help="share of the retained width r whose coordinates score each query, in (0, 1]; 1 = dense "
                        "(default %(default)s)")
    p.add_argument("--slice-ratio", type=float, default=0.0,
                   help="AQUA-Memory: share of P's trailing columns dropped before K and V are cached, in [0, 1) "
                        "(default %(default)s)")
    p.add_argument("--h2o-ratio", type=float, default=1.0,
                   help="AQUA-H2O: share of tokens kept in the cache, in (0, 1]; 1 = no eviction (default %(default)s)")
    p.add_argument("--selection", default="magnitude", choices=SELECTIONS,
                   help="how coordinates are chosen: magnitude (top-k |q^|, the paper), static (first k), weighted "
                        "(top-k |q^_i| * rms(k^_i)), group / group-weighted (one top-k of the GQA group's summed "
                        "scores for all its query heads: a step reads exactly k of K^'s rows); every rule is exported "
                        "(default %(default)s)")
    p.add_argument("--slice-alloc", default="uniform", choices=SLICE_ALLOCS,
                   help="how AQUA-Memory spends its width budget over the layers' K^ and V (the same cache bytes as "
                        "uniform slicing): uniform (every K^ and V drops --slice-ratio), energy (water-filling on the "
                        "calibrated spectra), measured (on measured costs of slicing: the projection's slice costs, "
                        "measured by the build or `calibrate --slice-costs`) (default %(default)s)")


def _window_args(p, tokens: int, what: str):
    p.add_argument("--tokens", type=int, default=tokens, help=f"tokens of text to {what}, >= 1 (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="window length in tokens, >= 2; each window starts fresh "
                                                            "(default %(default)s)")


def _config(a) -> AquaConfig:
    return AquaConfig(k_ratio=a.k_ratio, slice_ratio=a.slice_ratio, h2o_ratio=a.h2o_ratio, selection=a.selection,
                      slice_alloc=a.slice_alloc)


def _check_out_file(path: str) -> Path:
    """Fail before any work if the output cannot be written (the write itself is atomic)."""
    from .safetensors_io import check_writable_parent

    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give a file path")
    check_writable_parent(out)
    return out


def _process_group():
    """Under torchrun (WORLD_SIZE > 1): join the job's process group, NCCL when this rank has a GPU, else gloo."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.group.WORLD


def cmd_calibrate(a) -> int:
    from . import calibrate, models

    out = _check_out_file(a.out)
    max_memory = models.parse_max_memory(a.max_memory)
    if max_memory and not a.device_map:
        raise ConfigError("--max-memory needs --device-map (e.g. --device-map auto)")
    group = _process_group()
    import tempfile

    offload = tempfile.TemporaryDirectory(prefix="aqua-offload-") if a.device_map else None
    try:
        # the checkpoint's own dtype (computed in float32 layer by layer), or float32 where accelerate places it
        import torch

        model, tok = models.load(a.model, dtype=torch.float32 if a.device_map else "auto", device_map=a.device_map,
                                 max_memory=max_memory, offload_folder=offload.name if offload else None)
        if group is not None:
            import torch

            if torch.cuda.is_available():
                model.to(f"cuda:{torch.cuda.current_device()}")
        res = calibrate.calibrate(model, tok, texts=a.text or None, tokens=a.tokens, seq_len=a.seq_len,
                                  seed=a.seed, progress=not a.quiet, group=group)
        if res is not None:  # rank 0 (or the only process) writes
            tensors, meta = res
            calibrate.write(out, tensors, meta)
            if a.slice_costs:
                from .allocate import add_costs

                add_costs(model, tok, calibrate.load_projection(out), out, a.text or ["builtin:python-reference"],
                          progress=not a.quiet)
            print(f"wrote {out} ({meta['tokens']} tokens of {meta['corpus']}{', slice costs' if a.slice_costs else ''})")
    finally:
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        if offload is not None:
            offload.cleanup()
    return 0


def cmd_eval(a) -> int:
    from . import calibrate, corpus, evaluate, models

    cfg = _config(a)
    projection = calibrate.load_projection(a.projection) if a.projection else None
    text = corpus.read_text(a.text)
    model, tok = models.load(a.model)
    res = evaluate.perplexity(model, tok, text, tokens=a.tokens, seq_len=a.seq_len, projection=projection,
                              config=cfg, progress=not a.json)
    res["model"] = a.model
    res["text"] = a.text
    if a.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(f"perplexity {res['perplexity']:.4f} over {res['predicted_tokens']} predicted tokens "
              f"({res['windows']} windows of {a.seq_len}) with {cfg.to_json()}")
    return 0


def cmd_lm_eval(a) -> int:
    from .lm_eval_model import AquaLM, evaluate

    with AquaLM(model=a.model, folder=a.folder, projection=a.projection, k_ratio=a.k_ratio, slice_ratio=a.slice_ratio,
                h2o_ratio=a.h2o_ratio, selection=a.selection, slice_alloc=a.slice_alloc, threads=a.threads,
                kernel=a.kernel, batch_size=a.batch_size) as lm:
        res = evaluate(lm, [t for t in a.tasks.split(",") if t], a.include_path, a.limit)
    if a.json:
        print(json.dumps({"results": res["results"], "config": lm.aqua_config.to_dict(), "model": a.model,
                          "folder": a.folder, "limit": a.limit}, sort_keys=True, default=float))
    else:
        from lm_eval.utils import make_table

        print(make_table(res))
    return 0


def cmd_retention(a) -> int:
    from . import calibrate, corpus, evaluate, models
    from .safetensors_io import atomic_write_bytes

    AquaConfig(k_ratio=a.k_ratio)
    projection = calibrate.load_projection(a.projection)
    text = corpus.read_text(a.text)
    model, tok = models.load(a.model)
    projection.check_model(model)
    rep = evaluate.retention_report(model, tok, text, projection, tokens=a.tokens, seq_len=a.seq_len, k_ratio=a.k_ratio)
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: retention writes a folder (retention.json, retention.png); "
                          "give a folder path")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "retention.json", json.dumps(rep, indent=1, sort_keys=True).encode())
    tmp_png = out / ".retention.png.tmp.png"
    evaluate.plot_retention(rep, tmp_png)
    tmp_png.replace(out / "retention.png")
    for k, v in rep["mean"].items():
        print(f"{k:20s} mean retention loss {v:.4f}")
    print(f"wrote {out / 'retention.json'} and {out / 'retention.png'}")
    return 0


def cmd_run(a) -> int:
    from .backends import open_lm
    from .runtime import SamplingConfig, encode_prompts, load_tokenizer

    sampling = SamplingConfig(max_new_tokens=a.max_new_tokens, do_sample=a.sample, temperature=a.temperature,
                              top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    if a.backend == "tensorrt" and a.runtime != "aqua":
        raise ConfigError("--backend tensorrt runs in this project's loop: drop --runtime genai")
    lm = open_lm(a.folder, "tensorrt" if a.backend == "tensorrt" else a.runtime, kernel=a.kernel,
                 share_buffer=a.kv_buffer == "shared")
    tok = load_tokenizer(a.folder)
    ids, mask = encode_prompts(tok, a.prompt, chat=a.chat, context=lm.cfg.context_length,
                               max_new_tokens=a.max_new_tokens)
    if a.backend == "tensorrt":
        from .backends.tensorrt import check_request

        check_request(lm.session.profiles, ids.shape[0], ids.shape[1], a.max_new_tokens)
    eos = tok.eos_token_id
    if len(a.prompt) == 1:
        shown = [""]
        got: list[int] = []

        def stream(step, nxt):
            got.append(int(nxt[0]))
            text = tok.decode(got, skip_special_tokens=True)
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

        lm.generate(ids, mask, sampling, eos_token_id=eos, on_token=stream)
        print()
    else:
        out = lm.generate(ids, mask, sampling, eos_token_id=eos)
        for p, row in zip(a.prompt, out):
            print(f"--- {p!r}\n{tok.decode(row, skip_special_tokens=True)}")
    return 0


def cmd_bench(a) -> int:
    from .bench import bench, table

    res = bench(a.folders, context=a.context, batch=a.batch, runtime=a.runtime, steps=a.steps, rounds=a.rounds,
                threads=a.threads, capacity=a.capacity, prefill=a.prefill)
    print(json.dumps(res, sort_keys=True) if a.json else table(res))
    return 0


def cmd_parity(a) -> int:
    from . import calibrate, models
    from .folder import FolderConfig
    from .parity import run_parity
    from .runtime import default_kernel, load_tokenizer

    cfg = FolderConfig.from_folder(a.folder)
    kernel = a.kernel if a.kernel != "auto" else default_kernel(cfg.dtype)
    path = Path(a.folder) / "model.onnx"
    if not path.is_file():
        raise ConfigError(f"{a.folder} has no model.onnx: rebuild the folder")
    proj = calibrate.load_projection(Path(a.folder) / "projection.safetensors")
    # the reference model is loaded only after the ONNX Runtime runs: one model in memory at a time
    res = run_parity(path, cfg, load_tokenizer(a.folder), proj, cfg.aqua,
                     lambda: models.load(cfg.model, dtype="auto")[0], steps=a.steps, dtype=cfg.dtype, kernel=kernel,
                     progress=None if a.json else lambda text: print(f"... {text}", flush=True))
    if a.json:
        print(json.dumps(res, sort_keys=True))
    else:
        from .parity import summary_lines

        print("\n".join(summary_lines(res)))
    return 0 if res["pass"] else 1


def build_arg_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aqua-export", description="Build a ready-to-serve AQUA model folder: calibrate "
                                 "(or reuse a projection), export ONNX, check parity, write the folder atomically. "
                                 "Subcommands: calibrate, eval, retention, run, parity (aqua-export --help lists them).")
    _model_arg(ap)
    _config_args(ap)
    ap.add_argument("--projection", help="reuse this calibrated projection (.safetensors) instead of calibrating")
    ap.add_argument("--calib-text", action="append", help="calibration text: a plain-text or JSONL file, or "
                    "builtin:python-reference | builtin:gpl-3 (repeatable; default builtin:python-reference)")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens, >= 1 (default %(default)s)")
    ap.add_argument("--out", help="output folder (default engines/<model>-k<R>, plus a suffix per non-default setting: "
                                  "-s<S> -h<H> -<selection> -<dtype> -tensorrt); an existing non-empty "
                                  "folder is refused")
    ap.add_argument("--force", action="store_true", help="replace --out when it is a folder this tool built")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                    help="weights, activations and KV cache of the export (default %(default)s)")
    ap.add_argument("--backend", default="onnx", choices=["onnx", "tensorrt"],
                    help="tensorrt also builds model.engine (needs TensorRT and an NVIDIA GPU)")
    ap.add_argument("--trt-max-batch", type=int, default=8, help="TensorRT profiles: largest batch (default %(default)s)")
    ap.add_argument("--trt-max-context", type=int, default=4096,
                    help="TensorRT profiles: largest context in tokens (default %(default)s)")
    ap.add_argument("--trt-max-prompt", type=int, default=1024,
                    help="TensorRT profiles: longest prompt in tokens (default %(default)s)")
    ap.add_argument("--external-data", action="store_true",
                    help="write the weights to model.onnx.data beside model.onnx whatever the model's size (they go "
                         "there anyway past ONNX's 2 GB protobuf limit)")
    ap.add_argument("--parity-steps", type=int, default=64, help="greedy decode steps of the parity check, >= 1 "
                                                                "(default %(default)s)")
    ap.add_argument("--parity-prompt-tokens", type=int, default=256,
                    help="real-text prompt length of the parity check, >= 16 (default %(default)s)")
    return ap


def build_main(argv: list[str]) -> int:
    a = build_arg_parser().parse_args(argv)
    from .build import BuildOptions, build

    opts = BuildOptions(dtype=a.dtype, backend=a.backend,
                        external_data=True if a.external_data else None, parity_steps=a.parity_steps,
                        parity_prompt=a.parity_prompt_tokens,
                        trt_limits=(a.trt_max_batch, a.trt_max_context, a.trt_max_prompt), force=a.force)
    out = build(a.model, _config(a), projection_path=a.projection, calib_texts=a.calib_text,
                calib_tokens=a.calib_tokens, out=a.out, options=opts)
    print(f"ready: {out}  (try: aqua-export run {out} --prompt \"Hello\" --chat)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aqua-export", description="AQUA attention for Hugging Face decoder LLMs. The "
                                 "main job, a ready-to-serve folder: aqua-export --model M --k-ratio R [...] (its "
                                 "options follow the subcommands below).")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("calibrate", help="compute the projection artifact")
    _model_arg(p)
    p.add_argument("--text", action="append", help="plain-text/JSONL file or builtin:NAME (repeatable); default: "
                                                    "text the model generates itself from --seed")
    _window_args(p, 16384, "calibrate on")
    p.add_argument("--seed", type=int, default=0, help="seed of the self-generated text (default %(default)s)")
    p.add_argument("--out", required=True, help="the projection file to write (.safetensors)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device-map", help="accelerate placement for a model larger than one device: auto (GPUs, then "
                                        "CPU, then disk), cpu, or a device; data-parallel: run under torchrun")
    p.add_argument("--max-memory", help="per-device limits for --device-map, e.g. cpu=2GiB,0=20GiB")
    p.add_argument("--slice-costs", action="store_true",
                   help="also measure each layer's cost of slicing its K^ and its V (for --slice-alloc measured): 12 "
                        "cuts per layer, a 1,024-token forward each, on --text (default builtin:python-reference)")
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("eval", help="perplexity with or without AQUA")
    _model_arg(p)
    p.add_argument("--projection", help="projection file (needed unless dense: --k-ratio 1, no slicing or eviction)")
    _config_args(p)
    p.add_argument("--text", required=True, help="text to evaluate: file or builtin:NAME")
    _window_args(p, 8192, "evaluate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on the PyTorch reference or a built folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="as for eval: HF model id, local folder, .gguf, or 'llama' (the PyTorch "
                                     "reference, AQUA applied with --projection and the settings below)")
    src.add_argument("--folder", help="a folder built by aqua-export, run by ONNX Runtime (its own AQUA settings)")
    p.add_argument("--projection", help="projection file (with --model; needed unless dense)")
    _config_args(p)
    p.add_argument("--tasks", default="aqua_local", help="comma-separated lm_eval tasks or groups; aqua_local (the "
                   "offline tasks: aqua_lastword, aqua_choice, aqua_rolling, aqua_copy) needs no network; hub tasks "
                   "need their datasets in the Hugging Face cache (default %(default)s)")
    p.add_argument("--include-path", help="a folder of extra task YAML files (lm_eval's --include_path)")
    p.add_argument("--limit", type=float, help="items per task (a count, or a share when < 1)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads with --folder; 0 = all "
                                                          "(default %(default)s)")
    p.add_argument("--kernel", default="auto", choices=["auto", "native", "function"],
                   help="with --folder: the native kernels (auto: when built) or the function bodies")
    p.add_argument("--json", action="store_true", help="print one JSON object (lm_eval's results per task)")
    p.set_defaults(fn=cmd_lm_eval)

    p = sub.add_parser("retention", help="information retention loss per layer/head, JSON + PNG")
    _model_arg(p)
    p.add_argument("--projection", required=True, help="projection file")
    p.add_argument("--text", required=True, help="text to measure on: file or builtin:NAME")
    p.add_argument("--k-ratio", type=float, default=0.5, help="k_ratio whose retention is measured, in (0, 1] "
                                                              "(default %(default)s)")
    _window_args(p, 4096, "measure on")
    p.add_argument("--out", required=True, help="output folder (retention.json, retention.png)")
    p.set_defaults(fn=cmd_retention)

    p = sub.add_parser("run", help="generate with ONNX Runtime from a built folder")
    p.add_argument("folder", help="a folder built by aqua-export")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, >= 0 (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--backend", default="onnx", choices=["onnx", "tensorrt"],
                   help="onnx: ONNX Runtime; tensorrt: the folder's model.engine (default %(default)s)")
    p.add_argument("--kernel", default="auto", choices=["auto", "native", "function"],
                   help="TopKGatherDot: the native C++ kernel (auto: when built) or the model's function body")
    p.add_argument("--runtime", default="aqua", choices=["aqua", "genai"],
                   help="aqua: this project's ONNX Runtime loop (every variant); genai: onnxruntime-genai (not "
                        "AQUA-H2O folders) (default %(default)s)")
    p.add_argument("--kv-buffer", default="shared", choices=["shared", "concat"],
                   help="shared: past and present one buffer written in place (genai's past_present_share_buffer); "
                        "concat: a new present each step (default %(default)s)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("bench", help="decode tokens/s and decode memory of built folders, measured interleaved")
    p.add_argument("folders", nargs="+", help="folders built by aqua-export (or by onnxruntime-genai's builder, "
                                              "with --runtime genai)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in the cache (default %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default %(default)s)")
    p.add_argument("--runtime", default="aqua", choices=["aqua", "genai", "genai-io"],
                   help="aqua: this project's loop, the context written into the cache; genai: onnxruntime-genai, "
                        "the context prefilled through it; genai-io: the graph driven with onnxruntime-genai's I/O, "
                        "the context written into its buffers (default %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the folders (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default %(default)s)")
    p.add_argument("--capacity", type=int, default=0, help="cache slots to allocate, as genai's max_length would "
                   "(aqua, genai-io; 0 = just enough): a step's cost should not depend on it (default %(default)s)")
    p.add_argument("--prefill", type=int, default=0, help="time whole prompts of this many tokens from an empty "
                   "cache instead of decode steps (runtime aqua; 0 = decode) (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("parity", help="ONNX Runtime vs the PyTorch reference (and vs HF at k = r)")
    p.add_argument("folder", help="a folder built by aqua-export")
    p.add_argument("--steps", type=int, default=64, help="greedy decode steps, >= 1 (default %(default)s)")
    p.add_argument("--kernel", default="auto", choices=["auto", "native", "function"],
                   help="what runs TopKGatherDot: the native kernel, the function body, or auto (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print parity.json's content as one JSON object")
    p.set_defaults(fn=cmd_parity)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "--version":
            from . import __version__

            print(f"aqua-export {__version__}")
            return 0
        if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            return build_main(argv)
        if argv and argv[0] in ("-h", "--help"):
            build_parser().print_help()
            print("\n--- the main job: aqua-export --model M --k-ratio R [...] ---\n")
            build_arg_parser().print_help()
            return 0
        a = build_parser().parse_args(argv)
        return a.fn(a)
    except ConfigError as e:
        print(f"aqua-export: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # every stage writes to a temporary path and renames at the end: an interrupt leaves nothing behind
        print("aqua-export: interrupted (nothing was written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
