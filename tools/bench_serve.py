"""Serving under load over HTTP, as users meet it: `aqua-export serve` against llama.cpp's server, each in its own
process on the loopback, driven by the official `openai` client (streaming, greedy), one engine at a time.

    python -m tools serve [--quick] [--skip-peers] [--threads 2]

Scenarios (each request a distinct slice of builtin:licenses prose; token counts by the embedded tokenizer, the GGUF's
own vocabulary):
    load      200 requests of 50-400 prompt tokens + 32 generated, 16 at a time, on our token-selection folder: none
              lost, none duplicated; p50 / p95 time to first token and latency, aggregate tokens/s
    batching  16 chats of 1k prompt tokens + 128 generated, one at a time and then all 16 at once on the same server,
              for the token-selection folder with a float16 and with an int8 cache: aggregate decode tokens/s
    prefix    a 2k-token shared system prompt, then 4 other questions under it: time to first token of the first
              (the prefix computed) against the next ones' (served from the prefix cache)
    peers     1k (16 requests, 16 at a time) and 8k (4 requests, 4 at a time) prompts + 32 generated: our dense int4
              and token-selection int4 folders against llama-cpp-python's server (built from PyPI; the embedded Q4_1
              GGUF, flash attention, f16 KV cache; it serves one request at a time); every server with --threads
              given and, at 1k, again with no thread count at all (rows marked [default threads]: what a user
              who sets nothing gets)

Writes benchmarks/serve.json and benchmarks/serve.md. Folders: build/prefill's ours-int4, ours-tokens-int4-f16 and
ours-tokens-int4-i8 (the same with --cache-dtype int8), built there once as `python -m tools prefill` builds them;
llama.cpp's server: build/venvs/llamacpp with llama-cpp-python[server] (`python -m tools prefill --setup`).
Not CI: about half an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.bench_prefill import threads_label
from tools.harness import BENCHMARKS, table, written_by

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "serve-bench"
FOLDERS = {"ours-tokens-int4": ROOT / "build" / "prefill" / "ours-tokens-int4-f16",
           "ours-tokens-int4-i8": ROOT / "build" / "prefill" / "ours-tokens-int4-i8",
           "ours-int4": ROOT / "build" / "prefill" / "ours-int4"}
LLAMACPP = ROOT / "build" / "venvs" / "llamacpp" / "bin" / "python"


class Text:
    """Prose slices of given token counts, none sharing a prefix with another (successive offsets)."""

    def __init__(self):
        from aqua_export.corpus import read_texts
        from aqua_export.runtime.text import load_tokenizer

        self.tok = load_tokenizer(FOLDERS["ours-int4"])
        self.ids = self.tok(read_texts(["builtin:licenses"]))["input_ids"]
        self.at = 0

    def take(self, n: int) -> str:
        if self.at + n > len(self.ids):
            self.at = 0
        piece = self.ids[self.at:self.at + n]
        self.at += n + 7
        return self.tok.decode(piece)

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1 (ours or llama.cpp's), its model id, its peak RSS when stopped."""

    def __init__(self, engine: str, context: int, threads: int, extra: list[str] = ()):  # extra: our server's options
        # threads 0: no thread count given (each server's own default, what a user who sets none gets)
        self.port = _port()
        WORK.mkdir(parents=True, exist_ok=True)
        self.log = open(WORK / f"{engine}.log", "w")
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        if engine == "llamacpp":
            from aqua_export import models

            gguf = models.embedded_gguf()
            counts = ["--n_threads", str(threads), "--n_threads_batch", str(threads)] if threads else []
            cmd = [str(LLAMACPP), "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", str(context),
                   *counts, "--flash_attn", "True",
                   "--interrupt_requests", "False",  # its default cuts a streaming request short when another comes
                   "--host", "127.0.0.1", "--port", str(self.port)]
            self.model = str(gguf)
        else:
            folder = FOLDERS[engine]
            counts = ["--threads", str(threads)] if threads else []
            cmd = [sys.executable, "-m", "aqua_export", "serve", str(folder), "--port", str(self.port), *counts,
                   "--context", str(context), "--max-seqs", "16", "--queue", "256", *extra]  # extra last:
            # argparse keeps the last --max-seqs
            self.model = folder.name
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{engine} server exited: see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{engine} server did not start in 300 s")

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                             timeout=3600)

    def stop(self) -> float:
        """Stops the server; its peak RSS in MB (VmHWM) read just before."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
        except OSError:
            peak = float("nan")
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        return peak


def request(server: Server, text: Text, tag: int, prompt: str, new: int, chat: bool = False,
            system: str | None = None) -> dict:
    """One streamed greedy request (all ``new`` tokens: ignore_eos where the server takes it): its tag, time to first
    text, end, each piece's arrival, the text's token count."""
    c = server.client()
    # every request generates all its tokens: ours with ignore_eos, llama.cpp's (which has no such field) with the
    # special tokens (ids 0..16 in this vocabulary: end of text, the chat markers) biased away
    extra = {"logit_bias": {str(i): -100 for i in range(17)}} if server.model.endswith(".gguf") else \
        {"extra_body": {"ignore_eos": True}}
    t0 = time.perf_counter()
    arrivals, parts = [], []
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        stream = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=new, temperature=0,
                                           stream=True, **extra)
        pieces = (ch.choices[0].delta.content if ch.choices else None for ch in stream)
    else:
        stream = c.completions.create(model=server.model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                      **extra)
        pieces = (ch.choices[0].text if ch.choices else None for ch in stream)
    for piece in pieces:
        if piece:
            arrivals.append(time.perf_counter())
            parts.append(piece)
    end = time.perf_counter()
    out = "".join(parts)
    first = arrivals[0] if arrivals else end
    return {"tag": tag, "start": t0, "ttft": first - t0, "first": first, "end": end, "arrivals": arrivals,
            "latency": end - t0, "tokens": text.count(out) if out else 0}


def drive(server: Server, text: Text, prompts: list[str], new: int, concurrency: int, **kw) -> dict:
    """Every prompt, ``concurrency`` at a time; the summary of what came back."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda ip: request(server, text, ip[0], ip[1], new, **kw), enumerate(prompts)))
    wall = time.perf_counter() - t0
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
    return {"requests": len(prompts), "answered": len(res), "unique": len(set(tags)) == len(prompts),
            "concurrency": concurrency, "wall_s": round(wall, 2), "tokens": tokens,
            "ttft_p50_s": round(_pct(ttft, 50), 3), "ttft_p95_s": round(_pct(ttft, 95), 3),
            "latency_p50_s": round(_pct(lat, 50), 3), "latency_p95_s": round(_pct(lat, 95), 3),
            "tokens_per_s": round(tokens / wall, 2),
            "decode_tokens_per_s": round(decode_pieces / decoding, 2) if decoding > 0 else None}


SCENARIOS = ("load", "batching", "prefix", "peers")


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def load(text: Text, threads: int, n: int) -> dict:
    import random

    rnd = random.Random(0)
    server = Server("ours-tokens-int4", 2048, threads)
    prompts = [text.take(rnd.randint(50, 400)) for _ in range(n)]
    res = drive(server, text, prompts, 32, 16)
    res["peak_rss_mb"] = round(server.stop())
    return res


def batching(text: Text, threads: int, n: int) -> dict:
    """Per folder (the float16 and the int8 cache: at batch 16 a step reads 16 rows' caches, the weights once)."""
    prompts = [text.take(1000) for _ in range(n)]
    out = {}
    for engine in ("ours-tokens-int4", "ours-tokens-int4-i8"):
        server = Server(engine, 2048, threads, ["--prefix-cache-mb", "0"])  # the same prompts twice
        one = drive(server, text, prompts, 128, 1, chat=True)
        many = drive(server, text, prompts, 128, n, chat=True)
        peak = server.stop()
        out[engine] = {"one_at_a_time": one, "concurrent": many, "peak_rss_mb": round(peak),
                       "ratio": round(many["decode_tokens_per_s"] / one["decode_tokens_per_s"], 2)}
    return out


def prefix(text: Text, threads: int, n: int) -> dict:
    server = Server("ours-tokens-int4", 4096, threads)
    system = text.take(2048)
    res = [request(server, text, i, text.take(40), 16, chat=True, system=system) for i in range(n + 1)]
    server.stop()
    cold, warm = res[0]["ttft"], statistics.median(r["ttft"] for r in res[1:])
    return {"system_tokens": text.count(system), "cold_ttft_s": round(cold, 3), "warm_ttft_s": round(warm, 3),
            "ratio": round(cold / warm, 2)}


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


def write(res: dict) -> None:
    (BENCHMARKS / "serve.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# Serving under load (`aqua-export serve` over HTTP)", "", written_by("serve"), "",
             f"2-core CPU, {res['threads']} threads per server (the peers' rows also with none given: "
             "[default threads]), greedy, streamed through the `openai` client; one "
             "server at a time. Token counts by the embedded tokenizer.", ""]
    ld = res["load"]
    lines += ["## Load: token-selection int4 folder", "",
              *table(["requests", "at once", "answered", "unique", "TTFT p50 / p95 s", "latency p50 / p95 s",
                      "tokens/s", "peak RSS MB"],
                     [[ld["requests"], ld["concurrency"], ld["answered"], ld["unique"],
                       f"{ld['ttft_p50_s']} / {ld['ttft_p95_s']}", f"{ld['latency_p50_s']} / {ld['latency_p95_s']}",
                       ld["tokens_per_s"], ld["peak_rss_mb"]]]), ""]
    rows = []
    for engine, b in res["batching"].items():
        for k in ("one_at_a_time", "concurrent"):
            x = b[k]
            rows.append([engine, "one at a time" if x["concurrency"] == 1 else f"{x['concurrency']} at once",
                         x["wall_s"], x["decode_tokens_per_s"], x["ttft_p50_s"],
                         f"**{b['ratio']}x**" if x["concurrency"] > 1 else ""])
    lines += ["## Continuous batching: 1k-token chats, 128 tokens each (the same 16 chats both ways)", "",
              *table(["folder", "", "wall s", "aggregate decode tokens/s", "TTFT p50 s", "vs one at a time"], rows),
              "", "Decode tokens/s at once: the pieces streamed while all 16 were decoding, over that window.", ""]
    p = res["prefix"]
    lines += ["## Prefix cache", "", f"A {p['system_tokens']}-token system prompt: time to first token {p['cold_ttft_s']} s "
              f"the first time, {p['warm_ttft_s']} s (median) from the prefix cache: **{p['ratio']}x**.", ""]
    rows = [[k.split("@")[0], k.split("@")[1], v["requests"], v["concurrency"], v["wall_s"], v["tokens_per_s"],
             f"{v['ttft_p50_s']} / {v['ttft_p95_s']}", v["peak_rss_mb"]] for k, v in res["peers"].items()]
    lines += ["## Against llama.cpp's server (llama-cpp-python, one request at a time)", "",
              *table(["engine", "prompt tokens", "requests", "at once", "wall s", "tokens/s", "TTFT p50 / p95 s",
                      "peak RSS MB"], rows), ""]
    (BENCHMARKS / "serve.md").write_text("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools serve", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run; writes nothing)")
    ap.add_argument("--skip-peers", action="store_true", help="no llama.cpp server")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="load,batching,prefix,peers",
                    help="scenarios to run (comma-separated); the others' figures are kept from benchmarks/serve.json")
    a = ap.parse_args(argv)
    only = a.only.split(",")
    if set(only) - set(SCENARIOS):
        raise SystemExit(f"--only takes {', '.join(SCENARIOS)}")
    if not a.skip_peers and not LLAMACPP.exists():
        raise SystemExit(f"no {LLAMACPP}: python -m tools prefill --setup")
    from tools.bench_prefill import _make

    for f in FOLDERS.values():  # built once under build/prefill (calibration included: minutes each)
        _make("ours:" + f.name.removeprefix("ours-"))
    text = Text()
    path = BENCHMARKS / "serve.json"
    res = json.loads(path.read_text()) if path.exists() and len(only) < len(SCENARIOS) else {}
    res["threads"] = a.threads
    runs = {"load": lambda: load(text, a.threads, 24 if a.quick else 200),
            "batching": lambda: batching(text, a.threads, 4 if a.quick else 16),
            "prefix": lambda: prefix(text, a.threads, 2 if a.quick else 4),
            "peers": lambda: peers(text, a.threads, a.quick, a.skip_peers)}
    for i, name in enumerate(SCENARIOS):
        if name in only:
            print(name, flush=True)
            text.at = i * len(text.ids) // len(SCENARIOS)  # each scenario its own part of the text, run alone or not
            res[name] = runs[name]()
            print(" ", res[name], flush=True)
    if not a.quick and all(k in res for k in SCENARIOS):
        write(res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
