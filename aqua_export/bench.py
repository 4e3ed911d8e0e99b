"""`aqua-export bench`: decode tokens/s and decode memory of built folders at a given context and batch.

Each (folder, round) is measured in a fresh process (its memory is that folder's alone), and the rounds
go over the folders in turn, so a slower or busier moment of the machine hits every folder alike; the
figure per folder is the median step time over all its rounds.

Runtimes:
    aqua    this project's loop (runtime.OrtLM, shared buffers); the context is written into the cache
            directly (random values of the cache's shape: decode cost depends on shapes, not values)
    genai   onnxruntime-genai itself (og.Generator): a random prompt of ``context`` tokens is prefilled
            through it (batch 1 in chunks of 1,024, a batch in one call), then generate_next_token is timed.
            Works for any folder genai loads, this project's or genai's own model builder's.
    genai-io the folder's graph driven in ONNX Runtime exactly as onnxruntime-genai drives it on CPU (one
            [B, Hkv, max_length, head_size] buffer bound as past and present, attention_mask [B, total]),
            the context written into the buffer directly: for contexts whose prefill genai cannot fit
"decode memory" is the largest resident set right after a decode step; "peak" the process's high-water mark
(VmHWM: loading, prefill and decode).

With prefill N (runtime aqua), each timed step is instead a whole prompt of N random tokens from an
empty cache (AQUA-H2O included: its prompt is one forward that evicts inside the graph).

With profile (runtime aqua), the timed steps run under ONNX Runtime's profiler and each folder also gets the
milliseconds a step spends in each op type (the median over rounds): where a step's time goes. The profiler
costs time per node, so its rounds' tokens/s are below an unprofiled run's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .config import ConfigError
from .ops.rules import budget
from .runtime.folder import FolderConfig
from .runtime.genai import GenaiGraph
from .runtime.lm import OrtLM

RUNTIMES = ("aqua", "genai", "genai-io")
GENAI_PROMPT_CHUNK = 256  # tokens per append_tokens call when a real prompt is prefilled through genai
PROFILE_ROWS = 8  # op types a folder's profile shows in the table (the JSON has all)


def bench(folders: list[str], context: int, batch: int, runtime: str = "aqua", steps: int = 8, rounds: int = 3,
          threads: int = 2, capacity: int = 0, prefill: int = 0, profile: bool = False) -> dict:
    """capacity: cache slots allocated (aqua, genai-io; 0 = just enough): a step's cost must not depend on it.
    prefill: time prompts of this many tokens instead of decode steps (runtime aqua; context unused).
    profile: each folder's ms a step per op type too (runtime aqua; "profile_ms")."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown --runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    if context < 1 or batch < 1 or steps < 1 or rounds < 1 or prefill < 0:
        raise ConfigError("--context, --batch, --steps and --rounds must be >= 1, --prefill >= 0")
    if prefill and runtime != "aqua":
        raise ConfigError("--prefill is measured in this project's runtime only: use --runtime aqua")
    if profile and runtime != "aqua":
        raise ConfigError("--profile reads ONNX Runtime's profiler in this project's runtime only: use --runtime aqua")
    needed = (prefill or context) + (0 if prefill else steps + 2)
    if capacity and capacity < needed:
        raise ConfigError(f"--capacity {capacity} is fewer cache slots than the {needed} this run fills (context, the "
                          "timed steps and a warm-up): give 0 (just enough) or more")
    for f in folders:
        _check_folder(Path(f), runtime, needed)
    times: dict = {f: [] for f in folders}
    rss: dict = {f: [] for f in folders}
    peak: dict = {f: [] for f in folders}
    ops: dict = {f: {} for f in folders}
    for _ in range(rounds):
        for f in folders:
            out = subprocess.run([sys.executable, "-m", "aqua_export.bench", f, str(context), str(batch), runtime,
                                  str(steps), str(threads), str(capacity), str(prefill), str(int(profile))],
                                 capture_output=True, text=True)
            if out.returncode:
                last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                raise ConfigError(f"bench of {f} failed: {last}")
            one = json.loads(out.stdout.strip().splitlines()[-1])
            times[f] += one["step_s"]
            rss[f].append(one["decode_rss_mb"])
            peak[f].append(one["peak_rss_mb"])
            for op, ms in one.get("profile_ms", {}).items():
                ops[f].setdefault(op, []).append(ms)
    res = {"context": context, "batch": batch, "runtime": runtime, "steps": steps, "rounds": rounds,
           "threads": threads, "capacity": capacity, "prefill": prefill, "profile": profile, "folders": {}}
    for f in folders:
        med = statistics.median(times[f])
        res["folders"][f] = {"step_s_median": med, "tokens_per_s": batch * (prefill or 1) / med,
                             "decode_rss_mb": max(rss[f]), "peak_rss_mb": max(peak[f])}
        if profile:  # an op type a round did not run counts 0 there
            per = {op: statistics.median(v + [0.0] * (rounds - len(v))) for op, v in ops[f].items()}
            res["folders"][f]["profile_ms"] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    return res


def _check_folder(folder: Path, runtime: str, tokens: int) -> None:
    """The folder loads in ``runtime`` and its model's context holds ``tokens``, or one line saying why not."""
    if runtime == "aqua" or not (folder / "genai_config.json").is_file():
        cfg = FolderConfig.from_folder(folder)  # not a built folder: one line naming the fix
        if runtime != "aqua":
            cfg.contract.genai_io()  # H2O or per-layer widths: one line naming --runtime aqua
            raise ConfigError(f"{folder} has no genai_config.json: rebuild it with this aqua-export")
        context = cfg.context_length
    else:
        try:
            context = json.loads((folder / "genai_config.json").read_text())["model"]["context_length"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"{folder}/genai_config.json is damaged: rebuild the folder") from None
        context = context if isinstance(context, int) else None
    if context is not None and tokens > context:
        raise ConfigError(f"{tokens} tokens (context, plus the timed steps) are past {folder}'s model context of "
                          f"{context}: lower --context (or --prefill)")


def table(res: dict) -> str:
    first = next(iter(res["folders"].values()))
    what = f"prefill of {res['prefill']} tokens" if res.get("prefill") else f"context {res['context']}"
    lines = [f"{what}, batch {res['batch']}, runtime {res['runtime']}, {res['threads']} threads, "
             f"{res['rounds']} rounds x {res['steps']} steps",
             "| folder | tokens/s | vs first | decode memory (MB) | vs first | peak (MB) |", "|---|---|---|---|---|---|"]
    for f, r in res["folders"].items():
        lines.append(f"| {f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / first['tokens_per_s']:.2f}x | "
                     f"{r['decode_rss_mb']:.0f} | {r['decode_rss_mb'] / first['decode_rss_mb']:.2f}x | "
                     f"{r['peak_rss_mb']:.0f} |")
    if res.get("profile"):
        lines += ["", f"Where a step's time goes (ONNX Runtime's profiler, ms a step, the {PROFILE_ROWS} largest op "
                      "types; the profiler slows every node, so these rounds' tokens/s are below an unprofiled run's). "
                      "`If` holds its branch's nodes, which count under their own types too; shares leave it out.", "",
                  "| folder | op type | ms a step | share |", "|---|---|---|---|"]
        for f, r in res["folders"].items():
            total = sum(ms for op, ms in r["profile_ms"].items() if op != "If") or 1.0
            for op, ms in list(r["profile_ms"].items())[:PROFILE_ROWS]:
                share = "" if op == "If" else f"{ms / total:.0%}"
                lines.append(f"| {f} | {op} | {ms:.2f} | {share} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# one measurement, in its own process
# --------------------------------------------------------------------------------------------

def _rss_mb() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _aqua_stepper(folder, context, batch, threads, rng, steps, capacity, **session):
    lm = OrtLM.from_folder(folder, threads, serving=(batch, max(capacity, context + steps + 2)), **session)
    ct = lm.contract
    past = lm.empty_past(batch)
    mask = np.ones((batch, context + steps + 2), np.int64)
    past.reserve(max(capacity, past.slots_for(mask)))
    # the slots a context of this length fills: all of them, or under H2O the budget it has evicted down to
    n = int(budget(lm.h2o_ratio, context)) if lm.h2o else context
    for kind in ("key", "value"):
        for a in past.arrays[kind]:
            a[:, :, :n] = rng.standard_normal(a[:, :, :n].shape, dtype=np.float32)
    if lm.h2o:
        for h, t in zip(past.arrays["heavy"], past.arrays["token"]):
            h[..., :n] = rng.random(h[..., :n].shape, dtype=np.float32)
            t[..., :n] = np.arange(context - n, context)
    past.length = context
    state = {"past": past, "pos": context}

    def step():
        p = state["pos"]
        _, state["past"] = lm.step(rng.integers(3, min(1000, ct.vocab), (batch, 1)), np.ones((batch, p + 1), np.int64),
                                   state["past"])
        state["pos"] = p + 1

    step.session = lm.session
    return step


def _aqua_prefiller(folder, prompt, batch, threads, rng, **session):
    lm = OrtLM.from_folder(folder, threads, serving=(batch, prompt), **session)
    vocab = lm.contract.vocab

    def step():
        lm.step(rng.integers(3, min(1000, vocab), (batch, prompt)), np.ones((batch, prompt), np.int64),
                lm.empty_past(batch))

    step.session = lm.session
    return step


def _genai_stepper(folder, context, batch, threads, rng, steps, capacity):
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + steps + 4, batch_size=batch, past_present_share_buffer=True)
    gen = og.Generator(model, params)
    vocab = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["vocab_size"]
    prompt = rng.integers(3, min(1000, vocab), (batch, context))
    # genai continues a prompt in chunks only at batch 1; it holds float32 logits for a whole chunk ([1, chunk, vocab]:
    # 0.5 GiB at 1024 tokens of a 128k vocabulary), so a serving loop appends long prompts in short chunks
    chunk = GENAI_PROMPT_CHUNK if batch == 1 else context
    for s in range(0, context, chunk):
        gen.append_tokens(prompt[:, s:s + chunk])
    return gen.generate_next_token


def _genai_io_stepper(folder, context, batch, threads, rng, steps, capacity):
    import onnxruntime as ort

    g = GenaiGraph(folder, threads)
    shape = (batch, g.dec["num_key_value_heads"], max(capacity, context + steps + 4), g.dec["head_size"])
    bufs = [(past, present, ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shape, dtype=np.float32)))
            for kind in ("key", "value") for past, present in g.buffers(kind)]
    state = {"pos": context}

    def step():
        p = state["pos"]
        io = g.session.io_binding()
        io.bind_cpu_input(g.io_in["input_ids"], rng.integers(3, min(1000, g.vocab), (batch, 1)).astype(np.int64))
        io.bind_cpu_input(g.io_in["attention_mask"], np.ones((batch, p + 1), np.int64))
        if "position_ids" in g.names:
            io.bind_cpu_input("position_ids", np.full((batch, 1), p, np.int64))
        for past, present, buf in bufs:
            io.bind_ortvalue_input(past, buf)
            io.bind_ortvalue_output(present, buf)
        io.bind_output(g.io_out["logits"])
        g.session.run_with_iobinding(io)
        state["pos"] = p + 1

    return step


def measure_one(folder: str, context: int, batch: int, runtime: str, steps: int, threads: int, capacity: int = 0,
                prefill: int = 0, profile: bool = False) -> dict:
    import contextlib
    import tempfile

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="aqua-bench-") if profile else contextlib.nullcontext() as tmp:
        session = {"profile": str(Path(tmp) / "ort")} if profile else {}
        if prefill:
            step = _aqua_prefiller(folder, prefill, batch, threads, rng, **session)
        else:
            make = {"aqua": _aqua_stepper, "genai": _genai_stepper, "genai-io": _genai_io_stepper}[runtime]
            step = make(folder, context, batch, threads, rng, steps, capacity, **session)
        step()  # warm-up: allocations, thread pool
        times, rss = [], []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
            rss.append(_rss_mb())
        out = {"step_s": times, "decode_rss_mb": max(rss), "peak_rss_mb": _peak_rss_mb()}
        if profile:
            out["profile_ms"] = op_times(step.session.end_profiling(), skip=1)
    return out


def op_times(path: str, skip: int = 0) -> dict:
    """ONNX Runtime's profile at ``path`` -> {op type: ms a run}, over the runs after the first ``skip``."""
    events = json.loads(Path(path).read_text())
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    if len(runs) <= skip:
        return {}
    start, per = runs[skip], {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e.get("args", {}).get("op_name", "?")
            per[op] = per.get(op, 0.0) + e["dur"] / 1000.0
    return {op: ms / (len(runs) - skip) for op, ms in per.items()}


if __name__ == "__main__":
    f, c, b, rt, s, th, cap, pre, prof = sys.argv[1:10]
    print(json.dumps(measure_one(f, int(c), int(b), rt, int(s), int(th), int(cap), int(pre), bool(int(prof)))))
