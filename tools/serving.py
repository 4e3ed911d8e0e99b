"""Serving at the sizes people deploy: random-weight checkpoints of the paper's model shapes (bfloat16, made in code)
built with the used-by setting (--k-ratio 0.75) and int4 weights, then decoded at context 4096, batch 1: the build's
peak memory, the serving peak RSS and tokens/s in this project's runtime and in onnxruntime-genai, against
onnxruntime-genai's own model builder's int4 export of the same checkpoint in the same run (where the builder fits
this machine). An OLMoE shape is also decoded through the all-experts form of the same int4 weights (every expert on
every token, as this project's graph computed MoE layers before QMoE). The int4 quality section compares perplexities
of the embedded trained model's folders (ours and the builder's int4, the float32 folder) on one text.

    python -m tools serving [--shapes 1.1B,8B,OLMoE-1B-7B] [--context 4096] [--work build/serving]
                            [--cache-dtype float16]   # the folders cache float16 (rows "<shape>, float16 cache")
    python -m tools serving --quality                 # the embedded model's int4 perplexities only
    python -m tools serving --report-only             # rewrite benchmarks/scale.md from the JSONs

Writes benchmarks/serving.json; tools/scale_report.py renders it (with tools/scale.py's build half) into
benchmarks/scale.md. Not CI:
hours on 2 cores. Each build, export and measurement runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILD_ARGS = ["--k-ratio", "0.75", "--weights", "int4", "--calib-text", "builtin:gpl-3", "--calib-tokens", "2048",
              "--parity-prompt-tokens", "128", "--parity-steps", "16"]
JSON = ROOT / "benchmarks" / "serving.json"
SHORT_CONTEXT = 512  # MoE shapes: the chosen experts against all of them where the experts are most of a step


def run(cmd: list[str], log: Path) -> dict:
    """cmd in its own process, output to ``log``: exit code, seconds and the process tree's peak RSS (GiB)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2), "log": str(log)}


def build_ours(ckpt: Path, out: Path, args: list[str]) -> dict:
    res = run([sys.executable, "-m", "aqua_export", "--model", str(ckpt), "--out", str(out), "--force", *args],
              out.parent / f"{out.name}.log")
    if res["rc"] == 0:
        cfg = json.loads((out / "aqua_config.json").read_text())
        par = json.loads((out / "parity.json").read_text())
        stages = {k: v for k, v in cfg["info"]["resources"].items() if isinstance(v, dict)}
        res.update(stages=stages, parity_pass=par["pass"], parity_failed=par.get("failed", []),
                   weights_bytes=sum(r["bytes"] for n, r in cfg["files"].items() if n.startswith("model.onnx")))
    return res


def build_genai(ckpt: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    res = run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out), "-p", "int4",
               "-e", "cpu", "-c", str(out.parent / "builder-cache")], out.parent / f"{out.name}.log")
    shutil.rmtree(out.parent / "builder-cache", ignore_errors=True)
    if res["rc"] == 0:
        res["weights_bytes"] = sum(p.stat().st_size for p in out.glob("model.onnx*"))
    return res


def bench(folders: list[Path], runtime: str, context: int, steps: int, rounds: int) -> dict:
    from aqua_export.bench import bench as measure

    return measure([str(f) for f in folders], context=context, batch=1, runtime=runtime, steps=steps, rounds=rounds)


def cache_bytes(folder: Path, tokens: int) -> int:
    """The KV cache of one sequence of ``tokens`` for a folder of this project or of genai's builder."""
    if (folder / "aqua_config.json").is_file():
        from aqua_export.runtime.folder import FolderConfig

        return FolderConfig.from_folder(folder).contract.cache_bytes(1, tokens)
    dec = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    return 2 * dec["num_hidden_layers"] * dec["num_key_value_heads"] * dec["head_size"] * tokens * 4


def serve_shape(name: str, work: Path, context: int, steps: int, rounds: int, genai_context: int,
                args: list[str]) -> dict:
    from tools.checkpoints import write_checkpoint

    ckpt = work / f"ckpt-{name}"
    params = write_checkpoint(ckpt, name)
    disk = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    res = {"params": params, "disk_bytes": disk}
    print(f"{name}: {params / 1e9:.2f}B parameters, {disk / 2**30:.2f} GiB", flush=True)
    ours, theirs = work / f"aqua-{name}", work / f"genai-{name}"
    res["build"] = build_ours(ckpt, ours, args)
    print(f"  build: rc {res['build']['rc']} in {res['build']['seconds']} s", flush=True)
    res["builder"] = build_genai(ckpt, theirs)
    if res["builder"]["rc"]:
        log = Path(res["builder"]["log"]).read_text(errors="replace").strip().splitlines()
        res["builder"]["why"] = "killed for memory (SIGKILL)" if res["builder"]["rc"] == -9 else \
            (log[-1][-200:] if log else "")
    print(f"  genai builder: rc {res['builder']['rc']} in {res['builder']['seconds']} s", flush=True)
    return measure_shape(name, work, res, context, steps, rounds, genai_context)


def measure_shape(name: str, work: Path, res: dict, context: int, steps: int, rounds: int, genai_context: int) -> dict:
    """Decode the built folders of a shape (res: serve_shape's build records) in onnxruntime-genai (a real prompt
    of genai_context tokens prefilled through it) and in this project's runtime (context written into the cache),
    then remove them."""
    from tools.moe_dense import all_experts_folder

    from aqua_export.bench import GENAI_PROMPT_CHUNK

    ckpt, ours, theirs = work / f"ckpt-{name}", work / f"aqua-{name}", work / f"genai-{name}"
    # a shape's own window bounds the context (TinyLlama's 1.1B: 2048 positions)
    limit = json.loads((ckpt / "config.json").read_text()).get("max_position_embeddings", context + steps + 8)
    context = res["context"] = min(context, limit - steps - 8)
    tokens = context + steps + 4
    if res["build"]["rc"] == 0:
        folders = [ours] + ([theirs] if res["builder"]["rc"] == 0 else [])
        res["cache_bytes"] = {str(f): cache_bytes(f, tokens) for f in folders}
        res["genai_context"] = min(context, genai_context)
        res["genai_cache_bytes"] = {str(f): cache_bytes(f, res["genai_context"] + steps + 4) for f in folders}
        res["genai_prompt_chunk"] = GENAI_PROMPT_CHUNK
        res["genai"] = bench(folders, "genai", res["genai_context"], steps, rounds)
        print(f"  genai: {json.dumps(res['genai']['folders'])}", flush=True)
        mine = [ours]
        if "OLMoE" in name:
            dense = work / f"all-experts-{name}"
            all_experts_folder(ours, dense)
            mine.append(dense)
            res["all_experts_weights_bytes"] = sum(p.stat().st_size for p in dense.glob("*.data"))
        res["aqua"] = bench(mine, "aqua", context, steps, rounds)
        print(f"  aqua: {json.dumps(res['aqua']['folders'])}", flush=True)
        if len(mine) > 1:  # at 4k the cache (the same in both graphs) is much of a step: a short context beside it
            res["aqua_short"] = bench(mine, "aqua", SHORT_CONTEXT, steps, rounds)
            res["short_cache_bytes"] = {str(ours): cache_bytes(ours, SHORT_CONTEXT + steps + 4)}
            print(f"  aqua at {SHORT_CONTEXT}: {json.dumps(res['aqua_short']['folders'])}", flush=True)
    for p in (ckpt, ours, theirs, work / f"all-experts-{name}"):
        shutil.rmtree(p, ignore_errors=True)
    return res


def quality(work: Path) -> dict:
    """The embedded trained model: our dense int4 folder (block 32, symmetric) against the builder's int4 of the same
    checkpoint, both against our float32 folder, our int4 at the used-by k 0.75, and both ends with a float16 cache,
    on builtin:gpl-3."""
    from aqua_export import models

    ckpt = models.resolve("llama")[0]
    common = ["--calib-text", "builtin:python-reference", "--parity-steps", "8"]
    ours = {"aqua float32": [], "aqua int4": ["--weights", "int4"],
            "aqua int4, k 0.75": ["--weights", "int4", "--k-ratio", "0.75"],
            "aqua float32, float16 cache": ["--cache-dtype", "float16"],
            "aqua int4, k 0.75, float16 cache": ["--weights", "int4", "--k-ratio", "0.75", "--cache-dtype", "float16"]}
    folders = {name: work / f"q-{i}" for i, name in enumerate([*ours, "genai builder int4"])}
    for name, extra in ours.items():
        run([sys.executable, "-m", "aqua_export", "--model", "llama", "--out", str(folders[name]), "--force", *common,
             *extra], folders[name].with_suffix(".log"))
    build_genai(Path(ckpt), folders["genai builder int4"])
    out = {}
    for name, folder in folders.items():
        r = subprocess.run([sys.executable, "-m", "aqua_export", "eval", "--folder", str(folder), "--text",
                            "builtin:gpl-3", "--tokens", "8192", "--seq-len", "512", "--json"], capture_output=True,
                           text=True)
        out[name] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1.1B,8B,OLMoE-1B-7B")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--genai-context", type=int, default=4096,
                    help="the prompt prefilled through onnxruntime-genai (its cost grows with the model: 8B at 4096 "
                         "takes most of an hour on 2 cores)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "build" / "serving"))
    ap.add_argument("--quality", action="store_true", help="only the embedded model's int4 perplexities")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--cache-dtype", choices=["float16"], help="build with --cache-dtype (recorded as its own rows)")
    a = ap.parse_args(argv)
    args = BUILD_ARGS + ["--cache-dtype", a.cache_dtype] * bool(a.cache_dtype)
    from tools.scale_report import write_report

    results = json.loads(JSON.read_text()) if JSON.exists() else {}
    if not a.report_only:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
        if a.quality:
            results["quality"] = quality(work)
        else:
            results.setdefault("shapes", {})
            for name in a.shapes.split(","):
                key = f"{name}, {a.cache_dtype} cache" if a.cache_dtype else name
                results["shapes"][key] = {**serve_shape(name, work, a.context, a.steps, a.rounds, a.genai_context,
                                                        args), "build_args": " ".join(args)}
                JSON.write_text(json.dumps(results, indent=1, sort_keys=True))
        JSON.write_text(json.dumps(results, indent=1, sort_keys=True))
    write_report()


if __name__ == "__main__":
    main()
