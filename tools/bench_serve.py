"""Serving under load, as users meet it: `aqua-export serve` against the servers users would run instead, each in
its own process, one engine at a time; ours and llama.cpp's over HTTP on the loopback, driven by the official
`openai` client (streaming, greedy).

    python -m tools serve [--quick] [--skip-peers] [--threads 2]
    python -m tools serve --setup      # llama-server (built from the llama-cpp-python sdist's llama.cpp), and
                                       # GuideLLM's and vLLM's environments (build/venvs)

Engines: our token-selection int4 folder (`aqua-export serve`, --max-seqs 16); llama.cpp's own `llama-server`
(-np 16 slots of the same context each, continuous batching, its prompt cache, flash attention, the embedded Q4_1
GGUF); OpenVINO GenAI's ContinuousBatchingPipeline on its int4 conversion (max_num_seqs 16, prefix caching;
in process through tools/cb_runner.py: OpenVINO's OpenAI server does not install from PyPI, so its rows carry no
HTTP); and our engine (serving.Engine) driven the same way in process (ours-engine, tools/engine_runner.py), so the
two compare like for like. Every engine given --threads, and in the batching scenario the peers again with no thread
count ([default threads]).

Scenarios (each request a distinct slice of builtin:licenses prose, the same for every engine; token counts by the
embedded tokenizer, the GGUF's own vocabulary):
    load      200 requests of 50-400 prompt tokens + 32 generated, 16 at a time: none lost, none duplicated; p50 /
              p95 time to first token and latency, aggregate tokens/s
    batching  16 chats of 1k prompt tokens + 128 generated, all 16 at once (ours also one at a time on the same
              server, and with an int8 cache): aggregate decode tokens/s
    prefix    a 2k-token shared system prompt, then 4 other questions under it: time to first token of the first
              (the prefix computed), the second (ours keeps a start at its second sighting) and the median of the
              others (served from the prefix cache)
    peers     1k (16 requests, 16 at a time) and 8k (4 requests, 4 at a time) prompts + 32 generated: our dense int4
              and token-selection int4 folders against llama-cpp-python's server (built from PyPI; the embedded Q4_1
              GGUF, flash attention, f16 KV cache; it serves one request at a time); every server with --threads
              given and, at 1k, again with no thread count at all (rows marked [default threads]: what a user
              who sets nothing gets)
    guidellm  GuideLLM, a load generator others wrote, drives ours (float16 cache; int8 too), llama-server
              and vLLM's CPU build over HTTP at 1 / 4 / 16 concurrent streams of 1k-token prompts + 128
              (tools/serve_guidellm.py); OpenVINO's pipeline in process on the same prompts
    guidellm-1b    the same at the 1B shape, 512 + 64 at 1 / 4 streams (float16 cache)
    guidellm-load  the load scenario's 200 requests of 50-400 tokens + 32, 16 at a time, under GuideLLM
    guidellm-rates the same requests offered at fixed rates (GuideLLM's constant profile: evenly spaced): 48 at each
                   of 0.5 / 1 / 2 requests/s, each row with the rate they arrived at

Writes benchmarks/serve.json and benchmarks/serve.md. Folders: build/prefill's ours-int4, ours-tokens-int4-f16,
ours-tokens-int4-i8 (the same with --cache-dtype int8) and openvino-int4, built there once as `python -m tools
prefill` builds them; llama-cpp-python's server: build/venvs/llamacpp (`python -m tools prefill --setup`);
llama-server: build/llama-server (--setup). Not CI: about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.folders import FOLDERS, PY, Text, make, setup, sized, threads_label
from tools.servers import LLAMA_SERVER, LLAMACPP, SLOTS, WORK, Server, setup_llama_server
from tools import serve_guidellm
from tools.harness import BENCHMARKS, table, written_by

ROOT = Path(__file__).resolve().parents[1]
OPENVINO = ROOT / "build" / "venvs" / "openvino" / "bin" / "python"
OPENVINO_FOLDER = ROOT / "build" / "prefill" / "openvino-int4"


def request(server: Server, text: Text, tag: int, prompt: str, new: int, chat: bool = False,
            system: str | None = None) -> dict:
    """One streamed greedy request (all ``new`` tokens: ignore_eos where the server takes it): its tag, time to first
    text, end, each piece's arrival, its token count (the server's usage where it streams one: re-tokenizing the
    text undercounts runs of whitespace; else the text's count)."""
    c = server.client()
    # every request generates all its tokens: ours and llama-server with ignore_eos, llama-cpp-python's server
    # (which has no such field) with the special tokens (ids 0..16 in this vocabulary: end of text, the chat
    # markers) biased away
    extra = {"logit_bias": {str(i): -100 for i in range(17)}} if server.engine == "llamacpp" else \
        {"extra_body": {"ignore_eos": True}, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, parts, usage = [], [], []
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        stream = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=new, temperature=0,
                                           stream=True, **extra)
        pieces = (ch.choices[0].delta.content if ch.choices else usage.append(ch.usage) for ch in stream)
    else:
        stream = c.completions.create(model=server.model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                      **extra)
        pieces = (ch.choices[0].text if ch.choices else usage.append(ch.usage) for ch in stream)
    for piece in pieces:
        if piece:
            arrivals.append(time.perf_counter())
            parts.append(piece)
    end = time.perf_counter()
    out = "".join(parts)
    first = arrivals[0] if arrivals else end
    return {"tag": tag, "start": t0, "ttft": first - t0, "first": first, "end": end, "arrivals": arrivals,
            "latency": end - t0,
            "tokens": usage[-1].completion_tokens if usage and usage[-1] else text.count(out) if out else 0}


def drive(server: Server, text: Text, prompts: list[str], new: int, concurrency: int, **kw) -> dict:
    """Every prompt, ``concurrency`` at a time; the summary of what came back."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda ip: request(server, text, ip[0], ip[1], new, **kw), enumerate(prompts)))
    return summary(res, time.perf_counter() - t0, len(prompts), concurrency)


# in process, no HTTP: engine -> (its Python, its runner, the folder)
IN_PROCESS = {"openvino-cb": (OPENVINO, "cb_runner.py", OPENVINO_FOLDER),
              "ours-engine": (Path(sys.executable), "engine_runner.py", FOLDERS["ours-tokens-int4"])}


def drive_in_process(engine: str, prompts: list[str], new: int, concurrency: int, threads: int,
                     system: str | None = None, raw: bool = False, precision: str = "", folder: str | None = None):
    """The same load without HTTP: OpenVINO GenAI's continuous-batching pipeline (tools/cb_runner.py, its environment,
    prefix caching on as ours is) or our serving.Engine (tools/engine_runner.py), on its folder of the embedded model
    or ``folder``; its summary, or (raw) each request's record."""
    import tempfile

    python, runner, embedded = IN_PROCESS[engine]
    folder = folder or embedded
    load = {"chats": [[system, p] for p in prompts], "new": new, "at_once": concurrency, "threads": threads,
            "max_seqs": SLOTS, "prefix_caching": True, "precision": precision, "context": 2048}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(load, f)
        f.flush()
        r = subprocess.run([str(python), str(ROOT / "tools" / runner), str(folder), f.name], cwd=ROOT,
                           capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    if r.returncode:
        raise SystemExit(f"{engine}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    recs = out["requests"]
    if raw:
        return recs
    wall = max(x["end"] for x in recs) - min(x["start"] for x in recs)
    res = summary(recs, wall, len(prompts), concurrency)
    res["peak_rss_mb"] = out["peak_rss_mb"]
    return res


def summary(res: list[dict], wall: float, n: int, concurrency: int) -> dict:
    """What users feel of a load: answered, p50 / p95 time to first token and latency, tokens/s over the wall, and
    decode tokens/s (res: each request's tag, ttft, first, end, arrivals, latency, tokens)."""
    tags = [r["tag"] for r in res]
    ttft = sorted(r["ttft"] for r in res)
    lat = sorted(r["latency"] for r in res)
    tokens = sum(r["tokens"] for r in res)
    # decode: pieces after each request's first, over the time decoding ran; at once, the window where every
    # request had its first piece and none had ended (all of them decoding together), else from first to last
    if concurrency > 1:
        lo, hi = max(r["first"] for r in res), min(r["end"] for r in res)
        if hi <= lo:
            lo, hi = min(r["first"] for r in res), max(r["end"] for r in res)
        decode_pieces = sum(sum(lo < t <= hi for t in r["arrivals"]) for r in res)
        decoding = hi - lo
    else:
        decode_pieces = sum(max(len(r["arrivals"]) - 1, 0) for r in res)
        decoding = sum(r["end"] - r["first"] for r in res)
    return {"requests": n, "answered": len(res), "unique": len(set(tags)) == n,
            "concurrency": concurrency, "wall_s": round(wall, 2), "tokens": tokens,
            "ttft_p50_s": round(_pct(ttft, 50), 3), "ttft_p95_s": round(_pct(ttft, 95), 3),
            "latency_p50_s": round(_pct(lat, 50), 3), "latency_p95_s": round(_pct(lat, 95), 3),
            "tokens_per_s": round(tokens / wall, 2),
            "decode_tokens_per_s": round(decode_pieces / decoding, 2) if decoding > 0 else None}


IN_HOUSE = ("load", "batching", "prefix", "peers")  # our own client's scenarios; serve.md needs each
SCENARIOS = (*IN_HOUSE, *serve_guidellm.LOADS)  # and GuideLLM's (serve_guidellm.LOADS)


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


PEERS = ("llama-server", "openvino-cb")


def serve_load(engine: str, threads: int, prompts: list[str], new: int, at_once: int, context: int, text: Text,
               extra: list[str] = (), **kw) -> dict:
    """One engine under one load (kw: request's chat / system); its summary and peak RSS."""
    if engine.startswith("openvino-cb"):  # openvino-cb-f32: float32 products (its default is bf16 where the CPU has it)
        return drive_in_process("openvino-cb", prompts, new, at_once, threads, system=kw.get("system"),
                                precision="f32" if engine.endswith("-f32") else "")
    if engine == "ours-engine":
        return drive_in_process(engine, prompts, new, at_once, threads, system=kw.get("system"))
    server = Server(engine, context, threads, list(extra))
    res = drive(server, text, prompts, new, at_once, **kw)
    res["peak_rss_mb"] = round(server.stop())
    return res


def load(text: Text, threads: int, n: int, peers: tuple[str, ...]) -> dict:
    import random

    rnd = random.Random(0)
    prompts = [text.take(rnd.randint(50, 400)) for _ in range(n)]
    out = {}
    for engine in ("ours-tokens-int4", *peers, *(("ours-engine",) if "openvino-cb" in peers else ())):
        out[engine] = serve_load(engine, threads, prompts, 32, 16, 2048, text)
        print(f"  {engine}: {out[engine]['wall_s']} s, {out[engine]['tokens_per_s']} tokens/s", flush=True)
    return out


def batching(text: Text, threads: int, n: int, peers: tuple[str, ...]) -> dict:
    """Ours per folder (the float16 and the int8 cache: at batch 16 a step reads 16 rows' caches, the weights once),
    one at a time and all at once; the peers all at once, with --threads and with none."""
    prompts = [text.take(1000) for _ in range(n)]
    out = {}
    for engine in ("ours-tokens-int4", "ours-tokens-int4-i8"):
        server = Server(engine, 2048, threads, ["--prefix-cache-mb", "0"])  # the same prompts twice
        one = drive(server, text, prompts, 128, 1, chat=True)
        many = drive(server, text, prompts, 128, n, chat=True)
        peak = server.stop()
        out[engine] = {"one_at_a_time": one, "concurrent": many, "peak_rss_mb": round(peak),
                       "ratio": round(many["decode_tokens_per_s"] / one["decode_tokens_per_s"], 2)}
    for engine in peers:
        for count in (threads, 0):
            res = serve_load(engine, count, prompts, 128, n, 2048, text, chat=True)
            out[threads_label(engine, count)] = {"concurrent": res, "peak_rss_mb": res["peak_rss_mb"]}
            print(f"  {threads_label(engine, count)}: {res['wall_s']} s, {res['decode_tokens_per_s']} decode "
                  "tokens/s", flush=True)
    if "openvino-cb" in peers:  # how much of its lead is bf16 on this CPU; ours without HTTP as it runs
        for engine in ("openvino-cb-f32", "ours-engine"):
            res = serve_load(engine, threads, prompts, 128, n, 2048, text, chat=True)
            out[engine] = {"concurrent": res, "peak_rss_mb": res["peak_rss_mb"]}
    return out


def prefix(text: Text, threads: int, n: int, peers: tuple[str, ...]) -> dict:
    system = text.take(2048)
    questions = [text.take(40) for _ in range(n + 1)]
    out = {}
    for engine in ("ours-tokens-int4", *peers):
        if engine == "openvino-cb":
            recs = drive_in_process("openvino-cb", questions, 16, 1, threads, system=system, raw=True)
        else:
            server = Server(engine, 4096, threads)
            recs = [request(server, text, i, q, 16, chat=True, system=system) for i, q in enumerate(questions)]
            server.stop()
        # the second request apart: our cache keeps a start at its second sighting (serving/prefix.py)
        cold, second, warm = recs[0]["ttft"], recs[1]["ttft"], statistics.median(r["ttft"] for r in recs[2:])
        out[engine] = {"system_tokens": text.count(system), "cold_ttft_s": round(cold, 3),
                       "second_ttft_s": round(second, 3), "warm_ttft_s": round(warm, 3), "ratio": round(cold / warm, 2)}
    return out


def peers(text: Text, threads: int, quick: bool, skip: bool) -> dict:
    out = {}
    for ctx, n, conc in ((1000, 4 if quick else 16, 4 if quick else 16), (8000, 2 if quick else 4, 2 if quick else 4)):
        prompts = [text.take(ctx) for _ in range(n)]
        for engine in ["ours-int4", "ours-tokens-int4"] + ([] if skip else ["llamacpp"]):
            # the count given, then (at 1k: a whole scenario's time at 8k) none: the default a user gets
            for count in (threads, 0) if ctx == 1000 else (threads,):
                server = Server(engine, ctx + 64, count, ["--max-seqs", str(conc)])
                res = drive(server, text, prompts, 32, conc)
                res["peak_rss_mb"] = round(server.stop())
                name = threads_label(engine, count)
                out[f"{name}@{ctx}"] = res
                print(f"  {name} at {ctx}: {res['wall_s']} s, {res['tokens_per_s']} tokens/s", flush=True)
    return out


def guidellm(text: Text, threads: int, quick: bool, with_peers: bool, scenario: str = "guidellm") -> dict:
    """GuideLLM drives the HTTP servers (tools/serve_guidellm.py) at the scenario's load (serve_guidellm.LOADS: its
    model, prompt and levels); OpenVINO's pipeline, which has no HTTP server here, runs in process on the same
    prompts."""
    load = serve_guidellm.LOADS[scenario]
    levels = load.levels[:2] if quick else load.levels
    engines = (*load.ours, *(("llama-server", "vllm") if with_peers else ()))
    models = {} if load.shape == "135M" else {"ours-tokens-int4": sized(load.shape, "ours"),  # the embedded: FOLDERS
                                              "llama-server": sized(load.shape, "gguf"),
                                              "vllm": sized(load.shape, "checkpoint")}
    data = {c: serve_guidellm.prompts_file(text, WORK / f"{scenario}-prompts-{c}.jsonl",
                                           load.lengths(min(load.at(c), 8) if quick else load.at(c)), load.output)
            for c in levels}  # each level its own prompts: a server's prefix cache finds none from the level before
    out = serve_guidellm.run(lambda e: Server(e, 2048, threads, model=models.get(e)), data, engines, WORK, scenario)
    if with_peers and not load.rates:  # the same prompts (at a concurrency: our in-process client has no rate), and
        # our engine the same way: the in-process pair compares without HTTP or GuideLLM on the cores
        prompts = {c: [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
                   for c, path in data.items()}
        for engine, folder in (("openvino-cb", sized(load.shape, "openvino") if models else None),
                               ("ours-engine", models.get("ours-tokens-int4"))):
            runs = [drive_in_process(engine, ps, load.output, c, threads, folder=folder) for c, ps in prompts.items()]
            out[f"{engine} (in process)"] = {"rows": [serve_guidellm.of_summary(r) for r in runs],
                                             "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
    return out


def _marked(key: str, variant: str) -> str:
    """A row's key with our kernel variant named: engine [variant], before the peers scenario's @length."""
    engine, at, length = key.partition("@")
    return f"{engine} [{variant}]{at}{length}"


def _lead(rows: dict, ours: str, key: str) -> str:
    """ours' figure against the best peer row's (key: a summary field, higher is better)."""
    peers = {k: v for k, v in rows.items() if k.split(" [")[0] in PEERS}  # openvino-cb-f32 is not what users get
    if not peers:
        return ""
    best = max(peers, key=lambda k: peers[k][key])
    return f"{rows[ours][key] / peers[best][key]:.2f}x {best}'s"


def _in_process(agg: dict) -> str:
    """Our engine against OpenVINO's pipeline, both in process (no HTTP)."""
    ours, ov = agg["ours-engine"], agg["openvino-cb"]
    return (f"; in process, {ours['tokens_per_s'] / ov['tokens_per_s']:.2f}x openvino-cb's over the wall and "
            f"{ours['decode_tokens_per_s'] / ov['decode_tokens_per_s']:.2f}x its decode")


def _where(res: dict, name: str) -> list[str]:
    """A section's machine line, when a part run recorded it (measured_on); the header's otherwise."""
    where = res.get("measured_on", {}).get(name)
    return [f"Measured on {where}.", ""] if where else []


def write(res: dict) -> None:
    (BENCHMARKS / "serve.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# Serving under load: `aqua-export serve` against llama-server and OpenVINO GenAI", "",
             written_by("serve"), "",
             f"{res.get('cpu', 'A 2-core CPU')}, our kernels' variant {' and '.join(res.get('variants') or ['-'])} "
             f"(rows marked [variant] for the others), {res['threads']} threads per engine given explicitly "
             "(in the batching scenario the peers "
             "again with none given: [default threads]), greedy, every request all its tokens; one engine at a "
             "time. Ours and llama-server over HTTP, streamed through the `openai` client; OpenVINO GenAI's "
             "continuous-batching pipeline in process (openvino-cb: no HTTP, its token ids counted; its default "
             "inference precision, bf16 on this CPU where it has avx512_bf16, and -f32 with float32 asked); "
             "ours-engine: our server's engine (serving.Engine) driven the same way in process, its token ids "
             "counted. "
             f"{SLOTS} sequences at once in each. Token counts by the embedded tokenizer.", ""]
    ld = res["load"]
    lines += ["## Load: 200 requests of 50-400 prose tokens + 32 generated, 16 at a time", "", *_where(res, "load"),
              *table(["engine", "answered", "unique", "TTFT p50 / p95 s", "latency p50 / p95 s", "wall s", "tokens/s",
                      "peak RSS MB"],
                     [[k, f"{v['answered']} of {v['requests']}", v["unique"], f"{v['ttft_p50_s']} / {v['ttft_p95_s']}",
                       f"{v['latency_p50_s']} / {v['latency_p95_s']}", v["wall_s"], v["tokens_per_s"],
                       v["peak_rss_mb"]] for k, v in ld.items()]), "",
              f"Ours: {_lead(ld, 'ours-tokens-int4', 'tokens_per_s')} tokens/s"
              + (f"; in process, {ld['ours-engine']['tokens_per_s'] / ld['openvino-cb']['tokens_per_s']:.2f}x "
                 "openvino-cb's" if "ours-engine" in ld and "openvino-cb" in ld else "") + ".", ""]
    rows, agg = [], {}
    for engine, b in res["batching"].items():
        for k in ("one_at_a_time", "concurrent"):
            if k not in b:
                continue
            x = b[k]
            if k == "concurrent":
                agg[engine] = x
            rows.append([engine, "one at a time" if x["concurrency"] == 1 else f"{x['concurrency']} at once",
                         x["wall_s"], x["tokens_per_s"], x["decode_tokens_per_s"], x["ttft_p50_s"], b["peak_rss_mb"],
                         f"**{b['ratio']}x**" if x["concurrency"] > 1 and "ratio" in b else ""])
    lines += ["## Continuous batching: 16 chats of 1k prose tokens, 128 tokens each", "", *_where(res, "batching"),
              *table(["engine", "", "wall s", "tokens/s (over the wall)", "decode tokens/s (all decoding)",
                      "TTFT p50 s", "peak RSS MB", "vs one at a time"], rows), "",
              "Tokens/s over the wall: the 16 x 128 generated tokens over the whole load, prompts included. Decode "
              "tokens/s: the pieces streamed while all 16 were decoding, over that window. Ours at 16 at once: "
              f"{_lead(agg, 'ours-tokens-int4', 'tokens_per_s')} tokens/s over the wall, "
              f"{_lead(agg, 'ours-tokens-int4', 'decode_tokens_per_s')} decode tokens/s"
              + (_in_process(agg) if "ours-engine" in agg and "openvino-cb" in agg else "") + ".", ""]
    lines += ["## Prefix cache: a 2k-token shared system prompt, then other questions under it", "",
              *_where(res, "prefix"),
              *table(["engine", "system prompt tokens", "TTFT first s", "TTFT second s", "TTFT third on (median) s",
                      "first / third on"],
                     [[k, v["system_tokens"], v["cold_ttft_s"], v.get("second_ttft_s", "-"), v["warm_ttft_s"],
                       f"{v['ratio']}x"] for k, v in res["prefix"].items()]), ""]
    rows = [[k.split("@")[0], k.split("@")[1], v["requests"], v["concurrency"], v["wall_s"], v["tokens_per_s"],
             f"{v['ttft_p50_s']} / {v['ttft_p95_s']}", v["peak_rss_mb"]] for k, v in res["peers"].items()]
    lines += ["## Against llama-cpp-python's server (one request at a time)", "", *_where(res, "peers"),
              *table(["engine", "prompt tokens", "requests", "at once", "wall s", "tokens/s", "TTFT p50 / p95 s",
                      "peak RSS MB"], rows), ""]
    for name, load in serve_guidellm.LOADS.items():
        lines += serve_guidellm.lines(res.get(name, {}), res.get("measured_on", {}).get(name, ""), load)
    (BENCHMARKS / "serve.md").write_text("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools serve", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run; writes nothing)")
    ap.add_argument("--skip-peers", action="store_true", help="ours only")
    ap.add_argument("--setup", action="store_true", help="build llama-server (build/llama-server) and stop")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="load,batching,prefix,peers",
                    help="scenarios to run (comma-separated); the others' figures are kept from benchmarks/serve.json")
    ap.add_argument("--variants", nargs="+", default=[], metavar="VARIANT",
                    help="our servers run once per native-kernel variant (x86-64-v2 / v3 / v4, AQUA_ORT_ISA; the "
                         "first keeps the plain rows, the others' rows are marked [VARIANT]); default: the one the "
                         "loader picks. The peers run once, at their own")
    a = ap.parse_args(argv)
    only = a.only.split(",")
    if set(only) - set(SCENARIOS):
        raise SystemExit(f"--only takes {', '.join(SCENARIOS)}")
    if a.setup:
        setup(("guidellm", "vllm"))
        return setup_llama_server()
    missing = [f"no {p}: {how}" for p, how in ((LLAMACPP, "python -m tools prefill --setup"),
                                                (OPENVINO, "python -m tools prefill --setup"),
                                                (LLAMA_SERVER, "python -m tools serve --setup"),
                                                (Path(PY["guidellm"]), "python -m tools serve --setup"),
                                                (Path(PY["vllm"]), "python -m tools serve --setup"))
               if not a.skip_peers and not p.exists()]
    if missing:
        raise SystemExit("; ".join(missing))
    peers_ = () if a.skip_peers else PEERS

    guided = [serve_guidellm.LOADS[n] for n in only if n in serve_guidellm.LOADS]  # the 135M's folders: FOLDERS
    needs = {"ours-tokens-int4", *(f for ld in guided if ld.shape == "135M" for f in ld.ours)} | (
        {"ours-tokens-int4-i8"} if "batching" in only else set()) | ({"ours-int4"} if "peers" in only else set())
    for name in needs:  # built once under build/prefill (calibration included: minutes each)
        make("ours:" + FOLDERS[name].name.removeprefix("ours-"))
    if peers_ and set(only) - {"peers"}:
        make("openvino:int4")
    from aqua_export.meter import cpu_name
    from aqua_export.runtime.session import forced_variant, native_variant, variants_here

    missing = [v for v in a.variants if v not in variants_here()]
    if missing:
        raise SystemExit(f"--variants {' '.join(missing)}: this CPU runs {', '.join(variants_here()) or 'none'}")
    text = Text()
    path = BENCHMARKS / "serve.json"
    res = json.loads(path.read_text()) if path.exists() and len(only) < len(SCENARIOS) else {}
    if len(only) == len(SCENARIOS):  # the header's machine; a part run names its own (measured_on)
        res["threads"], res["cpu"] = a.threads, cpu_name()
    ran = []  # our kernel variants, as each ran
    for vi, variant in enumerate(a.variants or [None]):
        with forced_variant(variant):  # our servers and in-process engines inherit it; the peers ignore it
            ran.append(native_variant())  # the forced one, or the loader's choice
            ps = peers_ if vi == 0 else ()
            runs = {"load": lambda: load(text, a.threads, 24 if a.quick else 200, ps),
                    "batching": lambda: batching(text, a.threads, 4 if a.quick else 16, ps),
                    "prefix": lambda: prefix(text, a.threads, 2 if a.quick else 4, ps),
                    "peers": lambda: peers(text, a.threads, a.quick, a.skip_peers or vi > 0),
                    **{name: (lambda name=name: guidellm(text, a.threads, a.quick, not (a.skip_peers or vi), name))
                       for name in serve_guidellm.LOADS}}
            for i, name in enumerate(SCENARIOS):
                if name in only:
                    print(name, f"[{native_variant()}]", flush=True)
                    text.at = i * len(text.ids) // len(SCENARIOS)  # each scenario its own part of the text
                    got = runs[name]()
                    if vi == 0:
                        res[name] = got
                    else:  # the other variants' rows of ours, marked
                        res[name].update({_marked(k, variant): v for k, v in got.items() if k.startswith("ours")})
                    print(" ", got, flush=True)
    if len(only) == len(SCENARIOS):
        res["variants"] = ran
    res.setdefault("measured_on", {}).update({name: f"{cpu_name()}, our kernels {' and '.join(ran)}, "
                                                     f"{a.threads} threads" for name in only})
    if not a.quick and all(k in res for k in IN_HOUSE):  # a GuideLLM section not yet run is left out
        write(res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
