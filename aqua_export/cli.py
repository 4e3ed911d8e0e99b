"""Command line: the parsers and ``main`` (what each subcommand does: commands.py).

    aqua-export --model M --k-ratio R [...]        build a ready-to-serve folder (the main job)
    aqua-export {calibrate,eval,lm-eval,retention,run,bench,parity,check} ...

Every bad input ends in one line on stderr, ``aqua-export: error: ...``, and exit code 2; so does an operating
system refusal (a full disk, a read-only folder); Ctrl-C ends in one line and exit code 130, SIGTERM (what `timeout`,
`docker stop` and systemd send) and SIGHUP in one line and 128 + the signal's number, each stage's temporary files
removed on the way out as for Ctrl-C.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import signal
import sys

from . import commands, options
from .capabilities import KERNELS, RUNTIMES
from .config import ConfigError
from .outputs import Terminated, on_signal


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``aqua-export: error: ...`` line (exit 2) like every other error."""

    def error(self, message):
        self.exit(2, f"aqua-export: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self._joined(sys.argv[1:] if args is None else list(args)), namespace)

    def _joined(self, args: list[str]) -> list[str]:
        """An option's value that starts with '-' but is no option (-inf, -.5, -1e3) joined to it (--flag=-inf):
        argparse reads such a value as an unknown option and says "expected one argument"."""
        out, i = [], 0
        while i < len(args):
            a = args[i]
            action = self._option_string_actions.get(a)
            if (action is not None and action.nargs is None and action.option_strings and i + 1 < len(args)
                    and args[i + 1].startswith("-") and args[i + 1] not in self._option_string_actions
                    and _NUMBER_LIKE.match(args[i + 1])):
                out.append(f"{a}={args[i + 1]}")
                i += 2
                continue
            out.append(a)
            i += 1
        return out


_NUMBER_LIKE = re.compile(r"^-(inf|infinity|nan|\d|\.\d)", re.IGNORECASE)  # a negative number, not an option


def _model_arg(p):
    p.add_argument("--model", default="llama", help="HF model id (org/name), local HF folder, .gguf file, or 'llama' "
                                                    "(the embedded SmolLM2-135M-Instruct; default)")


def _config_args(p):
    """AQUA's settings (settings.MECHANISMS: each mechanism's module owns its flags, defaults and help)."""
    from . import settings

    settings.add_arguments(p)


SEQ_LEN = 512  # the windows' length unless asked: evaluate.window_length


def _window_args(p, tokens: int, what: str):
    p.add_argument("--tokens", type=int, default=tokens, help=f"tokens of text to {what}, >= 1 (default %(default)s)")
    p.add_argument("--seq-len", type=int, help=f"window length in tokens, >= 2, within the model's context; each window "
                                                f"starts fresh (default {SEQ_LEN}, or the context when shorter)")


def build_arg_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aqua-export", description="Build a ready-to-serve AQUA model folder: calibrate "
                                 "(or reuse a projection), export ONNX, check parity, write the folder atomically. "
                                 f"Subcommands: {', '.join(SUBCOMMANDS)} (aqua-export --help lists them).")
    _model_arg(ap)
    _config_args(ap)
    ap.add_argument("--projection", help="reuse this calibrated projection (.safetensors) instead of calibrating")
    ap.add_argument("--calib-text", action="append", help="calibration text: a plain-text or JSONL file, or "
                    "builtin:python-reference | builtin:gpl-3 (repeatable; default builtin:python-reference)")
    ap.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens, >= 1 (default %(default)s)")
    ap.add_argument("--out", help="output folder (default engines/<model>-k<R>, plus a suffix per non-default setting: "
                                  "-s<S> -h<H> -<selection> -<dtype> -tensorrt); an existing non-empty "
                                  "folder is refused")
    ap.add_argument("--force", action="store_true", help="replace --out when it is a folder this tool built and holds "
                                                        "nothing else (a user's file in it: refused)")
    options.add_arguments(ap)  # how the folder is built: options.OPTIONS
    return ap


def build_main(argv: list[str]) -> int:
    a = build_arg_parser().parse_args(argv)
    from .build import build

    opts = options.BuildOptions.from_args(a)
    out = build(a.model, commands.config_of(a), projection_path=a.projection, calib_texts=a.calib_text,
                calib_tokens=a.calib_tokens, out=a.out, options=opts)
    print(f"ready: {out}  (try: aqua-export run {shlex.quote(str(out))} --prompt \"Hello\" --chat)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aqua-export", description="AQUA attention for Hugging Face decoder LLMs. The "
                                 "main job, a ready-to-serve folder: aqua-export --model M --k-ratio R [...] (its "
                                 "options follow the subcommands below).")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in SUBPARSERS.values():
        add(sub)
    return ap


def _calibrate_parser(sub) -> None:
    from .ops.spec import SELECTIONS

    p = sub.add_parser("calibrate", help="compute the projection artifact")
    _model_arg(p)
    p.add_argument("--text", action="append", help="plain-text/JSONL file or builtin:NAME (repeatable); default: "
                                                    "text the model generates itself from --seed")
    _window_args(p, 16384, "calibrate on")
    p.add_argument("--seed", type=int, default=0, help="seed of the self-generated text (default %(default)s)")
    p.add_argument("--out", required=True, help="the projection file to write (.safetensors); an existing file is "
                                                "refused unless it is a projection this tool wrote and --force is given")
    p.add_argument("--force", action="store_true", help="replace --out when it is a projection this tool wrote")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device-map", help="accelerate placement for a model larger than one device: auto (GPUs, then "
                                        "CPU, then disk), cpu, or a device; data-parallel: run under torchrun")
    p.add_argument("--max-memory", help="per-device limits for --device-map, e.g. cpu=2GiB,0=20GiB")
    p.add_argument("--slice-costs", action="store_true",
                   help="also measure each layer's cost of slicing its K^ and its V (for --slice-alloc measured): 12 "
                        "cuts per layer, a 1,024-token forward each, on --text (default builtin:python-reference)")
    p.add_argument("--select-costs", choices=SELECTIONS, metavar="SELECTION",
                   help="also measure the costs of a narrower selection under this rule (for --k-alloc measured): 3 "
                        "k per KV head (the heads' prices), then 5 k per layer with its heads sharing k, a 512-token "
                        "forward each, on --text")
    p.set_defaults(fn=commands.cmd_calibrate)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity with or without AQUA, of the PyTorch reference or a built folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model id (org/name), local HF folder, .gguf file, or 'llama' (the embedded "
                                     "SmolLM2-135M-Instruct; the default): the PyTorch reference, AQUA applied with "
                                     "--projection and the settings below")
    src.add_argument("--folder", help="a built folder run by ONNX Runtime (its own settings and weights), this tool's "
                                      "or onnxruntime-genai's model builder's")
    p.add_argument("--projection", help="projection file (needed unless dense: --k-ratio 1, no slicing or eviction)")
    _config_args(p)
    p.add_argument("--text", required=True, help="text to evaluate: file or builtin:NAME")
    _window_args(p, 8192, "evaluate")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads with --folder; 0 = all "
                                                          "(default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=commands.cmd_eval)


def _lm_eval_parser(sub) -> None:
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
    p.add_argument("--kernel", default="auto", choices=KERNELS,
                   help="with --folder: the native kernels (auto: when built) or the function bodies")
    p.add_argument("--json", action="store_true", help="print one JSON object (lm_eval's results per task)")
    p.set_defaults(fn=commands.cmd_lm_eval)


def _retention_parser(sub) -> None:
    from . import settings

    p = sub.add_parser("retention", help="information retention loss per layer/head, JSON + PNG")
    _model_arg(p)
    p.add_argument("--projection", required=True, help="projection file")
    p.add_argument("--text", required=True, help="text to measure on: file or builtin:NAME")
    settings.SETTINGS["k_ratio"].add_to(p, default=0.5)
    _window_args(p, 4096, "measure on")
    p.add_argument("--out", required=True, help="output folder (retention.json, retention.png); existing ones are "
                                                "refused unless this tool wrote them and --force is given")
    p.add_argument("--force", action="store_true", help="replace a retention report this tool wrote in --out")
    p.set_defaults(fn=commands.cmd_retention)


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate with ONNX Runtime from a built folder")
    p.add_argument("folder", help="a folder built by aqua-export")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, >= 1 (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0..vocabulary; 0 = all "
                                                        "(default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; a negative one draws a fresh seed each run, as "
                                                       "onnxruntime-genai's -1 does (default %(default)s)")
    p.add_argument("--kernel", default="auto", choices=KERNELS,
                   help="what runs the custom nodes (AquaAttention, H2OAttention, the cache updates): the native C++ "
                        "kernels (auto: when built and the folder is float32) or the graph's function bodies")
    p.add_argument("--runtime", default="aqua", choices=RUNTIMES,
                   help="aqua: this project's ONNX Runtime loop (every variant); genai: onnxruntime-genai (not "
                        "AQUA-H2O folders); tensorrt: the folder's model.engine in this project's loop (default "
                        "%(default)s)")
    p.add_argument("--kv-buffer", default="shared", choices=["shared", "concat"],
                   help="shared: past and present one buffer written in place (genai's past_present_share_buffer); "
                        "concat: a new present each step (default %(default)s)")
    p.set_defaults(fn=commands.cmd_run)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server of a built folder: continuous batching, a "
                                     "prefix cache")
    p.add_argument("folder", help="a folder built by aqua-export (not AQUA-H2O)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0: every "
                                                       "interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1..65535 (default %(default)s)")
    p.add_argument("--max-seqs", type=int, default=8, help="sequences decoded together, >= 1 (default %(default)s)")
    p.add_argument("--context", type=int, default=0, help="tokens per sequence, prompt and answer (default: the "
                                                          "model's context)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait for a free sequence before the "
                                                         "server answers 429 (default %(default)s)")
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per prefill forward, interleaved with the "
                                                          "others' decode steps (default %(default)s)")
    p.add_argument("--prefix-cache-mb", type=int, default=256, help="memory kept for prompts' cache rows, reused by "
                                                                    "prompts that start the same way (a start kept "
                                                                    "once seen twice); 0 = off (default %(default)s)")
    p.add_argument("--model-name", default="", help="the model id clients name (default: the folder's name)")
    p.add_argument("--api-key", default=os.environ.get("AQUA_API_KEY", ""),
                   help="ask clients for `Authorization: Bearer KEY` on /v1 (default: $AQUA_API_KEY; none when unset)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (default: all cores)")
    p.add_argument("--kernel", default="auto", choices=KERNELS, help="what runs the custom nodes (default %(default)s)")
    p.set_defaults(fn=commands.cmd_serve)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="decode tokens/s and decode memory of built folders, measured interleaved")
    p.add_argument("folders", nargs="+", help="folders built by aqua-export (or by onnxruntime-genai's builder, "
                                              "with --runtime genai)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in the cache, within the model's context "
                                                            "(default %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default %(default)s)")
    p.add_argument("--runtime", default="aqua", choices=["aqua", "genai", "genai-io"],
                   help="aqua: this project's loop, the context written into the cache; genai: onnxruntime-genai, "
                        "the context prefilled through it; genai-io: the graph driven with onnxruntime-genai's I/O, "
                        "the context written into its buffers (default %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per round (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the folders (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads; 0 = all cores (default "
                                                          "%(default)s)")
    p.add_argument("--capacity", type=int, default=0, help="cache slots to allocate, as genai's max_length would "
                   "(aqua, genai-io; 0 = just enough): a step's cost should not depend on it (default %(default)s)")
    p.add_argument("--prefill", type=int, default=0, help="time whole prompts of this many tokens from an empty "
                   "cache instead of decode steps (runtime aqua; 0 = decode) (default %(default)s)")
    p.add_argument("--profile", action="store_true", help="also the ms a step spends in each op type, from ONNX "
                   "Runtime's profiler (runtime aqua; the profiled steps run slower)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=commands.cmd_bench)


def _parity_parser(sub) -> None:
    p = sub.add_parser("parity", help="ONNX Runtime vs the PyTorch reference (and vs HF at k = r)")
    p.add_argument("folder", help="a folder built by aqua-export")
    p.add_argument("--steps", type=int, help="greedy decode steps, >= 1 (default 64, fewer for a model whose context "
                                             "is shorter)")
    p.add_argument("--kernel", default="auto", choices=KERNELS,
                   help="what runs the custom nodes: the native kernels, the function bodies, or auto (default "
                        "%(default)s)")
    p.add_argument("--json", action="store_true", help="print parity.json's content as one JSON object")
    p.set_defaults(fn=commands.cmd_parity)


def _check_parser(sub) -> None:
    p = sub.add_parser("check", help="verify a built folder: every file the build wrote, of its size and SHA-256")
    p.add_argument("folder", help="a folder built by aqua-export")
    p.set_defaults(fn=commands.cmd_check)


SUBPARSERS = {"calibrate": _calibrate_parser, "eval": _eval_parser, "lm-eval": _lm_eval_parser,
              "retention": _retention_parser, "run": _run_parser, "serve": _serve_parser, "bench": _bench_parser, "parity": _parity_parser,
              "check": _check_parser}  # subcommand -> what adds its parser
SUBCOMMANDS = tuple(SUBPARSERS)


TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    handlers = {s: signal.signal(s, on_signal) for s in TERMINATING} if _main_thread() else {}
    try:
        return _main(argv)
    except Terminated as e:
        _end_progress_bars()
        print(f"aqua-export: stopped by {signal.Signals(e.signum).name} (nothing was written)", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _main(argv: list[str]) -> int:
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
        _end_progress_bars()
        print(f"aqua-export: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse, its one line printed (a setting's value is checked as it is parsed)
        if isinstance(e.code, int):
            return e.code
        raise
    except OSError as e:
        if e.errno not in REFUSALS:
            raise
        _end_progress_bars()
        where = f": {e.filename}" if e.filename else ""
        print(f"aqua-export: error: {e.strerror or e}{where}: {REFUSALS[e.errno]} (nothing was left half-written)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _end_progress_bars()
        # every stage writes to a temporary path and renames at the end: an interrupt leaves nothing behind
        print("aqua-export: interrupted (nothing was written)", file=sys.stderr)
        return 130


# what the operating system refused, and the fix (every output is written to a temporary path and renamed, so a
# refusal mid-way leaves nothing behind)
REFUSALS = {errno.ENOSPC: "free some space or choose another --out", errno.EDQUOT: "free some of your quota or "
            "choose another --out", errno.EROFS: "choose a path on a writable file system",
            errno.EACCES: "choose a path you can write (or read)", errno.EPERM: "choose a path you can write"}


def _end_progress_bars() -> None:
    """Close the progress bars still drawn: one left open would redraw (or, closing at exit, erase) the line that
    the error or interrupt message is printed on."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
