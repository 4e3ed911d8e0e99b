"""What each subcommand does, given its parsed arguments (cli.py holds the parsers). Each returns an exit code;
bad input raises ConfigError, which cli.main turns into one ``aqua-export: error: ...`` line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from . import settings
from .config import AquaConfig, ConfigError


def config_of(a) -> AquaConfig:
    return AquaConfig(**settings.from_args(a))


def _process_group():
    """Under torchrun (WORLD_SIZE > 1): join the job's process group, NCCL when this rank has a GPU, else gloo."""
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
    from .outputs import check_writable, refuse_foreign
    from .projection import is_projection, load_projection
    from .projection import write as write_projection

    out = Path(a.out)
    check_writable(out)
    refuse_foreign(out, is_projection, a.force)
    max_memory = models.parse_max_memory(a.max_memory)
    if max_memory and not a.device_map:
        raise ConfigError("--max-memory needs --device-map (e.g. --device-map auto)")
    from .evaluate import window_length

    a.seq_len = window_length(a.seq_len, models.context_of(models.load_config(a.model)))
    if a.tokens < 1 or a.seq_len < 2:
        raise ConfigError(f"--tokens {a.tokens} / --seq-len {a.seq_len}: calibrate on 1 or more tokens, in windows of "
                          "2 or more")
    group = _process_group()
    import tempfile

    offload = tempfile.TemporaryDirectory(prefix="aqua-offload-") if a.device_map else None
    try:
        # the checkpoint's own dtype (computed in float32 layer by layer), or float32 where accelerate places it
        import torch

        model, tok = models.load(a.model, dtype=torch.float32 if a.device_map else "auto", device_map=a.device_map,
                                 max_memory=max_memory, offload_folder=offload.name if offload else None)
        if group is not None and torch.cuda.is_available():
            model.to(f"cuda:{torch.cuda.current_device()}")
        res = calibrate.calibrate(model, tok, texts=a.text or None, tokens=a.tokens, seq_len=a.seq_len,
                                  seed=a.seed, progress=not a.quiet, group=group)
        if res is not None:  # rank 0 (or the only process) writes
            tensors, meta = res
            write_projection(out, tensors, meta)
            texts = a.text or ["builtin:python-reference"]
            if a.slice_costs:
                from .slice_costs import add_costs

                add_costs(model, tok, load_projection(out), out, texts, progress=not a.quiet)
            if a.select_costs:
                from .slice_costs import add_select_costs

                add_select_costs(model, tok, load_projection(out), out, texts, a.select_costs, progress=not a.quiet)
            costs = "".join(f", {w} costs" for w, on in (("slice", a.slice_costs), ("selection", a.select_costs)) if on)
            print(f"wrote {out} ({meta['tokens']} tokens of {meta['corpus']}{costs})")
    finally:
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        if offload is not None:
            offload.cleanup()
    return 0


def check_threads(threads: int) -> None:
    if threads < 0:
        raise ConfigError(f"--threads {threads}: give a count of threads, or 0 for all cores")


def cmd_eval(a) -> int:
    from . import corpus, evaluate, models
    from .projection import load_projection

    cfg = config_of(a)
    check_threads(a.threads)
    if a.folder:
        if a.model or a.projection or cfg != AquaConfig():
            given = [s.flag for s in settings.SETTINGS.values() if getattr(a, s.name) != s.default]
            raise ConfigError("a folder carries its own model and AQUA settings: drop "
                              f"{' / '.join(['--model'] * bool(a.model) + ['--projection'] * bool(a.projection) + given)}"
                              " with --folder")
        res = evaluate.folder_perplexity(a.folder, corpus.read_text(a.text), tokens=a.tokens, seq_len=a.seq_len,
                                         threads=a.threads, progress=not a.json)
        a.seq_len = res["seq_len"]
        res["text"] = a.text
        print(json.dumps(res, sort_keys=True) if a.json else
              f"perplexity {res['perplexity']:.4f} over {res['predicted_tokens']} predicted tokens ({res['windows']} "
              f"windows of {a.seq_len}) of the folder {a.folder} ({res['runtime']})")
        return 0
    a.model = a.model or "llama"
    # windows past the reference's context are a research question (context extension): taken as asked
    a.seq_len = a.seq_len or evaluate.window_length(None, models.context_of(models.load_config(a.model)))
    evaluate.check_windows(a.tokens, a.seq_len)
    projection = load_projection(a.projection) if a.projection else None
    cfg.require_projection(projection is not None, "--projection FILE (make one with `aqua-export calibrate`)")
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
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("aqua-export lm-eval needs lm-evaluation-harness, an optional part of this package: "
                          "pip install 'aqua-export[eval]'")
    tasks = [t for t in a.tasks.split(",") if t]
    if a.limit is not None and not a.limit > 0:
        raise ConfigError(f"--limit {a.limit:g} is not a number of items: give a count >= 1, or a share in (0, 1)")
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size {a.batch_size}: give 1 or more requests per forward")
    check_threads(a.threads)
    config = config_of(a)
    config.require_projection(bool(a.projection) or not a.model,
                              "--projection FILE with --model (make one with `aqua-export calibrate`)")
    _offline_unless_reachable(tasks)
    from .lm_eval_model import AquaLM, evaluate

    default = AquaConfig()
    settings = {k: getattr(config, k) for k in AquaLM.SETTINGS if getattr(config, k) != getattr(default, k)}
    with AquaLM(model=a.model, folder=a.folder, projection=a.projection, threads=a.threads, kernel=a.kernel,
                batch_size=a.batch_size, **settings) as lm:
        res = evaluate(lm, tasks, a.include_path, a.limit)
    if a.json:
        print(json.dumps({"results": res["results"], "config": lm.aqua_config.to_dict(), "model": a.model,
                          "folder": a.folder, "limit": a.limit}, sort_keys=True, default=float))
    else:
        from lm_eval.utils import make_table

        print(make_table(res))
    return 0


def _offline_unless_reachable(tasks: list[str]) -> None:
    """Tasks from the Hugging Face hub, and a hub this machine cannot reach: datasets and the hub client go
    offline before they load (a cached dataset still loads; a missing one fails at once instead of after 30 s of
    retries, with lm_eval_model.evaluate's one line saying what to do)."""
    import socket

    if all(t.startswith("aqua_") for t in tasks):
        return
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


RETENTION_FILES = ("retention.json", "retention.png")


def _is_retention_report(path: Path) -> bool:
    try:
        return set(json.loads(path.read_text())) == {"k_ratio", "tokens", "loss", "mean"}
    except (OSError, ValueError, TypeError):
        return False


def cmd_retention(a) -> int:
    from . import corpus, evaluate, models
    from .outputs import atomic_write_bytes, check_writable, refuse_foreign
    from .projection import load_projection

    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: retention writes a folder (retention.json, retention.png); "
                          "give a folder path")
    check_writable(out / RETENTION_FILES[0])
    ours = _is_retention_report(out / RETENTION_FILES[0])  # the PNG is ours when the report beside it is
    for name in RETENTION_FILES:
        refuse_foreign(out / name, lambda p: ours, a.force)
    AquaConfig(k_ratio=a.k_ratio)
    a.seq_len = evaluate.window_length(a.seq_len, models.context_of(models.load_config(a.model)))
    evaluate.check_windows(a.tokens, a.seq_len)
    projection = load_projection(a.projection)
    text = corpus.read_text(a.text)
    model, tok = models.load(a.model)
    projection.check_model(model)
    rep = evaluate.retention_report(model, tok, text, projection, tokens=a.tokens, seq_len=a.seq_len, k_ratio=a.k_ratio)
    atomic_write_bytes(out / "retention.json", json.dumps(rep, indent=1, sort_keys=True).encode())
    evaluate.plot_retention(rep, out / "retention.png")
    for k, v in rep["mean"].items():
        print(f"{k:20s} mean retention loss {v:.4f}")
    print(f"wrote {out / 'retention.json'} and {out / 'retention.png'}")
    return 0


def cmd_run(a) -> int:
    from .runtime.folder import FolderConfig
    from .runtime.hosts import open_lm
    from .runtime.sampling import SamplingConfig
    from .runtime.session import say_once
    from .runtime.text import TextStream, encode_prompts, load_tokenizer

    sampling = SamplingConfig(max_new_tokens=a.max_new_tokens, do_sample=a.sample, temperature=a.temperature,
                              top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    cfg = FolderConfig.from_folder(a.folder)
    cfg.verify(a.folder)  # a damaged folder is named before anything else
    sampling.check_vocabulary(cfg.contract.vocab)
    tok = load_tokenizer(a.folder)
    ids, mask = encode_prompts(tok, a.prompt, chat=a.chat, context=cfg.context_length, max_new_tokens=a.max_new_tokens)
    if sys.stderr.isatty():  # a terminal waits for the load (seconds for a large folder) with a word of what it is
        size = sum(r["bytes"] for n, r in cfg.files.items() if n.startswith("model.onnx"))
        print(f"[loading {a.folder}: {size / 2**30:.2f} GiB of weights into "
              f"{'onnxruntime-genai' if a.runtime == 'genai' else 'ONNX Runtime'}]", file=sys.stderr, flush=True)
    lm = open_lm(a.folder, a.runtime, kernel=a.kernel,
                 share_buffer=a.kv_buffer == "shared", serving=(ids.shape[0], ids.shape[1] + a.max_new_tokens))
    if getattr(lm, "kernels", ""):  # which path the custom nodes take, once (a fallback's notice is this line)
        say_once(lm.kernels)
    if a.runtime == "tensorrt":
        from .runtime.tensorrt import check_request

        check_request(lm.session.profiles, ids.shape[0], ids.shape[1], a.max_new_tokens)
    eos = tok.eos_token_id
    if len(a.prompt) == 1:
        stream = TextStream(tok, sys.stdout)
        lm.generate(ids, mask, sampling, eos_token_id=eos, on_token=stream)
        stream.close()
        print()
    else:
        out = lm.generate(ids, mask, sampling, eos_token_id=eos)
        for p, row in zip(a.prompt, out):
            print(f"--- {p!r}\n{tok.decode(row, skip_special_tokens=True)}")
    return 0


def cmd_serve(a) -> int:
    from .runtime.folder import FolderConfig
    from .runtime.lm import OrtLM
    from .runtime.session import available_memory
    from .runtime.text import load_tokenizer
    from .serving.api import Api, least_context
    from .serving.engine import Engine, check_engine

    check_threads(a.threads)
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port {a.port}: give a port in 1..65535")
    for flag, value in (("--context", a.context), ("--prefix-cache-mb", a.prefix_cache_mb)):
        if value < 0:
            raise ConfigError(f"{flag} {value}: give 0 or more")
    cfg = FolderConfig.from_folder(a.folder)
    cfg.verify(a.folder)
    check_engine(cfg, a.max_seqs, a.chunk, a.queue)
    model_context = cfg.serving_context
    if a.context > model_context:
        raise ConfigError(f"--context {a.context} exceeds the model's context of {model_context} tokens: give at most "
                          f"{model_context}")
    context = a.context or model_context
    rows, slots = a.max_seqs + 1, Engine.capacity_for(context)  # the batch's rows and one prefilling alone
    prefix = a.prefix_cache_mb << 20
    if prefix > available_memory() // 2:
        raise ConfigError(f"--prefix-cache-mb {a.prefix_cache_mb} is more than half the memory available now "
                          f"({available_memory() >> 20} MB): give less")
    _check_port(a.host, a.port)
    tok = load_tokenizer(a.folder)
    least = least_context(tok)
    if context < least:  # every chat would be refused: say so now, not at each request
        raise ConfigError(f"--context {context} cannot hold a request: the folder's chat template around an empty "
                          f"message takes {least - 1} tokens, and one is generated; give --context {least} or more")
    lm = OrtLM.from_folder(a.folder, threads=a.threads, kernel=a.kernel, serving=(rows, slots))
    engine = Engine(lm, max_seqs=a.max_seqs, context=context, chunk=a.chunk, queue=a.queue, prefix_bytes=prefix)
    return _serve_http(Api(engine, tok, a.model_name or Path(a.folder).resolve().name, a.api_key), a.host, a.port)


def _check_port(host: str, port: int) -> None:
    """The address must be free before the model loads (uvicorn would find out after)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or --host") \
                from None


def _serve_http(api, host: str, port: int) -> int:
    """uvicorn in this thread until SIGINT / SIGTERM (graceful: the requests in flight finish first)."""
    import signal

    import uvicorn

    engine = api.engine
    print(f"aqua-export: serving {api.name} on http://{host}:{port}/v1 ({engine.max_seqs} sequences of up to "
          f"{engine.context} tokens, prefix cache {engine.prefix.budget >> 20} MB)", file=sys.stderr, flush=True)
    got: list[int] = []
    # uvicorn handles SIGINT / SIGTERM itself (no new connections, the requests in flight finish), then raises the
    # signal again for the handler it found: ours only notes it, so the server's exit is a clean one
    old = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(api.app(), host=host, port=port, log_level="warning", timeout_graceful_shutdown=None)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    how = f" by {signal.Signals(got[0]).name}" if got else ""
    print(f"aqua-export: server stopped{how}; {engine.finished} requests served", file=sys.stderr)
    return 0


def cmd_bench(a) -> int:
    from .bench import bench, table

    check_threads(a.threads)
    res = bench(a.folders, context=a.context, batch=a.batch, runtime=a.runtime, steps=a.steps, rounds=a.rounds,
                threads=a.threads, capacity=a.capacity, prefill=a.prefill, profile=a.profile)
    print(json.dumps(res, sort_keys=True) if a.json else table(res))
    return 0


def cmd_parity(a) -> int:
    from . import models
    from .parity.harness import check_run, parity_lengths, run_parity
    from .parity.report import summary_lines
    from .projection import load_projection
    from .runtime.folder import FolderConfig
    from .runtime.session import default_kernel
    from .runtime.text import load_tokenizer

    cfg = FolderConfig.from_folder(a.folder)
    prompt, steps = parity_lengths(None, a.steps, cfg.context_length)
    check_run(cfg.aqua, prompt, steps, cfg.context_length)
    cfg.verify(a.folder, checksums=True)  # damaged weights are named here, not left to fail a gate
    kernel = a.kernel if a.kernel != "auto" else default_kernel(cfg.dtype)
    path = Path(a.folder) / "model.onnx"
    proj = load_projection(Path(a.folder) / "projection.safetensors")
    # the reference model is loaded only after the ONNX Runtime runs: one model in memory at a time
    res = run_parity(path, cfg, load_tokenizer(a.folder), proj, cfg.aqua,
                     lambda: models.load(cfg.model, dtype="auto")[0], prompt_tokens=prompt, steps=steps, dtype=cfg.dtype,
                     kernel=kernel,
                     progress=None if a.json else lambda text: print(f"... {text}", flush=True))
    print(json.dumps(res, sort_keys=True) if a.json else "\n".join(summary_lines(res)))
    return 0 if res["pass"] else 1


def cmd_check(a) -> int:
    from .runtime.folder import FolderConfig

    cfg = FolderConfig.from_folder(a.folder)
    size = cfg.verify(a.folder, checksums=True, whole=True)
    foreign = cfg.foreign_files(a.folder)
    extra = f"; it also holds {', '.join(foreign)}, which the build did not write" if foreign else ""
    print(f"{a.folder}: {len(cfg.files)} files, {size / 2**30:.2f} GiB, each as the build wrote it (SHA-256){extra}")
    return 0
