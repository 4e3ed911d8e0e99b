"""benchmarks/scale.md from benchmarks/scale.json (tools/scale.py: building) and benchmarks/serving.json
(tools/serving.py: serving); each JSON records the command lines it was made with.

    python -m tools.scale_report
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.harness import table

ROOT = Path(__file__).resolve().parents[1]
BUILD_JSON = ROOT / "benchmarks" / "scale.json"
SERVING_JSON = ROOT / "benchmarks" / "serving.json"
# tools/scale.py's build, the rows of the building half not marked *
DEFAULT_ARGS = ("--k-ratio 0.75 --dtype float16 --calib-text builtin:gpl-3 --calib-tokens 2048 "
                "--parity-prompt-tokens 128 --parity-steps 16")


def write_report(build_json: Path = BUILD_JSON) -> None:
    """benchmarks/scale.md: the build half from build_json, the serving half from SERVING_JSON."""
    results = json.loads(build_json.read_text()) if build_json.exists() else {}
    stages = ["load", "calibrate", "export", "parity"]
    md = ["# Building and serving against model size", "",
          "## Building", "", "Written by `python -m tools scale` (random-weight Llama-shaped checkpoints of tools/checkpoints.py, bfloat16 on disk, built on "
          "this project's 2-core, 24 GiB CPU machine into float16 folders). Per stage: seconds / peak RSS in GiB "
          "(VmHWM reset at each stage start; it counts the mapped pages of the checkpoint and of model.onnx.data, which "
          "the kernel can drop and re-read under pressure). Target: peak <= 1.5 x disk + 3 GiB.", "",
          ]
    notes, rows = [], []
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["params"]):
        if r["build_args"] != DEFAULT_ARGS:
            notes.append(f"`{name.split(',')[0]}*{len(notes) + 1}`: `--sizes {name.split(',')[0]} --build-args "
                         f"\"{r['build_args']}\"`")
            name = f"{name.split(',')[0]}*{len(notes)}"
        disk = r["disk_bytes"] / 2**30
        if r["rc"] != 0:
            rows.append([name, f"{r['params'] / 1e9:.2f}B", f"{disk:.2f}", *("-" for _ in stages), "-",
                         f"{1.5 * disk + 3:.1f}", "-", r["seconds"], f"build failed (rc {r['rc']}, see its log)"])
            continue
        res = r["resources"]
        peak = max(res[s]["peak_rss_gib"] for s in stages if s in res)
        cells = [f"{res[s]['seconds']:.0f} s / {res[s]['peak_rss_gib']:.1f}" if s in res else "-" for s in stages]
        p = r["parity"]
        rows.append([name, f"{r['params'] / 1e9:.2f}B", f"{disk:.2f}", *cells, f"{peak:.1f}", f"{1.5 * disk + 3:.1f}",
                     f"{r['folder_bytes'] / 2**30:.2f}", r["seconds"],
                     f"{'pass' if r['parity_pass'] else 'FAIL'}: {p['max_abs_logit_diff_prefill']:.2f} / "
                     f"{p['max_abs_logit_diff_decode']:.2f}, top-1 {r['top1_unforced']:.2f}"])
    md += table(["model", "parameters", "disk (GiB)", *stages, "peak (GiB)", "target (GiB)", "folder (GiB)", "wall (s)",
                 "parity"], rows)
    md += ["", f"Build: `aqua-export --model DIR {DEFAULT_ARGS}`, except rows marked * (same tool, other arguments):",
           *[f"- {x}" for x in notes],
           "", "Parity: float16 ORT vs the float32 PyTorch reference, max |dlogit| prefill / decode under ORT's selection "
           "(gate 0.5), and top-1 agreement with each side selecting on its own (gate 0.95 counting float16 "
           "near-ties). A failed build's figures are in its log (build/scale/engine-NAME.log)."]
    md += ["", *report_lines()]
    (ROOT / "benchmarks" / "scale.md").write_text("\n".join(md) + "\n")


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _build_rows(shapes: dict) -> list[str]:
    rows = []
    for name, r in shapes.items():
        b, g = r["build"], r["builder"]
        ours = (f"{b['seconds']:.0f} / {max(s['peak_rss_gib'] for s in b['stages'].values()):.1f}"
                if b["rc"] == 0 else f"failed (rc {b['rc']})")
        parity = ("pass" if b.get("parity_pass") else f"FAIL ({', '.join(b.get('parity_failed', []))})") \
            if b["rc"] == 0 else "-"
        theirs = f"{g['seconds']:.0f} / {g['peak_rss_gib']:.1f}" if g["rc"] == 0 else f"cannot: {g.get('why', '')}"
        rows.append([name, f"{r['params'] / 1e9:.2f}B", _gib(r["disk_bytes"]), ours,
                     f"{1.5 * r['disk_bytes'] / 2**30 + 3:.1f}", parity, _gib(b.get("weights_bytes", 0)), theirs,
                     _gib(g["weights_bytes"]) if g["rc"] == 0 else "-"])
    return table(["shape", "parameters", "checkpoint (GiB)", "our build: s / peak (GiB)", "target (GiB)", "parity",
                  "int4 weights (GiB)", "genai builder int4: s / peak (GiB)", "its weights (GiB)"], rows)


def _decode_rows(shapes: dict) -> list[str]:
    rows = []
    for name, r in shapes.items():
        weights = {"aqua": r["build"].get("weights_bytes", 0), "genai": r["builder"].get("weights_bytes", 0),
                   "all": r.get("all_experts_weights_bytes", 0)}
        for run_key in ("genai", "aqua", "aqua_short"):
            runtime = run_key.split("_")[0]
            folders = r.get(run_key, {}).get("folders", {})
            base = {k: v for k, v in folders.items() if "/genai-" in k}
            dense = {k: v for k, v in folders.items() if "/all-experts-" in k}
            for f, m in folders.items():
                kind = "genai" if "/genai-" in f else "all" if "/all-experts-" in f else "aqua"
                label = {"genai": "genai builder int4", "all": "ours, all experts", "aqua": "ours int4 k 0.75"}[kind]
                own = {"genai": "genai_cache_bytes", "aqua_short": "short_cache_bytes"}.get(run_key, "cache_bytes")
                caches = r.get(own, r.get("cache_bytes", {}))  # the cache of the row's own context
                cache = caches.get(f, caches.get(f.replace("/all-experts-", "/aqua-"), 0))
                vs_b = f"{m['tokens_per_s'] / next(iter(base.values()))['tokens_per_s']:.2f}x" if base else "-"
                vs_d = f"{m['tokens_per_s'] / next(iter(dense.values()))['tokens_per_s']:.2f}x" if dense else "-"
                bound = 1.3 * weights[kind] + cache + 2**30
                ctx = r[run_key]["context"]  # the bench's own record
                ctx = f"{ctx} (chunks of {r.get('genai_prompt_chunk', 1024)})" if runtime == "genai" else ctx
                rows.append([name, ctx, runtime, label, f"{m['tokens_per_s']:.2f}", vs_b, vs_d,
                             f"{m['peak_rss_mb'] / 1024:.2f}", f"{bound / 2**30:.2f}"])
    return table(["shape", "context", "runtime", "folder", "tokens/s", "vs builder int4 (same runtime)", "vs all experts",
                  "serve peak (GiB)", "bound: 1.3 x weights + cache + 1 (GiB)"], rows)


def report_lines() -> list[str]:
    """Markdown for benchmarks/scale.md from benchmarks/serving.json (empty when it is absent)."""
    if not SERVING_JSON.exists():
        return []
    results = json.loads(SERVING_JSON.read_text())
    shapes = results.get("shapes", {})
    build_args = next(iter(shapes.values()), {}).get("build_args", "")
    md = ["## Serving", "",
          "Written by `python -m tools serving`: random-weight checkpoints of the paper's shapes (bfloat16, made in code: "
          "tools/checkpoints.py), built with `aqua-export --model DIR " + build_args + "` and by "
          "onnxruntime-genai's model builder (`-p int4 -e cpu`, block 32, accuracy level 4) in the same run, then "
          "decoded at batch 1 (context 4096, or the shape's own window less the steps: TinyLlama's 1.1B has 2048 "
          "positions; in genai a real prompt of the context column's length, 1024 for the largest shapes, whose "
          "prefill on 2 cores would otherwise take most of an hour, appended in chunks: genai holds float32 logits for "
          "a whole chunk; the bound counts the cache of the row's own context) on this 2-core CPU machine with `aqua-export bench` (a fresh process per folder and round; genai: the context is a "
          "real prompt prefilled through onnxruntime-genai; aqua: written into the cache). Build peak: the largest "
          "stage's VmHWM; serve peak: the bench process's VmHWM (loading, context and decode).", "",
          *[f"- rows `{n}`: built with `{r['build_args']}`" for n, r in shapes.items()
            if r.get("build_args", "") != build_args],
          "", *_build_rows(shapes), "", *_decode_rows(shapes)]
    if "quality" in results:
        q = results["quality"]
        ref = q.get("aqua float32", {}).get("perplexity")
        md += ["", "### Int4 quality (the embedded trained model)", "",
               "`python -m tools serving --quality`: perplexity through `aqua-export eval --folder` on builtin:gpl-3 "
               "(8,192 tokens, windows of 512) of folders built from the embedded SmolLM2-135M-Instruct: ours dense "
               "(k 1) float32 and int4 (block 32, symmetric, accuracy level 4), ours int4 at k 0.75, the float32 and the int4 "
               "k 0.75 folders again with a float16 cache (`--cache-dtype float16`), and "
               "onnxruntime-genai's builder int4 (block 32, accuracy level 4) of the same checkpoint.", ""]
        base = q.get("genai builder int4", {}).get("perplexity")
        rows = [[name, f"failed: {r.get('error', '')[-120:]}", "-", "-"] if "perplexity" not in r else
                [name, f"{r['perplexity']:.4f}", f"{r['perplexity'] / base - 1:+.2%}" if base else "-",
                 f"{r['perplexity'] / ref - 1:+.2%}" if ref else "-"] for name, r in q.items()]
        md += table(["folder", "perplexity", "vs genai builder int4", "vs float32"], rows)
    return md


if __name__ == "__main__":
    write_report()
