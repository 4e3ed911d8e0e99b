"""Perplexity grid of AQUA on the embedded model -> benchmarks/quality.md (+ retention plot).

Calibration text: builtin:python-reference (CPython's pydoc_data topics), first 16384 tokens.
Evaluation text:  builtin:gpl-3 (/usr/share/common-licenses/GPL-3), all of it, windows of 512.
Both exist offline on every fresh machine of ours. Rerun: `make quality` or
`.venv/bin/python -m tools quality [--tokens N]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from aqua_export import calibrate, corpus, evaluate, models
from aqua_export.projection import load_projection
from aqua_export.projection import write as write_projection
from aqua_export.slice_costs import add_costs
from aqua_export.ops.spec import SLOT_EXTRA_BYTES
from aqua_export.config import AquaConfig
from aqua_export.outputs import atomic_write_bytes
from tools.harness import table, written_by
from tools import quality_alloc
from tools import quality_long, quality_prefill, quality_qa, quality_ruler

CALIB, EVAL = "builtin:python-reference", "builtin:gpl-3"
K_RATIOS = (1.0, 0.9, 0.75, 0.5, 0.4, 0.3)
SELECTIONS = ("magnitude", "static", "weighted", "group", "group-weighted")
GROUP_K = (0.75, 0.625, 0.5625, 0.5)  # the group rules' k_ratios: between 0.5 and 0.75 is where they pay off
SECTIONS = ("selection", "memory", "h2o", "h2o-group", "retention", "lmeval", "long", "passkey", "k-alloc",
            "prefill", "qa", "ruler")
MEMORY = [(s, k) for s in (0.1, 0.25) for k in (0.75, 0.9, 1.0)]
# AQUA-Memory's allocations compared with uniform at k 0.9 ('measured' also works, after 2 L n forwards that
# measure its costs: add it here to compare it too)
ALLOCS = ("energy",)
H2O = [(h, k) for h in (0.25, 0.5, 0.75) for k in (0.5, 0.75, 1.0)]
# AQUA-H2O with the group-shared rule, for the bytes table: fewer tokens and fewer rows of K^ per step
H2O_GROUP = [(0.75, 0.75), (0.875, 0.625), (0.75, 0.625)]
H2O_SLOT_EXTRA = SLOT_EXTRA_BYTES / (64 * 4)  # heavy and token per slot, against one of K^ or V (d = 64)
LM_EVAL = {"dense": AquaConfig(), "AQUA k 0.75": AquaConfig(k_ratio=0.75), "AQUA k 0.5": AquaConfig(k_ratio=0.5),
           "AQUA-Memory s 0.1, k 0.9": AquaConfig(k_ratio=0.9, slice_ratio=0.1),
           "AQUA-Memory s 0.25, k 0.9": AquaConfig(k_ratio=0.9, slice_ratio=0.25),
           # a prompt of 192 tokens or more only (ops.rules.prefill_rows): the items' lengths are in the section's text
           "sparse prefill 0.98": AquaConfig(prefill_threshold=0.98)}
LM_METRICS = [("aqua_lastword", "acc,none", "last word acc"), ("aqua_lastword", "perplexity,none", "last word ppl"),
              ("aqua_choice", "acc,none", "choice acc"), ("aqua_choice", "acc_norm,none", "choice acc_norm"),
              ("aqua_rolling", "word_perplexity,none", "paragraph word ppl"),
              ("aqua_copy", "exact_match,none", "copy exact match")]
PAPER = {1.0: (8.91, 11.34), 0.9: (8.91, 11.34), 0.75: (8.93, 11.33), 0.5: (9.20, 11.34), 0.4: (9.81, 11.47),
         0.3: (12.55, 12.14)}


def kv_split(model, tok, text: str, proj, a) -> dict:
    """Perplexity at k 0.9 with uniform slicing's bytes spent on one side: keys cut to 2r - d with values whole,
    or the reverse."""
    from aqua_export.reference.attention import apply_aqua

    n, d = len(proj.P), proj.P[0].shape[-1]
    out = {}
    for s in (0.1, 0.25):
        cut = 2 * AquaConfig(slice_ratio=s).retained_width(d) - d
        for side, (kw, vw) in {"keys": ((cut,) * n, (d,) * n), "values": ((d,) * n, (cut,) * n)}.items():
            with torch.no_grad(), apply_aqua(model, proj, AquaConfig(k_ratio=0.9), widths=kw, value_widths=vw):
                r = evaluate.perplexity(model, tok, text, tokens=a.tokens, seq_len=a.seq_len)
            out[f"{s}/{side}"] = {"perplexity": r["perplexity"], "cut_to": cut}
            print(f"memory split s {s}, {side} cut to {cut}: ppl {r['perplexity']:.4f}", flush=True)
    return out


def memory_alloc_lines(mem: dict, alloc: dict, dense: float, split: dict) -> list[str]:
    """The allocations against uniform slicing at the same cache bytes, k 0.9."""
    L = ["### Where the width goes: allocation at the same cache bytes (k_ratio 0.9)\n",
         "`--slice-alloc`: every layer's K^ and V get their own widths, summing to uniform slicing's (allocate.py): "
         "the same cache bytes. `energy`: water-filling on the calibrated spectra (the share of the q/k stack's "
         "energy a K^ width drops, of the values' energy a V width drops); `measured` (compared when listed in "
         "ALLOCS): on measured costs, the KL of the next-token distribution when only one layer's K^ or V is cut "
         "(calibration text). Increase = perplexity - dense; ratio = allocated increase / uniform increase "
         "(<= 0.5 halves it).\n",
         ]
    L += table(["slice_ratio", "uniform", *ALLOCS, *(f"{a} / uniform increase" for a in ALLOCS)],
               [[s, f"{mem[(s, 0.9)]:.4f}", *(f"{alloc[(s, a)]:.4f}" for a in ALLOCS),
                 *(f"{(alloc[(s, a)] - dense) / (mem[(s, 0.9)] - dense):.2f}" for a in ALLOCS)] for s in (0.1, 0.25)])
    if split:
        L += ["", "Why the allocations cut keys first: the same bytes spent on one side only, keys cut to 2r - d with "
              "V whole, or V cut with keys whole (every layer alike).\n"]
        rows = []
        for s in (0.1, 0.25):
            u, k_, v_ = mem[(s, 0.9)], split[f"{s}/keys"], split[f"{s}/values"]
            rows.append([s, f"{u:.4f}", f"{k_['perplexity']:.4f} (K^ {k_['cut_to']})",
                         f"{v_['perplexity']:.4f} (V {v_['cut_to']})", f"{(k_['perplexity'] - dense) / (u - dense):.2f}"])
        L += table(["slice_ratio", "uniform (K^ and V at r)", "keys cut, V whole", "V cut, keys whole",
                    "keys-only / uniform increase"], rows)
    L.append("")
    return L


def lm_eval_grid(proj_path: Path) -> dict:
    """lm-eval's aqua_local on the reference for each LM_EVAL setting, and on a k 0.75 folder run by ONNX Runtime
    (with the items whose accuracy differs from the reference's)."""
    import tempfile

    from aqua_export.build import build
    from aqua_export.options import BuildOptions
    from aqua_export.lm_eval_model import LOCAL_TASKS, AquaLM, evaluate

    def measure(lm):
        t = time.perf_counter()
        with lm:
            r = evaluate(lm, ["aqua_local"], log_samples=True)
        acc = {task: [s.get("acc", s.get("exact_match")) for s in r["samples"][task]] for task in LOCAL_TASKS}
        return {"results": {t_: r["results"][t_] for t_ in LOCAL_TASKS}, "acc": acc,
                "seconds": time.perf_counter() - t}

    grid = {}
    for name, cfg in LM_EVAL.items():
        given = {s: getattr(cfg, s) for s in AquaLM.SETTINGS if getattr(cfg, s) != getattr(AquaConfig(), s)}
        grid[name] = measure(AquaLM(model="llama", projection=None if cfg.is_dense else str(proj_path),
                                    batch_size=8, **given))
        print(f"lm-eval {name}: {grid[name]['seconds']:.0f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build("llama", LM_EVAL["AQUA k 0.75"], projection_path=str(proj_path), calib_texts=None,
                       out=str(Path(tmp) / "k0.75"), options=BuildOptions(parity_steps=8))
        ort = measure(AquaLM(folder=str(folder), batch_size=8, threads=2))
    ref = grid["AQUA k 0.75"]["acc"]
    ort["differing_items"] = sum(a != b for t in LOCAL_TASKS for a, b in zip(ort["acc"][t], ref[t]))
    grid["AQUA k 0.75, built folder (ONNX Runtime)"] = ort
    dense, sparse = grid["dense"]["acc"], grid["sparse prefill 0.98"]
    sparse["differing_items"] = sum(a != b for t in LOCAL_TASKS for a, b in zip(sparse["acc"][t], dense[t]))
    return grid


def lm_eval_lines(grid: dict) -> list[str]:
    first = next(iter(grid.values()))["results"]
    sizes = ", ".join(f"{t} {first[t]['sample_len']}" for t in first)
    L = ["\n## lm-evaluation-harness on the offline tasks (`aqua-export lm-eval --tasks aqua_local`)\n",
         f"Every item of each task ({sizes}), made from the evaluation text (`lm_eval_tasks/aqua_tasks.py`); the "
         "reference (PyTorch) for each setting, and the k 0.75 setting again as a built folder run by ONNX Runtime, "
         "compared item by item with the reference.\n"]
    L += table(["setting", *(m[2] for m in LM_METRICS)],
               [[name] + [f"{g['results'][t][m]:.4f}" if "ppl" in label else f"{g['results'][t][m]:.3f}"
                          for t, m, label in LM_METRICS] for name, g in grid.items()])
    ort = grid.get("AQUA k 0.75, built folder (ONNX Runtime)")
    if ort is not None:
        L.append(f"\nBuilt folder against the reference at k 0.75: {ort['differing_items']} item(s) whose accuracy "
                 "differs.\n")
    sparse = grid.get("sparse prefill 0.98", {})
    if "differing_items" in sparse:
        dense = grid["dense"]["results"]
        gap = max(abs(v / dense[t][m] - 1) for t, r in sparse["results"].items() for m, v in r.items()
                  if isinstance(v, float) and dense[t].get(m))
        L.append(f"\nSparse prefill (`--prefill-threshold 0.98`) against dense: {int(sparse['differing_items'])} "
                 f"item(s) whose accuracy differs; every figure within {gap:.1e} of dense's, relative. These items "
                 "are short, and the rule leaves a forward of under 192 tokens dense and a longer one's last 128 rows, "
                 "so they barely exercise it: the perplexity and pass-key sections do.\n")
    return L


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=100_000, help="evaluation tokens (GPL-3 has ~7.7k)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--long-tokens", type=int, default=8192, help="tokens of the long-window text per window length "
                    "(section long)")
    ap.add_argument("--ruler-lengths", default=",".join(map(str, quality_ruler.LENGTHS)),
                    help="section ruler: the prompt lengths in tokens")
    ap.add_argument("--ruler-items", type=int, default=quality_ruler.ITEMS, help="section ruler: items per task and "
                    "length")
    ap.add_argument("--ruler-tasks", default=",".join(quality_ruler.TASKS), help="section ruler: lm-eval's tasks")
    ap.add_argument("--ruler-engines", default="", help="section ruler: only these engines, comma-separated (ours: "
                    f"{', '.join(quality_ruler.SETTINGS)}; openvino <mode>: {', '.join(quality_ruler.OPENVINO)}), "
                    "their cells merged into quality.json's of the same item count (default: every engine)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="measure only these (the others' figures are kept from quality.json, measured with the same "
                         "projection file: it is recalibrated only when every section is measured)")
    ap.add_argument("--render", action="store_true", help="only rewrite quality.md from quality.json and "
                    "retention.json (no model, nothing measured)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.render:
        md = render(json.loads((out / "quality.json").read_text()), json.loads((out / "retention.json").read_text()))
        atomic_write_bytes(out / "quality.md", md.encode())
        return 0
    sections = set(a.sections.split(","))
    torch.set_num_threads(2)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = models.load("llama")
    proj_path = out / "llama-projection.safetensors"
    old = json.loads((out / "quality.json").read_text()) if (out / "quality.json").is_file() else {}
    if old and "results" not in old:  # written before sections existed: results only
        old = {"results": old, "calibration": {"tokens": a.calib_tokens, "seconds": None}}
    if sections >= set(SECTIONS) or not old:
        sections = set(SECTIONS)
        old = {}
    if not old or not proj_path.is_file():  # a fresh clone has none: the same text and tokens give the same P
        t0 = time.perf_counter()
        tensors, meta = calibrate.calibrate(model, tok, texts=[CALIB], tokens=a.calib_tokens, seq_len=a.seq_len)
        write_projection(proj_path, tensors, meta)
        cal = {"tokens": meta["tokens"], "seconds": time.perf_counter() - t0}
    else:
        cal = old["calibration"]
    kept = sorted(set(SECTIONS) - sections)
    proj = load_projection(proj_path)
    text = corpus.read_text(EVAL)

    data = measure(a, sections, old, model, tok, proj, proj_path, text, out)
    data["calibration"], data["seq_len"], data["kept"] = cal, a.seq_len, kept
    # the measurements first: a report bug below must not cost them
    atomic_write_bytes(out / "quality.json", json.dumps(data, sort_keys=True, indent=1, default=float).encode())
    atomic_write_bytes(out / "quality.md", render(data, json.loads((out / "retention.json").read_text())).encode())
    print((out / "quality.md").read_text())
    return 0


def layout(ppl) -> dict:
    """The report's grids, each setting's perplexity from ppl(cfg, section) (measured, or read from quality.json)."""
    dense = ppl(AquaConfig(), "selection")
    ks = sorted(set(K_RATIOS) | set(GROUP_K), reverse=True)
    grid = {(k, s): ppl(AquaConfig(k_ratio=k, selection=s), "selection") for k in ks for s in SELECTIONS
            if k < 1 and (k in GROUP_K if s.startswith("group") else k in K_RATIOS)}
    grid.update({(1.0, s): dense for s in SELECTIONS})  # k = r: every rule is dense attention
    mem = {(s, k): ppl(AquaConfig(k_ratio=k, slice_ratio=s), "memory") for s, k in MEMORY}
    alloc = {(s, al): ppl(AquaConfig(k_ratio=0.9, slice_ratio=s, slice_alloc=al), "memory") for s in (0.1, 0.25)
             for al in ALLOCS}
    h2o = {(h, k): ppl(AquaConfig(k_ratio=k, h2o_ratio=h), "h2o") for h, k in H2O}
    h2o_group = {(h, k): ppl(AquaConfig(k_ratio=k, h2o_ratio=h, selection="group-weighted"), "h2o-group")
                 for h, k in H2O_GROUP}
    return {"dense": dense, "ks": ks, "grid": grid, "mem": mem, "alloc": alloc, "h2o": h2o, "h2o_group": h2o_group}


def measure(a, sections: set, old: dict, model, tok, proj, proj_path: Path, text: str, out: Path) -> dict:
    """Every section asked for, the others kept from quality.json (old) -> quality.json's content."""
    results: dict = {}
    # keyed by AquaConfig's JSON: re-keyed so that results written before a config field existed still match
    measured = {AquaConfig.from_json(k).to_json(): v for k, v in old.get("results", {}).items()}

    def run(cfg: AquaConfig, section: str) -> float | None:
        key = cfg.to_json()
        if section not in sections:
            if key not in measured:
                return None  # not measured yet: its section measures it
            results[key] = measured[key]
        if key not in results:
            t = time.perf_counter()
            r = evaluate.perplexity(model, tok, text, tokens=a.tokens, seq_len=a.seq_len,
                                    projection=None if cfg.is_dense else proj, config=cfg)
            r["seconds"] = time.perf_counter() - t
            results[key] = r
            print(f"{key}: ppl {r['perplexity']:.4f} ({r['seconds']:.0f} s)", flush=True)
        return results[key]["perplexity"]

    if "memory" in sections and "measured" in ALLOCS and proj.slice_cost is None:  # kept in the artifact
        proj = add_costs(model, tok, proj, proj_path, [CALIB])
    grid = layout(run)["grid"]
    split = kv_split(model, tok, text, proj, a) if "memory" in sections else old.get("kv_split", {})
    if "retention" in sections or not (out / "retention.json").is_file():
        rep = evaluate.retention_report(model, tok, text, proj, tokens=4096, seq_len=a.seq_len, k_ratio=0.5)
        evaluate.plot_retention(rep, out / "retention.png")
        atomic_write_bytes(out / "retention.json", json.dumps(rep, sort_keys=True).encode())
    union = old.get("union", {})
    if sections & {"selection", "k-alloc"}:  # rows of K^ a step reads, on the evaluation text's first 4096 tokens
        queries, _ = evaluate.collect_queries_and_moments(model, corpus.windows(corpus.tokenize(tok, text, 4096),
                                                                                a.seq_len))
    if "selection" in sections:
        union = {f"{s}/{k}": evaluate.union_fraction(queries, proj.P, proj.key_rms, k, s) for k, s in grid
                 if k < 1 and s != "static"}  # the rows of the bytes table
    lm_grid = lm_eval_grid(proj_path) if "lmeval" in sections else old.get("lm_eval", {})
    long = quality_long.measure_long(model, tok, proj, a.long_tokens) if "long" in sections else old.get("long", {})
    passkey = quality_long.measure_passkey(model, tok, proj, ROOT / "build" / "quality") if "passkey" in sections \
        else old.get("passkey", {})
    if "k-alloc" in sections:
        proj = quality_alloc.with_costs(model, tok, proj, proj_path, CALIB)
        k_alloc = quality_alloc.measure(model, tok, proj, text, queries, a)
    else:
        k_alloc = old.get("k_alloc", {})
    prefill = quality_prefill.measure(model, tok, proj, ROOT / "build" / "quality") if "prefill" in sections \
        else old.get("prefill", {})
    qa = quality_qa.measure(model, tok, proj, ROOT / "build" / "quality") if "qa" in sections else old.get("qa", {})
    ruler = quality_ruler.merge(old.get("ruler", {}), quality_ruler.measure(
        model, tok, proj, ROOT / "build" / "quality", a.ruler_tasks.split(","),
        [int(n) for n in a.ruler_lengths.split(",")], a.ruler_items, engines=a.ruler_engines)) \
        if "ruler" in sections else old.get("ruler", {})
    return {"results": results, "union": union, "lm_eval": lm_grid, "kv_split": split, "long": long,
            "passkey": passkey, "k_alloc": k_alloc, "prefill": prefill, "qa": qa, "ruler": ruler}


def render(data: dict, rep: dict) -> str:
    """quality.md from quality.json's content and retention.json's (rep)."""
    results, union, cal = data["results"], data["union"], data["calibration"]
    seq_len, kept = data.get("seq_len", 512), data.get("kept", [])
    looked = {AquaConfig.from_json(k).to_json(): v["perplexity"] for k, v in results.items()}
    g = layout(lambda cfg, section: looked.get(cfg.to_json()))
    dense, ks, grid, mem, alloc, h2o, h2o_group = (g[k] for k in ("dense", "ks", "grid", "mem", "alloc", "h2o",
                                                                  "h2o_group"))
    n_eval = next(iter(results.values()))
    took = f", {cal['seconds']:.0f} s on this machine incl. model load" if cal.get("seconds") else ""
    L = ["# AQUA quality on the embedded model (SmolLM2-135M-Instruct, float32)\n",
         f"{written_by('quality')} Calibration: `{CALIB}` ({cal['tokens']} tokens, seq {seq_len}{took}). "
         f"Evaluation: `{EVAL}` ({n_eval['tokens']} tokens, {n_eval['windows']} non-overlapping windows of "
         f"{seq_len}). Different texts: Python reference prose vs a licence text; both ship with every fresh "
         "machine (CPython, Debian base-files).\n"]
    if kept:
        L.append(f"Sections measured in an earlier run of this tool and kept from `quality.json`: {', '.join(kept)} "
                 f"(`--sections {','.join(sorted(set(SECTIONS) - set(kept)))}` measured the rest; `make quality` "
                 "measures all of them in one run, calibration included).\n")
    L.append(f"Dense perplexity (HF attention, no AQUA): **{dense:.4f}**. SmolLM2 has d=64, 9 query / 3 KV heads.\n")
    L += _selection_lines(ks, grid)
    L += _bytes_lines(grid, union, h2o_group)
    L.append("\n## AQUA-Memory (slice K and V before caching; P_v folded into W_V / W_O)\n")
    L += table(["slice_ratio", "cache width r", "k_ratio 0.75", "k_ratio 0.9", "k_ratio 1.0"],
               [[s, AquaConfig(slice_ratio=s).retained_width(64)] + [f"{mem[(s, k)]:.4f}" for k in (0.75, 0.9, 1.0)]
                for s in (0.1, 0.25)])
    L.append("\nPaper (Llama-3.1-8B): slice 0.10 / k 0.90 -> 9.10; slice 0.25 / k 0.90 -> 10.09 (dense 8.91).\n")
    L += memory_alloc_lines(mem, alloc, dense, data.get("kv_split", {}))
    L.append("## AQUA-H2O (heavy hitters from the approximate scores; token-by-token eviction simulated exactly)\n")
    L += table(["h2o_ratio (kept)", "k_ratio 0.5", "k_ratio 0.75", "k_ratio 1.0"],
               [[h] + [f"{h2o[(h, k)]:.4f}" for k in (0.5, 0.75, 1.0)] for h in (0.25, 0.5, 0.75)])
    if all(p is not None for p in h2o_group.values()):
        L.append("\nWith the group-shared rule (`group-weighted`; one set of k of K^'s rows per KV group):\n")
        L += table(["h2o_ratio (kept)", "k_ratio", "perplexity"], [[h, k, f"{p:.4f}"] for (h, k), p in h2o_group.items()])
    L.append("\n## Information retention loss (k_ratio 0.5, 4096 evaluation tokens)\n")
    L.append("Mean over layers and query heads of E[1 - ||q^[I]||^2 / ||q^||^2] (definition in "
             "`aqua_export/evaluate.py`); offline P = calibrated on the other text, online P = on the evaluation "
             "tokens themselves. Per layer/head: `retention.json`, `retention.png`.\n")
    L += table(["selection", "offline P", "online P"], [[sel, f"{rep['mean'][sel + '/offline']:.4f}",
                                                          f"{rep['mean'][sel + '/online']:.4f}"]
                                                         for sel in ("magnitude", "static")])
    if data.get("lm_eval"):
        L += lm_eval_lines(data["lm_eval"])
    L += quality_long.lines(data.get("long", {}), data.get("passkey", {}), union)
    L += quality_prefill.lines(data.get("prefill", {}))
    L += quality_qa.lines(data.get("qa", {}))
    L += quality_ruler.lines(data.get("ruler", {}))
    L += quality_alloc.lines(data.get("k_alloc", {}))
    L.append("")
    return "\n".join(L)


def _selection_lines(ks: list, grid: dict) -> list[str]:
    L = ["## Standalone AQUA: perplexity by k_ratio and selection rule\n",
         "`weighted` is ours: top-k of |q^_i| * rms(k^_i) (the expected size of coordinate i's term in the "
         "score, with rms from calibration). `group` / `group-weighted` choose one set per GQA group (top-k of "
         "the group's summed |q^_i|, or summed |q^_i| * rms(k^_i)), so a step reads exactly k of K^'s rows. "
         "The seed paper's figures (Llama-3.1-8B / OLMoE-1B-7B on WikiText-103, different models and text: "
         "compare the trend, not the level) stand beside.\n"]
    rows = []
    for k in ks:
        row = [f"{grid[(k, s)]:.4f}" if grid.get((k, s)) is not None else "" for s in SELECTIONS]
        have = [i for i, s in enumerate(SELECTIONS) if grid.get((k, s)) is not None]
        best = min(have, key=lambda i: grid[(k, SELECTIONS[i])]) if have else None
        if k < 1 and have:
            row[best] = f"**{row[best]}**"
        paper = PAPER.get(k, ("", ""))
        rows.append([k, AquaConfig(k_ratio=k).selected_width(64), *row, paper[0], paper[1]])
    return L + table(["k_ratio", "k (of 64)", *SELECTIONS, "paper Llama-3.1-8B", "paper OLMoE-1B-7B"], rows)


def _bytes_lines(grid: dict, union: dict, h2o_group: dict) -> list[str]:
    L = ["\n## Perplexity against bytes read\n",
         "A decode step reads V and the rows of K^ its selections touch: per (layer, KV head, token) the union of "
         "the group's g = 3 selected coordinate sets, u of K^'s 64 rows (measured on the evaluation text's first "
         "4096 tokens; k/64 exactly for the group rules). Bytes = (u K + V) / (K + V) of a dense step, its byte "
         "limit 1 / bytes. AQUA-H2O rows (`--sections h2o-group`) read h of the tokens' slots, each with its heavy "
         "(float32) and token (int64): bytes = h (1 + u + 12 / 256) / 2. Sorted by bytes; **bold**: the cheapest "
         "setting whose perplexity is no worse than per-head magnitude at k 0.5.\n"]
    missing = [f"{s}/{k}" for k, s in grid if k < 1 and s != "static" and f"{s}/{k}" not in union]
    if missing:  # the union is measured by the selection section only
        return L + [f"Not measured yet for {len(missing)} setting(s): `python -m tools quality --sections selection` "
                    "adds them.\n"]
    bar = grid[(0.5, "magnitude")]
    # (bytes, selection label, k, union, perplexity); H2O rows read h of the tokens, heavy and token included
    rows_b = [((1 + union[f"{s}/{k}"]) / 2, s, k, union[f"{s}/{k}"], grid[(k, s)]) for k, s in grid
              if k < 1 and s != "static"]
    rows_b += [(h * (1 + k + H2O_SLOT_EXTRA) / 2, f"H2O {h} + group-weighted", k, k, p)
               for (h, k), p in h2o_group.items() if p is not None]
    rows_b.sort(key=lambda x: (x[0], x[4]))
    best_b = next(((s, k) for _, s, k, _, p in rows_b if p <= bar), None)
    rows = []
    for b, s, k, u, p in rows_b:
        cells = [s, str(k), f"{u:.3f}", f"{b:.3f}", f"{1 / b:.2f}", f"{p:.4f}"]
        rows.append([f"**{c}**" for c in cells] if (s, k) == best_b else cells)
    return L + table(["selection", "k_ratio", "union u", "bytes vs dense", "byte limit", "perplexity"], rows)


if __name__ == "__main__":
    sys.exit(main())
