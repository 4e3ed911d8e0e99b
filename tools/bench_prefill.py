"""A long prompt as users meet it: time to first token, decode tokens/s after the real prefill, the whole request,
and peak RSS, for this project's folders against the CPU runtimes users pick instead, interleaved in one run.

    -> benchmarks/prefill.json and benchmarks/prefill.md

Engines (each request in a fresh process of its own environment: tools/request_runner.py):
    ours-*        this project's folders of the embedded SmolLM2-135M (built by `aqua-export`), in onnxruntime-genai
                  (genai:) and in `aqua-export run`'s runtime (run:)
    builder-*     onnxruntime-genai's model builder (-e cpu: GroupQueryAttention, MatMulNBits for int4)
    openvino-*    OpenVINO GenAI's LLMPipeline on optimum-intel's conversion (int4: --weight-format int4 --group-size 32
                  --ratio 1.0, its default inference precision and u8 KV cache; f32: float32 inference precision (its
                  default is bf16 on a CPU with avx512_bf16 or AMX: int4-f32 shows that share);
                  -xattention: its XAttention sparse prefill, threshold 0.8, blocks of 64, stride 8)
    *-sparse      our folders with sparse prefill (--prefill-threshold 0.98)
    long-*        the same built from the embedded model with its RoPE scaled 4x (LONG_SOURCE, a 32k context): the
                  16k / 32k cases, where only speed is read
    llamacpp-q4_1 llama-cpp-python (built from PyPI) on the GGUF the project embeds: f16 KV cache (-q8_0: q8_0 keys
                  and values), flash attention, OMP_WAIT_POLICY=passive (batch 1 only: its Llama serves one sequence)
Prompt: English prose (builtin:python-reference), the first T tokens of the model's tokenizer; NEW greedy tokens
(the "8k request": 7,936 + 256 = 8,192 tokens, the embedded model's whole context).

Environments: .venv (ours, genai's builder); the peers' own, made by --setup under build/venvs from PyPI
(tools/folders.py's ENVS): an engine whose environment is missing is left out with one line. Rerun: `.venv/bin/python -m tools prefill --setup`
(--help for the cases).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tools.folders import PY, ROOT, WORK, make, prompt, setup, threads_label
from tools.harness import table

# engine name -> (environment, runner engine, folder maker)
ENGINES = {
    "genai:ours-dense": ("ours", "genai", "ours:dense"), "genai:ours-int4": ("ours", "genai", "ours:int4"),
    "genai:ours-tokens-int4-f16": ("ours", "genai", "ours:tokens-int4-f16"),
    "genai:ours-tokens": ("ours", "genai", "ours:tokens"),
    "run:ours-dense": ("ours", "aqua", "ours:dense"), "run:ours-tokens-int4-f16": ("ours", "aqua", "ours:tokens-int4-f16"),
    "genai:builder-fp32": ("ours", "genai", "builder:fp32"), "genai:builder-int4": ("ours", "genai", "builder:int4"),
    "openvino-int4": ("openvino", "openvino", "openvino:int4"),
    "openvino-f32": ("openvino", "openvino", "openvino:fp32@f32"),
    # int4 weights with float32 products: on a CPU with avx512_bf16 OpenVINO otherwise runs them in bf16
    "openvino-int4-f32": ("openvino", "openvino", "openvino:int4@f32"),
    "genai:ours-tokens-int4-i8": ("ours", "genai", "ours:tokens-int4-i8"),
    "genai:ours-tokens-int4-f16-sparse": ("ours", "genai", "ours:tokens-int4-f16-sparse"),
    "genai:ours-tokens-int4-f16-bf16": ("ours", "genai", "ours:tokens-int4-f16-bf16"),
    "genai:ours-tokens-int4-f16-sparse-bf16": ("ours", "genai", "ours:tokens-int4-f16-sparse-bf16"),
    "genai:ours-int4-sparse": ("ours", "genai", "ours:int4-sparse"),
    "openvino-int4-xattention": ("openvino", "openvino", "openvino:int4@xattention"),
    "genai:long-tokens-int4-f16": ("ours", "genai", "ours:long-tokens-int4-f16"),
    "genai:long-tokens-int4-f16-sparse": ("ours", "genai", "ours:long-tokens-int4-f16-sparse"),
    "genai:long-tokens-int4-f16-sparse-bf16": ("ours", "genai", "ours:long-tokens-int4-f16-sparse-bf16"),
    "llamacpp-q4_1": ("llamacpp", "llamacpp", "gguf:"),
    "llamacpp-q4_1-q8_0": ("llamacpp", "llamacpp", "gguf:@q8_0"),
}
DEFAULT = ["genai:ours-dense", "genai:ours-int4", "genai:ours-tokens-int4-f16", "run:ours-tokens-int4-f16",
           "genai:builder-fp32", "genai:builder-int4", "openvino-int4", "openvino-f32", "llamacpp-q4_1"]


def _one(engine: str, path: str, prompt: Path, batch: int, chunk: int, new: int, threads: int,
         variant: str | None = None) -> dict | None:
    env_name, runner, _ = ENGINES[engine]
    env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONPATH=str(ROOT))
    if variant:
        env["AQUA_ORT_ISA"] = variant  # our kernels' instruction-set variant (runtime.session.forced_variant)
    cmd = [PY[env_name], str(ROOT / "tools" / "request_runner.py"), runner, path, str(prompt), str(batch),
           str(chunk), str(new), str(threads)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if r.returncode:
        print(f"  {engine}: failed ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _our_folder(engine: str) -> bool:
    """Whether the engine runs one of this project's folders (genai's builder runs in our environment, not on our
    kernels)."""
    return ENGINES[engine][2].startswith("ours:")


def kernels_of(engine: str, variants: list[str]) -> list[str | None]:
    """The kernel variants an engine runs at: ours once per variant (None: the loader's choice), a peer once at its
    own."""
    return (list(variants) or [None]) if _our_folder(engine) else [None]


def kernels_label(engine: str, variant: str | None) -> str:
    """What the row's kernels are: ours the variant (the loader's choice named), a peer its own."""
    if not _our_folder(engine):
        return "its own"
    if variant:
        return variant
    from aqua_export.runtime.session import native_variant

    return native_variant() or "function bodies"


def run(engines: list[str], cases: list[tuple[int, int, int]], new: int, rounds: int, threads: list[int],
        variants: list[str] = ()) -> list[dict]:
    """threads: each engine runs once per count in a round; 0 sets none (the engine's default, what a user gets).
    variants: our engines run once per kernel variant in a round (none given: the loader's choice)."""
    WORK.mkdir(parents=True, exist_ok=True)
    present = []
    for e in engines:
        if not Path(PY[ENGINES[e][0]]).exists():
            print(f"  {e}: left out, its environment {Path(PY[ENGINES[e][0]]).parent.parent} is missing")
            continue
        present.append(e)
    paths = {e: make(ENGINES[e][2]) for e in present}
    rows = []
    for tokens, batch, chunk in cases:
        ids = prompt(tokens)
        # llama-cpp-python serves one sequence; only genai's API takes a prompt in several calls
        runs = {(e, t, v): [] for e in present for t in threads for v in kernels_of(e, variants)
                if not (batch > 1 and ENGINES[e][1] == "llamacpp") and not (chunk and ENGINES[e][1] != "genai")}
        for r in range(rounds):  # interleaved: every engine once per round
            for (e, t, v), done in runs.items():
                res = _one(e, paths[e], ids, batch, chunk, new, t, v)
                print(f"  {tokens} x{batch} chunk {chunk or 'one call'} round {r + 1} {threads_label(e, t)} "
                      f"[{kernels_label(e, v)}]: "
                      + (f"ttft {res['ttft_s']:.2f} s, {res['decode_tokens_per_s']:.1f} tok/s, "
                         f"{res['peak_rss_mb']:.0f} MB" if res else "-"), flush=True)
                if res:
                    done.append(res)
        for (e, t, v), rs in runs.items():
            if rs:
                rows.append({"engine": threads_label(e, t), "kernels": kernels_label(e, v), "threads": t or "default",
                             "prompt": tokens,
                             "batch": batch, "chunk": chunk, "new": new,
                             "ttft_s": min(x["ttft_s"] for x in rs),
                             "decode_tokens_per_s": max(x["decode_tokens_per_s"] for x in rs),
                             "e2e_s": min(x["e2e_s"] for x in rs), "peak_rss_mb": max(x["peak_rss_mb"] for x in rs),
                             "loaded_rss_mb": max(x["loaded_rss_mb"] for x in rs),
                             "first_tokens": rs[0]["first_tokens"], "rounds": len(rs)})
    return rows


def profile(folder: str, tokens: int, threads: int) -> str:
    """ONNX Runtime's per-node profile of one prefill of the prose prompt through the folder's graph on the
    package's native kernels (OrtLM, as `aqua-export run` feeds it; bench.op_times reads the profile): seconds per
    operator type, largest first."""
    import tempfile

    import numpy as np

    from aqua_export.bench import op_times
    from aqua_export.runtime.lm import OrtLM

    ids = np.load(prompt(tokens))[None]
    with tempfile.TemporaryDirectory() as tmp:
        lm = OrtLM.from_folder(folder, threads, kernel="native", serving=(1, tokens), profile=str(Path(tmp) / "ort"))
        lm.step(ids, np.ones_like(ids), lm.empty_past(1))
        per = sorted(((ms / 1e3, op) for op, ms in op_times(lm.session.end_profiling()).items()), reverse=True)
    lines = [f"{folder}: prefill of {tokens} tokens, {sum(sec for sec, _ in per):.2f} s in nodes"]
    lines += [f"  {op:36s} {sec:7.2f} s" for sec, op in per[:12]]
    return "\n".join(lines)


def rows_table(rows: list[dict]) -> str:
    new = rows[0]["new"] if rows else 0
    return "\n".join(table(["prompt", "batch", "appended", "engine", "kernels", "time to first token (s)",
                            "decode tokens/s", f"request: prompt + {new} tokens (s)", "peak RSS (MB)", "loaded (MB)"],
                           [[r["prompt"], r["batch"], "one call" if not r["chunk"] else r["chunk"], r["engine"],
                             r.get("kernels", "-"),
                             f"{r['ttft_s']:.2f}", f"{r['decode_tokens_per_s']:.1f}", f"{r['e2e_s']:.1f}",
                             f"{r['peak_rss_mb']:.0f}", f"{r['loaded_rss_mb']:.0f}"] for r in rows]))


def _case(s: str) -> tuple[int, int, int]:
    parts = [int(x) for x in s.split("x")]
    if len(parts) not in (2, 3) or min(parts[:2]) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: TOKENSxBATCH or TOKENSxBATCHxCHUNK, e.g. 8000x1 or 8000x1x512")
    return (parts[0], parts[1], parts[2] if len(parts) == 3 else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 7936 + 256 new tokens = 8192, the embedded model's context (genai refuses a max_length past it)
    ap.add_argument("--cases", nargs="+", type=_case, default=[_case(c) for c in ("7936x1", "1000x1", "4000x1",
                                                                                   "1000x4", "7936x1x512")])
    ap.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=DEFAULT)
    ap.add_argument("--new", type=int, default=256, help="greedy tokens after the prompt (the request's answer)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 0],
                    help="thread counts every engine runs at, each given explicitly; 0 gives none: the engine's own "
                         "default, what a user who sets nothing gets (default: 2 and 0)")
    ap.add_argument("--profile", metavar="FOLDER", help="print ONNX Runtime's per-node profile of one prefill of "
                    "the first case's prompt through FOLDER (this project's folder) instead")
    ap.add_argument("--variants", nargs="+", default=[], metavar="VARIANT",
                    help="our engines run once per kernel variant (x86-64-v2 / v3 / v4, AQUA_ORT_ISA; default: the "
                         "one the loader picks for this CPU); the peers run at their own")
    ap.add_argument("--setup", action="store_true", help="make the peers' environments first (tools/folders.py's ENVS)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "prefill"))
    a = ap.parse_args(argv)
    if a.new < 2 or a.rounds < 1 or min(a.threads) < 0:
        ap.error("--new must be >= 2, --rounds >= 1, --threads >= 0")
    from aqua_export.meter import cpu_name

    if a.profile:
        print(profile(a.profile, a.cases[0][0], max(a.threads)))
        return 0
    if a.setup:
        setup()
    from aqua_export.runtime.session import variants_here

    missing = [v for v in a.variants if v not in variants_here()]
    if missing:
        ap.error(f"--variants {' '.join(missing)}: this CPU runs {', '.join(variants_here()) or 'none'}")
    rows = run(a.engines, a.cases, a.new, a.rounds, a.threads, a.variants)
    command = "python -m tools prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    for r in rows:
        r["command"], r["cpu"] = command, cpu_name()
    # the rows of other cases stay (each case is one interleaved run of its own, its command beside it)
    old = json.loads(Path(a.out + ".json").read_text()) if Path(a.out + ".json").exists() else {"rows": []}
    for r in old["rows"]:  # rows from before each row named its CPU: the file's
        r.setdefault("cpu", old.get("meta", {}).get("cpu", "unknown CPU"))
    old = old["rows"]
    key = ("prompt", "batch", "chunk", "command")
    ran = {tuple(r[k] for k in key) for r in rows}
    rows = sorted([r for r in old if tuple(r[k] for k in key) not in ran] + rows,
                  key=lambda r: (r["chunk"] > 0, r["batch"], -r["prompt"]))
    meta = {"threads": a.threads}
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    Path(a.out + ".md").write_text(_markdown(meta, rows))
    print(rows_table([r for r in rows if tuple(r[k] for k in key) in ran]))
    return 0


def _markdown(meta: dict, rows: list[dict]) -> str:
    threads = ("each engine given the thread count its block's command names (--threads; 2 where it names none), and "
               "with 0 none at all: the engine's own default, what a user who sets nothing gets (rows marked [default "
               "threads])")
    intro = (f"Written by `python -m tools prefill`, {threads}; each request in a fresh process, each case one "
             "interleaved run (every engine once per round, best of its rounds), on the CPU its block names. Kernels: "
             "our native kernels' instruction-set variant (x86-64-v2 SSE4.2, v3 AVX2, v4 AVX-512; `--variants` runs "
             "each), or the peer's own. Time to first token: from handing over the prompt's ids to the first "
             "generated id; decode tokens/s: the tokens after it (times the batch); request: both; peak RSS: the "
             "process's high-water mark, loading included; loaded: resident once loaded, before the prompt. Engines: "
             "see the tool's docstring.")
    out = ["# A long prompt, as users meet it", "", intro, ""]
    for cmd, cpu in dict.fromkeys((r["command"], r["cpu"]) for r in rows):
        mine = [r for r in rows if r["command"] == cmd and r["cpu"] == cpu]
        out += [f"`{cmd}` on {cpu} (rounds: {max(r['rounds'] for r in mine)}):", "", rows_table(mine), ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
