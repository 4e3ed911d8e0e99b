"""Long-context quality: where token selection can fail. Two sections of tools/quality.py (--sections long,passkey),
measured on the embedded model with the projection quality.py calibrates (builtin:python-reference):

    long     perplexity of the last LAST tokens of windows of 2048 and 8192 tokens of builtin:licenses (Debian's
             licence texts, not the calibration text): the window's earlier tokens are their prompt (attended
             exactly, as a served prompt is), each scored row selects its pages from the tokens before it, as a
             decode step does; bytes read per step at the window's length
    passkey  lm-eval's aqua_passkey on built folders run by ONNX Runtime (native kernels; a pass key planted at 5
             depths of 1k / 4k / 8k-token fillers; the prompt attends exactly, each generated token selects):
             accuracy per length and depth

The settings: dense, per-head magnitude at k 0.5 (the bar the token-selection settings must meet), and token
selection with the group-shared weighted rule (a step reads exactly k of K^'s rows to score the tokens), AquaConfig's
sink 16 and window 64; one of them also with SparQ's mean-value correction (reference only: measured, not exported).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from aqua_export import corpus, evaluate
from aqua_export.config import AquaConfig
from aqua_export.ops import rules
from tools.harness import table

LONG_TEXT = "builtin:licenses"
LONG_LENGTHS = (2048, 8192)
LAST = 1024  # tokens scored per window: the decode steps
D = 64  # SmolLM2's head width: k_ratio 0.25 -> 16 rows
# name -> (config, SparQ's mean-value correction)
LONG = {
    "dense": (AquaConfig(), False),
    "magnitude k 0.5": (AquaConfig(k_ratio=0.5), False),
    "group-weighted k 0.25, tokens 1/8": (AquaConfig(k_ratio=0.25, selection="group-weighted", token_ratio=0.125),
                                          False),
    "group-weighted k 0.25, tokens 1/8, mean value": (
        AquaConfig(k_ratio=0.25, selection="group-weighted", token_ratio=0.125), True),
    "group-weighted k 0.25, tokens 1/16": (AquaConfig(k_ratio=0.25, selection="group-weighted", token_ratio=0.0625),
                                           False),
    "group-weighted k 0.25, budget 512": (AquaConfig(k_ratio=0.25, selection="group-weighted", token_budget=512),
                                          False),
}
BAR = "magnitude k 0.5"
PASSKEY = ("dense", "group-weighted k 0.25, budget 512")  # built folders (benchmarks/passkey.json: this pair)


def bytes_read(cfg: AquaConfig, union: float, length: int) -> float:
    """A decode step's bytes at context ``length`` against dense's (K + V): the union u of the selected rows of K^
    (scoring every token), plus K^ and V whole for the attended share of the tokens (token selection); u K + V
    without it."""
    if not cfg.selects_tokens:
        return (union + 1) / 2
    share = rules.attended_share(length, cfg.token_ratio, cfg.token_budget, cfg.token_sink, cfg.token_window)
    return (union + 2 * share) / 2


def measure_long(model, tok, proj, tokens: int) -> dict:
    """Perplexity per setting and window length on LONG_TEXT's first ``tokens`` tokens."""
    text = corpus.read_text(LONG_TEXT)
    out = {}
    for name, (cfg, mean_value) in LONG.items():
        for length in LONG_LENGTHS:
            t = time.perf_counter()
            r = evaluate.perplexity(model, tok, text, tokens=tokens, seq_len=length, last=LAST,
                                    projection=None if cfg.is_dense else proj, config=cfg, mean_value=mean_value)
            r["seconds"] = time.perf_counter() - t
            out[f"{name}/{length}"] = r
            print(f"long {name} @ {length}: ppl {r['perplexity']:.4f} ({r['seconds']:.0f} s)", flush=True)
    return out


@contextlib.contextmanager
def built(model, tok, proj, cfg: AquaConfig, folder: Path):
    """A float32 folder of ``cfg`` (the build's export stage) at ``folder`` for the block, removed after it."""
    from aqua_export.build import export_folder
    from aqua_export.options import BuildOptions

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        export_folder(model, tok, proj, cfg, BuildOptions(), folder, "llama").seal(folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def passkey_run(folder: Path) -> tuple[dict, float]:
    """aqua_passkey through a folder (ONNX Runtime, 2 threads) -> (accuracy per "length/depth", mean)."""
    from aqua_export.lm_eval_model import AquaLM, evaluate as lm_evaluate

    with AquaLM(folder=str(folder), batch_size=1, threads=2) as lm:
        r = lm_evaluate(lm, ["aqua_passkey"], log_samples=True)
    cells: dict = {}
    for s in r["samples"]["aqua_passkey"]:
        cells.setdefault(f"{s['doc']['length']}/{s['doc']['depth']}", []).append(s["exact_match"])
    return {k: sum(v) / len(v) for k, v in cells.items()}, r["results"]["aqua_passkey"]["exact_match,none"]


def passkey_cells(accuracy: dict) -> list[str]:
    """One table cell per pass-key length: its depths in order, `x` retrieved, `.` missed, `-` not run."""
    from aqua_export.lm_eval_tasks.aqua_tasks import PASSKEY_DEPTHS, PASSKEY_LENGTHS

    return ["".join("-" if accuracy.get(f"{n}/{d}") is None else "x" if accuracy[f"{n}/{d}"] >= 1 else "."
                    for d in PASSKEY_DEPTHS) for n in PASSKEY_LENGTHS]


def measure_passkey(model, tok, proj, work) -> dict:
    """aqua_passkey on a folder of each PASSKEY setting (float32, built into ``work``): accuracy per (length,
    depth)."""
    out = {}
    for name in PASSKEY:
        t = time.perf_counter()
        with built(model, tok, proj, LONG[name][0], Path(work) / name.replace(" ", "").replace(",", "-")
                   .replace("/", "_")) as folder:
            accuracy, mean = passkey_run(folder)
        out[name] = {"accuracy": accuracy, "mean": mean, "seconds": time.perf_counter() - t}
        print(f"passkey {name}: {out[name]['mean']:.3f} ({out[name]['seconds']:.0f} s)", flush=True)
    return out


def lines(long: dict, passkey: dict, union: dict) -> list[str]:
    """The quality.md sections. union: measured union fractions (quality.json's "union", selection/k keys)."""
    L = []
    if long:
        first = next(iter(long.values()))
        L += ["\n## Long windows: token selection (`--token-ratio`)\n",
              f"Perplexity on `{LONG_TEXT}` (Debian's licence texts but GPL-3, longest first; not the calibration "
              f"text), its first {first['tokens']} tokens in non-overlapping windows of "
              f"{' and '.join(map(str, LONG_LENGTHS))}, of each window's last {LAST} tokens: the tokens before "
              "them are their prompt (attended exactly, as a served prompt is) and each scored row is a decode step, "
              "its pages of 16 tokens chosen on the k selected coordinates from the tokens before it (sink 16, "
              "window 64). SparQ's mean-value correction (`mean value`) is the reference's only: the graph has "
              "none. Bytes: a step at the window's length against dense's "
              "K + V (u K to score every token, plus K and V whole for the attended pages; `u K + V` without token "
              f"selection). **Bold**: settings no worse than `{BAR}` at that length.\n"]
        rows = []
        for name, (cfg, _) in LONG.items():
            key = f"{cfg.selection}/{cfg.k_ratio}"
            u = 1.0 if cfg.k_ratio == 1 else cfg.k_ratio if cfg.selection.startswith("group") else union.get(key)
            cells = []
            for n in LONG_LENGTHS:
                p, bar = long[f"{name}/{n}"]["perplexity"], long[f"{BAR}/{n}"]["perplexity"]
                cells.append(f"**{p:.4f}**" if cfg.selects_tokens and p <= bar else f"{p:.4f}")
            b = [f"{bytes_read(cfg, u, n):.3f}" if u is not None else "" for n in LONG_LENGTHS]
            rows.append([name, *cells, *b])
        L += table(["setting", *(f"ppl @ {n}" for n in LONG_LENGTHS), *(f"bytes @ {n}" for n in LONG_LENGTHS)], rows)
    if passkey:
        from aqua_export.lm_eval_tasks.aqua_tasks import PASSKEY_DEPTHS, PASSKEY_LENGTHS

        L += ["\n## Pass key retrieval (`aqua-export lm-eval --tasks aqua_passkey`)\n",
              "A five-digit key planted at a depth of a filler of 1k, 4k or 8k tokens, asked for at the end; exact "
              "match of the greedy answer, from folders built with each setting and run by ONNX Runtime (native "
              "kernels): the prompt attends exactly, each generated token selects its pages. One key per cell.\n"]
        rows = [[name, *passkey_cells(r["accuracy"]), f"{r['mean']:.3f}"] for name, r in passkey.items()]
        L += table(["setting", *(f"{n} tokens" for n in PASSKEY_LENGTHS), "all"], rows)
        L.append(f"\nEach cell: the depths {', '.join(map(str, PASSKEY_DEPTHS))} in order, `x` retrieved, `.` "
                 "missed.\n")
    return L
