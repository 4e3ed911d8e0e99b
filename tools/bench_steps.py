"""Decode after a real prompt, our folders against each other in one interleaved run: each folder prefills the same
prompt through `aqua-export run`'s runtime (OrtLM: forwards of PREFILL_CHUNK tokens), then all of them step in turn,
one greedy-shaped step each per round, so a shared machine's drift hits every folder alike. The ratio the int8 cache
issue asks for (token selection with the int8 cache against the same folder with the float16 cache, batch 1 and 8,
after an 8k prompt) is a ratio of these medians; the peers' decode rates come from `python -m tools prefill`.

    -> benchmarks/steps.json, benchmarks/steps.md

Sessions run without spinning threads (several pools in one process would otherwise take each other's cores), so a
step here is slower than in a process of its own; only the ratios in one table are compared.

Rerun: `.venv/bin/python -m tools steps` (the two token folders of build/prefill, made as `python -m tools prefill`
makes them when absent; ~4 minutes a folder of prefill at batch 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tools.folders import OURS, make
from tools.folders import prompt as prompt_ids
from tools.harness import command, table, written_by

ROOT = Path(__file__).resolve().parents[1]


def measure(folders: dict, prompt: int, batch: int, steps: int, threads: int) -> list[dict]:
    """Per folder: the prefill's seconds, the median step (ms) over ``steps`` rounds after 5 warm ones, tokens/s
    (batch / step) and the cache's bytes per token; folders (name -> path) prefilled one after another."""
    import numpy as np

    from aqua_export.runtime.lm import OrtLM

    ids = np.repeat(np.load(prompt_ids(prompt))[None, :prompt], batch, 0)
    state = {}
    for name, path in folders.items():
        lm = OrtLM.from_folder(path, threads, serving=(batch, prompt + steps + 5), spin=False)
        mask = np.ones_like(ids)
        t = time.perf_counter()
        _, past = lm.prefill(ids, mask)
        state[name] = {"lm": lm, "mask": mask, "past": past, "prefill_s": time.perf_counter() - t, "times": []}
    nxt = np.full((batch, 1), 42, np.int64)  # a fixed token: the step's work does not depend on which
    for i in range(steps + 5):
        for s in state.values():
            s["mask"] = np.concatenate([s["mask"], np.ones((batch, 1), np.int64)], axis=1)
            t = time.perf_counter()
            _, s["past"] = s["lm"].step(nxt, s["mask"], s["past"])
            if i >= 5:
                s["times"].append(time.perf_counter() - t)
    rows = []
    for name, s in state.items():
        step = statistics.median(s["times"])
        rows.append({"folder": name, "prompt": prompt, "batch": batch, "prefill_s": round(s["prefill_s"], 2),
                     "step_ms": round(1e3 * step, 2), "tokens_per_s": round(batch / step, 1),
                     "cache_bytes_per_token": s["lm"].contract.cache_bytes(1, 1)})
    first = rows[0]["step_ms"]
    for r in rows:
        r["vs_first"] = round(first / r["step_ms"], 3)
    return rows


def render(res: dict) -> str:
    rows = [[r["folder"], r["batch"], r["prefill_s"], r["step_ms"], r["tokens_per_s"], f"{r['vs_first']}x",
             r["cache_bytes_per_token"]] for r in res["rows"]]
    return "\n".join([
        "# Decode after a real prompt: our folders stepping in turn", "", written_by("steps"), "",
        f"`{res['command']}` on {res['cpu']}, {res['threads']} threads, a {res['prompt']}-token prompt "
        "(build/prefill's) prefilled through `aqua-export run`'s runtime, then every folder one step per round; "
        "medians. Sessions without spinning threads: compare within a batch only.", "",
        *table(["folder", "batch", "prefill s", "step ms", "tokens/s", "speed vs the first", "cache bytes / token"],
               rows), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folders", nargs="+", choices=sorted(OURS), default=["tokens-int4-f16", "tokens-int4-i8"],
                    help="build/prefill's folders (python -m tools prefill's); the first is the reference")
    ap.add_argument("--prompt", type=int, default=7700, help="prompt tokens (plus the steps: within the context)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.prompt < 1 or a.steps < 1 or a.threads < 1 or min(a.batches) < 1 or a.prompt + a.steps + 5 > 8192:
        ap.error("--prompt, --steps, --threads and --batches must be >= 1, and prompt + steps + 5 <= 8192 (the "
                 "embedded model's context)")
    from aqua_export.meter import cpu_name

    folders = {name: make(f"ours:{name}") for name in a.folders}
    rows = [r for b in a.batches for r in measure(folders, a.prompt, b, a.steps, a.threads)]
    res = {"command": command("steps") + (" " + " ".join(argv) if argv else ""), "cpu": cpu_name(),
           "threads": a.threads, "prompt": a.prompt, "rows": rows}
    out = ROOT / "benchmarks"
    (out / "steps.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "steps.md").write_text(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
