"""One measurement harness: the registry of the benchmarks (name -> module, what it measures, the files it writes
under benchmarks/), the one interleaved-median timer and the one markdown table writer they share.

    python -m tools                 the registry, and benchmarks/README.md rewritten from it
    python -m tools NAME [ARGS]     run one (its --help says its options)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@dataclass(frozen=True)
class Benchmark:
    module: str  # tools.<module>, whose main(argv) runs it
    measures: str
    writes: tuple[str, ...]  # paths under benchmarks/ (or the repository, for docs)
    needs: str = ""  # what it needs beyond `make setup` (a GPU, the peers' environments)


REGISTRY = {
    "attention": Benchmark("bench_attention", "one attention step of every kernel at long context and each cache "
                           "width (float32, float16, int8), ONNX Runtime nodes on this CPU, against dense",
                           ("attention_step.json",)),
    "breakeven": Benchmark("bench_breakeven", "the context where AQUA's step overtakes dense, predicted and measured",
                           ("breakeven.json",)),
    "decode": Benchmark("bench_decode", "decode tokens/s and memory of built folders: every variant, genai, H2O, "
                        "token selection, the 8k target", ("decode.json", "genai.json", "h2o.json", "tokens.json",
                                                            "target.json", "capacity.json")),
    "performance": Benchmark("perf_report", "benchmarks/performance.md from the JSON of attention, breakeven and "
                             "decode", ("performance.md",)),
    "prompt": Benchmark("bench_prompt", "attention over a whole prompt: AquaAttention's blocked kernel against ONNX "
                        "Runtime's GroupQueryAttention (genai's builder) and the CPU's matrix-product rate",
                        ("prompt_attention.json", "prompt_attention.md")),
    "prefill": Benchmark("bench_prefill", "time to first token, decode after it, the whole request and peak RSS "
                         "against genai's builder, OpenVINO GenAI and llama.cpp", ("prefill.json", "prefill.md"),
                         needs="the peers' environments: python -m tools prefill --setup"),
    "steps": Benchmark("bench_steps", "decode after a real prompt, our folders stepping in turn in one process: the "
                       "int8 cache against float16 at batch 1 and 8", ("steps.json", "steps.md"),
                       needs="build/prefill's token folders (made when absent)"),
    "serve": Benchmark("bench_serve", "`aqua-export serve` under load against llama-server and OpenVINO GenAI's "
                       "continuous batching: 200 requests 16 at a time, 16 concurrent 1k chats, a shared system "
                       "prompt; llama-cpp-python's server at 1k and 8k", ("serve.json", "serve.md"),
                       needs="build/prefill's folders, the peers' environments and llama-server: python -m tools "
                       "prefill --setup; python -m tools serve --setup"),
    "replicas": Benchmark("replicas", "two `aqua-export serve` replicas behind HAProxy (docs/deploy/haproxy.cfg), "
                          "one killed with kill -9 mid-load and restarted", ("replicas.json", "replicas.md"),
                          needs="build/prefill's token folder; HAProxy (fetched from Debian)"),
    "quality": Benchmark("quality", "perplexity, retention, lm-eval, long windows and pass keys of every setting on "
                         "the embedded model", ("quality.json", "quality.md", "retention.json", "retention.png",
                                                "passkey.json")),
    "scale": Benchmark("scale", "a build's time and memory against model size (random-weight checkpoints)",
                       ("scale.json", "scale.md")),
    "serving": Benchmark("serving", "serving at deployed sizes: load, decode and memory against genai's builder",
                         ("serving.json", "scale.md")),
    "gpu": Benchmark("bench_gpu", "the Triton kernels on a GPU against torch SDPA", ("gpu_attention.md",
                                                                                     "gpu_attention.json"),
                     needs="an NVIDIA GPU"),
    "gpu-generate": Benchmark("bench_gpu_generate", "transformers' generate on a GPU, a Llama-3.1-8B-shaped model "
                              "attending through the Triton kernels against SDPA: prefill, decode, a graph-replayed "
                              "step", ("gpu_generate.md", "gpu_generate.json"), needs="an NVIDIA GPU"),
    "cli-reference": Benchmark("cli_reference", "docs/cli.md from the parsers, the settings and the capability table",
                               ("../docs/cli.md",)),
}
# one-off studies (tools/studies/): what they wrote stays in benchmarks/ as the record of a decision
STUDIES = {"head_alloc_study.json": "python -m tools.studies.head_alloc_study",
           "head_alloc_study.md": "python -m tools.studies.head_alloc_study",
           "optimum.md": "python -m tools.studies.optimum_check (in optimum-onnx's own environment)",
           "int8_scale_study.json": "python -m tools.studies.int8_scale_study",
           "int8_scale_study.md": "python -m tools.studies.int8_scale_study",
           "int8_long_study.json": "python -m tools.studies.int8_long_study",
           "int8_long_study.md": "python -m tools.studies.int8_long_study",
           "sparse_prefill_study.json": "python -m tools.studies.sparse_prefill_study",
           "sparse_prefill_study.md": "python -m tools.studies.sparse_prefill_study",
           "activation_levels_study.json": "python -m tools.studies.activation_levels_study",
           "activation_levels_study.md": "python -m tools.studies.activation_levels_study"}


def command(name: str) -> str:
    return f"python -m tools {name}"


def interleaved_medians(fns: dict, reps: int, budget_s: float = float("inf"), warmup: bool = True,
                        between=None, stat=statistics.median) -> dict:
    """Median seconds per callable of ``fns`` (name -> fn), measured in rounds that run every callable once, so
    drift and frequency changes hit all of them alike; stops after ``budget_s`` once 5 rounds are in. between: called
    untimed before each timed call (flush_caches: every call starts cold). stat: min for the least disturbed run
    (a ratio that must hold beside other processes: tests/test_variant_speed.py)."""
    if warmup:
        for fn in fns.values():
            fn()  # allocations, thread pools
    times: dict = {name: [] for name in fns}
    start = time.perf_counter()
    for i in range(reps):
        for name, fn in fns.items():
            if between is not None:
                between()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s and i >= 4:
            break
    return {name: stat(v) for name, v in times.items()}


FLUSH_BYTES = 64 << 20  # four times the 16 MiB L3 of this machine's core complex, more than most x86 L3 slices
_flush_buffer: list = []


def flush_caches() -> None:
    """Writes one byte of every line of a FLUSH_BYTES buffer, so what a timed call reads next comes from memory: a
    model's decode step meets each layer's cache after the other layers' weights and caches went through."""
    import numpy as np

    if not _flush_buffer:
        _flush_buffer.append(np.zeros(FLUSH_BYTES, np.uint8))
    _flush_buffer[0][::64] += 1


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table: the header row, the rule, one line per row (cells as str())."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def written_by(name: str) -> str:
    """The line every markdown file a benchmark writes starts its body with."""
    return f"Written by `{command(name)}` (tools/harness.py's registry); do not edit by hand."


def index() -> str:
    """benchmarks/README.md: which command writes which file."""
    rows = [[f"`{f}`", f"`{command(name)}`", b.measures + (f" (needs {b.needs})" if b.needs else "")]
            for name, b in REGISTRY.items() for f in b.writes if not f.startswith("..")]
    rows += [[f"`{f}`", f"`{cmd}`", "a one-off study (tools/studies/)"] for f, cmd in STUDIES.items()]
    return "\n".join(["# benchmarks/", "", "Every file here is written by a command; `python -m tools` rewrites this "
                      "index from tools/harness.py's registry.", "", *table(["file", "written by", "what"], rows), ""])
