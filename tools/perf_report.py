"""benchmarks/performance.md from the JSON the bench tools write (attention_step.json, breakeven.json,
decode.json). Every figure is a ratio measured within one run of one tool.

Rerun: `.venv/bin/python -m tools performance` (after tools/bench_attention.py, bench_breakeven.py,
bench_decode.py; `make bench` runs all four).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from aqua_export.meter import cpu_name
from aqua_export.ops.spec import CACHE_TYPES
from aqua_export.outputs import atomic_write_bytes
from tools.harness import table, written_by


def _load(name):
    p = ROOT / "benchmarks" / name
    return json.loads(p.read_text()) if p.is_file() else None


def attention_section(data) -> list[str]:
    m = data["meta"]
    out = ["## Attention step (one decode step, ONNX Runtime, `python -m tools attention`)", "",
           f"{m['geometry']['heads']} query heads, {m['geometry']['kv_heads']} KV heads, d = {m['geometry']['head_dim']}; "
           f"{m['threads']} intra-op threads; medians of up to {m['reps']} interleaved rounds; {m['queries']} queries; "
           f"the CPU's caches {'left warm between steps' if m.get('caches', 'warm') == 'warm' else 'flushed before each step'}. "
           "AQUA = the fused `AquaAttention` node (native kernel) given q and P, as folders run it (q^ = qP inside the node). `X / AQUA` > 1 means AQUA is faster than X: "
           "fused dense = the same node at k = d (what a dense folder runs), ORT dense = MatMul, Softmax, MatMul "
           "(standard ops), GQA = ORT's GroupQueryAttention. Rule `head`: each query head its own top-k "
           "(magnitude / weighted); `group`: one top-k per GQA group (group / group-weighted). Byte limit = "
           "(K + V) / (u K + V) against a dense step, u = the share of K^'s rows read (the union of the group's "
           "selections; k/d for `group`). Rows with an h2o ratio h: AQUA-H2O, the `H2OAttention` node (native, given q and P) in its "
           "steady state (the context evicted to h of its tokens, one token in and one out per step, buffers "
           "updated in place); its byte limit counts each live slot's heavy (float32) and token (int64). Perplexity "
           "of each setting: `benchmarks/quality.md` (bytes table).", "",
           "Rows with a token ratio t (or a budget `bN`: N tokens): token selection (`AquaAttention` with "
           "token_ratio t or token_budget N, sink 16, window 64): the "
           "k selected rows of K^ score every token, the chosen pages' share rho of the tokens is read whole; byte "
           "limit (K + V) / (u K + rho (K + V)).", "",
           ]
    rows = []
    for r in data["rows"]:
        if r.get("cache", "float32") != "float32":
            continue
        tok = (f"{r['token_ratio']} ({r['token_share']:.3f})" if "token_ratio" in r
               else f"b{r['token_budget']} ({r['token_share']:.3f})" if "token_budget" in r else "-")
        rows.append([r["T"], r["batch"], r["rule"], r["k_ratio"], r.get("h2o_ratio", "-"), tok,
                     f"{r['union_fraction']:.2f}", f"**{r['fused_dense_over_aqua']:.2f}**",
                     f"{r['ort_dense_over_aqua']:.2f}", f"{r['gqa_over_aqua']:.2f}", f"{r['byte_limit']:.2f}"])
    out += table(["T", "batch", "rule", "k_ratio", "h2o ratio", "token ratio (rho)", "union u", "fused dense / AQUA",
                  "ORT dense / AQUA", "GQA / AQUA", "byte limit"], rows)
    fused = {(r["T"], r["batch"]): r["ort_dense_over_fused_dense"] for r in data["rows"]
             if r.get("cache", "float32") == "float32"}
    out += ["", "The fused node at k = d against ORT's standard-op dense step (ORT dense / fused dense): "
            + ", ".join(f"T {t} batch {b}: {v:.2f}" for (t, b), v in fused.items()) + "."]
    return out + _widths(data["rows"])


def _widths(rows: list[dict]) -> list[str]:
    """The token selection rows at the narrow cache widths: each against the fused dense node of its width and
    against the same setting at the wider widths (> 1: this width is faster)."""
    narrow = [r for r in rows if r.get("cache", "float32") != "float32" and "token_share" in r]
    if not narrow:
        return []
    # CACHE_TYPES runs widest first: a row is compared with the widths before its own
    widths = [w for w in CACHE_TYPES[:-1] if any(w in r["width_over_this"] for r in narrow)]
    out = ["", "### Cache widths", "", "Token selection's rows with float16 and int8 caches (int8: each token's K^ "
           "column and V row int8 with a scale code), in the same interleaved run: `fused dense / AQUA` against the "
           "fused dense node of the same width, `w / this` the same setting with the wider cache w over this one "
           "(> 1: the narrower cache's step is faster).", ""]

    def wider(r, w):
        return f"{r['width_over_this'][w]:.2f}" if CACHE_TYPES.index(w) < CACHE_TYPES.index(r["cache"]) else "-"

    body = [[r["T"], r["batch"], r["cache"], r["k_ratio"],
             f"{r['token_ratio']} ({r['token_share']:.3f})" if "token_ratio" in r
             else f"b{r['token_budget']} ({r['token_share']:.3f})", f"**{r['fused_dense_over_aqua']:.2f}**",
             *(wider(r, w) for w in widths)] for r in narrow]
    return out + table(["T", "batch", "cache", "k_ratio", "token ratio (rho)", "fused dense / AQUA",
                        *(f"{w} / this" for w in widths)], body)


def breakeven_section(data) -> list[str]:
    m = data["meta"]
    out = ["", "## Break-even T > d^2 / (d - k) (`python -m tools breakeven`)", "",
           f"Batch {m['batch']}, AQUA step (AquaAttention given P: q^ = qP inside the node, the {m['selection']} "
           "selection) vs the dense step (AquaAttention at k = d, no projection); "
           + f"{m['threads']} threads, medians of up to {m['reps']} interleaved rounds.", "",
           ]
    rows = []
    for r in data["rows"]:
        by = r["dense_over_aqua_by_T"]
        pts = " / ".join(f"{by.get(str(t), float('nan')):.2f}" for t in (16, 256, 1024, 8192))
        rows.append([f"{r['k_ratio']:.2f}", r["k"], f"{r['predicted_T']:.0f}", r["measured_crossover_T"], pts])
    out += table(["k_ratio", "k", "predicted T", "measured crossover T", "dense / AQUA at 16 / 256 / 1024 / 8192"],
                 rows)
    out += ["", "The prediction counts FLOPs: d^2 for q^ = qP against T (d - k) saved in the scores. The node "
            "projects in vector registers on L1-resident data and selects by a linear-time partition, so at "
            "small T the two steps are within a few percent of each other and the crossover is where AQUA "
            "stays ahead from then on (ratios near 1 at small T are within run noise)."]
    return out


def decode_section(data, title: str) -> list[str]:
    m = data["meta"]
    rows = data["rows"]
    out = ["", f"## {title}", "",
           f"{m['model']}; {m['threads']} threads; `aqua-export bench`: each (folder, round) in a fresh process, "
           f"{m['rounds']} rounds interleaved, median of {m['steps']} decode steps per round after a warm-up, the "
           "context written into the cache directly. Decode memory = largest resident set right after a step "
           "(weights + cache + runtime buffers). Ratios to this project's dense folder in the same run; every "
           "folder runs with past and present sharing one buffer, written in place."
           + ("" if m.get("attention") == "AquaAttention" else " **Measured with the folders of before the fused "
              "AquaAttention node** (TopKGatherDot, Softmax, ValueProduct per layer); rerun `python -m tools decode` "
              "for the current graph."), ""]
    old_h2o = m.get("h2o") != "H2OAttention"  # measured when the runtime evicted in NumPy between tokens
    if old_h2o:
        out += ["AQUA-H2O rows are left out: this run predates its H2OAttention node (see the AQUA-H2O section below, "
                "or rerun `python -m tools decode`).", ""]
    keyed = {(r["context"], r["batch"], r["variant"]): r for r in rows}
    cells = []
    for (ctx, b, v), r in keyed.items():
        d = keyed.get((ctx, b, "dense"))
        if d is None or (old_h2o and v.startswith("h2o")):
            continue
        cells.append([ctx, b, v, f"**{r['tokens_per_s'] / d['tokens_per_s']:.2f}**",
                      f"{r['decode_rss_mb'] / d['decode_rss_mb']:.2f}"])
    return out + table(["context", "batch", "variant", "tokens/s vs dense", "decode memory vs dense"], cells)


def genai_section(data) -> list[str]:
    m = data["meta"]
    out = ["", "## In onnxruntime-genai, against its own model builder (`python -m tools decode`)", "",
           f"{m['model']}; {m['threads']} threads; {m['rounds']} rounds interleaved x {m['steps']} decode steps, "
           "fresh process each. `ort-genai` = onnxruntime-genai's model builder export of the same checkpoint "
           "(`-p fp32 -e cpu`: GroupQueryAttention). Runtime `genai`: onnxruntime-genai itself (og.Generator, "
           "past_present_share_buffer), a random prompt of `context` tokens prefilled through it, then "
           "generate_next_token timed. Runtime `genai-io`: the same graphs driven in ONNX Runtime with exactly "
           "genai's CPU I/O (one [B, Hkv, max_length, head] buffer bound as past and present, attention_mask "
           "[B, total]), the context written into the buffers: our graph's prefill of 8 x 8k tokens would need "
           "a [8, 9, 8k, 8k] score tensor per layer (19 GB), which this 24 GB machine cannot hold "
           "(a fused prefill kernel is issue 12's).", "",
           ]
    keyed = {(r["context"], r["batch"], r["variant"]): r for r in data["rows"]}
    rows = [[ctx, b, r["runtime"], v, f"**{r['tokens_per_s'] / keyed[(ctx, b, 'ort-genai')]['tokens_per_s']:.2f}**",
             f"{r['decode_rss_mb'] / keyed[(ctx, b, 'ort-genai')]['decode_rss_mb']:.2f}"] for (ctx, b, v), r in keyed.items()]
    return out + table(["context", "batch", "runtime", "folder", "tokens/s vs ort-genai", "decode memory vs ort-genai"],
                       rows)


def h2o_section(data) -> list[str]:
    from aqua_export.ops.rules import slots_needed
    from aqua_export.ops.spec import SLOT_EXTRA_BYTES

    m = data["meta"]
    out = ["", "## AQUA-H2O against dense (`python -m tools decode --only h2o`)", "",
           f"{m['model']}; {m['threads']} threads; the dense folder and `h2o-0.5-k0.75` (keep half the tokens, "
           f"k 0.75) measured in one interleaved run per row, {m['rounds']} rounds, fresh process each. Decode: median "
           f"of {m['steps']} steps with the context already in the cache (under H2O: already evicted to its budget, "
           "ceil(0.5 context) slots). Prefill: a whole prompt from an empty cache, one forward for both (H2O evicts "
           "inside the graph, token by token, in that forward). Eviction runs in the H2OAttention node on "
           "fixed-capacity slots updated in place. Decode memory is the process's RSS (the 540 MB of weights "
           "included); cache bytes are the buffers' own size from the contract: per slot and KV head, K^ and V "
           "(2 x 64 float32) for both, plus heavy (float32) and token (int64) for H2O, over dense's context + 1 "
           "slots and H2O's h2o.slots_needed(0.5, context + 1).", "",
           ]
    keyed = {}
    for r in data["rows"]:
        keyed.setdefault((r["mode"], r.get("context", r.get("prompt")), r["batch"]), {})[r["variant"]] = r
    rows = []
    for (mode, n, b), rs in keyed.items():
        d, h = rs["dense"], rs["h2o-0.5-k0.75"]
        what = f"decode at {n}" if mode == "decode" else f"prefill of {n} tokens"
        mem = f"{h['decode_rss_mb'] / d['decode_rss_mb']:.2f}" if mode == "decode" else "-"
        cache = f"{slots_needed(0.5, [n + 1]) * (512 + SLOT_EXTRA_BYTES) / ((n + 1) * 512):.2f}" if mode == "decode" else "-"
        rows.append([what, b, f"**{h['tokens_per_s'] / d['tokens_per_s']:.2f}**", mem, cache])
    return out + table(["measurement", "batch", "h2o tokens/s vs dense", "h2o decode memory vs dense",
                        "h2o cache bytes vs dense"], rows)


def target_section(data) -> list[str]:
    m = data["meta"]
    out = ["", "## End to end at 8k, batch 8: the settings no worse than per-head magnitude at k 0.5 "
           "(`python -m tools decode --only target`)", "",
           f"{m['model']}; {m['threads']} threads; one interleaved run, {m['rounds']} rounds, fresh process each, "
           f"median of {m['steps']} decode steps with the context already in the cache (H2O: evicted to its budget), "
           "past and present sharing one buffer. Settings: the cheapest ones of `benchmarks/quality.md`'s bytes table "
           "whose perplexity is no worse than per-head magnitude at k 0.5 (with and without token eviction).", "",
           ]
    keyed = {r["variant"]: r for r in data["rows"]}
    d = keyed["dense"]
    rows = [[r["context"], r["batch"], v, f"**{r['tokens_per_s'] / d['tokens_per_s']:.2f}**",
             f"{r['decode_rss_mb'] / d['decode_rss_mb']:.2f}"] for v, r in keyed.items()]
    return out + table(["context", "batch", "variant", "tokens/s vs dense", "decode memory vs dense"], rows)


def tokens_section(data) -> list[str]:
    m = data["meta"]
    out = ["", "## Token selection end to end (`python -m tools decode --only tokens`)", "",
           f"{m['model']}; {m['threads']} threads; each row group one interleaved run, {m['rounds']} rounds, fresh "
           f"process each, median of {m['steps']} decode steps. `aqua`: this project's runtime, the context written "
           "into the cache; `genai`: onnxruntime-genai itself after a real prefill of a random prompt, against "
           "genai's model builder's fp32 export of the same checkpoint (`ort-genai`).", "",
           ]
    groups: dict = {}
    for r in data["rows"]:
        groups.setdefault((r["context"], r["batch"], r["runtime"]), []).append(r)
    cells = [[r["context"], r["batch"], r["runtime"], r["variant"], f"**{r['tokens_per_s'] / g[0]['tokens_per_s']:.2f}**",
              f"{r['decode_rss_mb'] / g[0]['decode_rss_mb']:.2f}"] for g in groups.values() for r in g]
    return out + table(["context", "batch", "runtime", "variant", "tokens/s vs the run's first row",
                        "decode memory vs the first"], cells)


def capacity_section(data) -> list[str]:
    m = data["meta"]
    out = ["", "## A step's cost against the buffer's size (`python -m tools decode --only capacity`)", "",
           f"The same 1k context, batch 1, in a shared buffer of just enough slots and in one of 8,192 (genai's "
           f"max_length for this model), driven with genai's CPU I/O; {m['rounds']} rounds alternating between the "
           "two sizes, fresh process each, median step.", "",
           ]
    by = {(r["variant"], r["capacity"]): r for r in data["rows"]}
    return out + table(["folder", "tokens/s, 8,192 slots vs just enough"],
                       [[v, f"{r['tokens_per_s'] / by[(v, 0)]['tokens_per_s']:.2f}"] for (v, cap), r in by.items() if cap])


def main(argv: list[str] | None = None) -> int:
    lines = ["# Performance", "", written_by("performance"), "", f"Machine: {cpu_name()}, {os.cpu_count()} cores (CPU only). Figures are ratios "
             "measured within one run; absolute times are not reported for CPU runs.", "",
             "These tables are CPU-only. The Triton kernel's GPU timings (H100) are in "
             "`benchmarks/gpu_attention.md` (`python -m tools gpu`, run where a GPU is lent).", ""]
    att, be, dec = _load("attention_step.json"), _load("breakeven.json"), _load("decode.json")
    if att:
        lines += attention_section(att)
    if be:
        lines += breakeven_section(be)
    if dec:
        lines += decode_section(dec, "End-to-end decode in `aqua-export run`'s runtime, all variants (`python -m tools decode`)")
    gen = _load("genai.json")
    if gen:
        lines += genai_section(gen)
    h2o = _load("h2o.json")
    if h2o:
        lines += h2o_section(h2o)
    tgt = _load("target.json")
    if tgt:
        lines += target_section(tgt)
    toks = _load("tokens.json")
    if toks:
        lines += tokens_section(toks)
    cap = _load("capacity.json")
    if cap:
        lines += capacity_section(cap)
    atomic_write_bytes(ROOT / "benchmarks" / "performance.md", ("\n".join(lines) + "\n").encode())
    print("wrote benchmarks/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
