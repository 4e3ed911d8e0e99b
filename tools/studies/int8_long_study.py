"""A study for the int8 cache (issue 45) at long context: does rounding K^ and V to int8 cost perplexity under token
selection past a few thousand tokens, and which of the two costs it? The PyTorch reference with the cached rows
rounded as the folder rounds them (ops.rules.int8_rows, per token; int8_scale_study's rounding_attention), the
int4 token folder's setting (k 0.25 group-weighted, budget 512) on float32 weights, P calibrated as
tools/quality.py calibrates. Perplexity of the last LAST tokens of windows of 8192 of builtin:licenses (the measure
of tools/quality_long.py: the window's earlier tokens are their prompt, each scored row selects its pages).

Variants: none; both rounded as a magnitude or group rule's cache holds them (K^ = K P, V in P_v's basis); K^
only; V only; K^ / w and V, w the calibrated per-coordinate key RMS: what a weighted rule's float cache holds (q^
scaled by w and k^ by 1/w so that the kernels rank plain |q^'|), and what its int8 cache held before its nodes
carried key_weights. Dividing by w evens out K^'s coordinates, whose leading ones carry most of the energy, ahead of
the one scale per token: the study that moved the int8 cache off K^ / w (it holds K^ / w^0.5 now,
fold.INT8_KEY_SPLIT, chosen on the folders' own evals: docs/reference.md).

    python -m tools.studies.int8_long_study [--windows 1] [--last 0] [--variants none,...]   (about 3.5 min a window
    and variant on 2 cores scoring the last 1024, 8 min every token)  -> benchmarks/int8_long_study.json and .md
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aqua_export import corpus, evaluate, models
from aqua_export.config import AquaConfig
from aqua_export.fold import selection_weights
from aqua_export.ops import rules
from aqua_export.outputs import atomic_write_bytes
from tools.harness import BENCHMARKS, table
from tools.quality_long import LAST, LONG_TEXT
from tools.studies.int8_scale_study import projection, rounding_attention

SEQ_LEN = 8192
CONFIG = AquaConfig(k_ratio=0.25, selection="group-weighted", token_budget=512)


def _int8(x: torch.Tensor, i: int) -> torch.Tensor:
    return rules.int8_values(rules.int8_rows(x))


def _balanced(proj):
    """K^ rounded as K^ / w (fold.selection_weights), then times w: a weighted rule's float cache's basis."""
    def rounded(x: torch.Tensor, i: int) -> torch.Tensor:
        w = selection_weights(proj.key_rms[i], x.shape[-1])[None, :, None, :]  # [1, Hkv, 1, r]
        return _int8(x / w, i) * w
    return rounded


def variants(proj) -> dict:
    """name -> (K^'s rounding, V's rounding), each (x [B, Hkv, S, w], layer) -> x rounded, or None."""
    return {"none": (None, None), "K^ and V": (_int8, _int8), "K^ only": (_int8, None), "V only": (None, _int8),
            "K^ / w and V (weighted rules)": (_balanced(proj), _int8)}


def render(rows: list[dict], windows: int) -> str:
    """The md from the rows of every run so far (one per variant and scored share), each against the same share's
    none."""
    none = {r["last"]: r["perplexity"] for r in rows if r["variant"] == "none"}
    cells = [[r["variant"], "every row" if r["last"] == 0 else f"last {r['last']}", f"{r['perplexity']:.4f}",
              f"{100 * (r['perplexity'] / none[r['last']] - 1):+.2f}%" if r["last"] in none else ""] for r in rows]
    md = ["# int8 cache at long context: where the rounding costs", "",
          f"`python -m tools.studies.int8_long_study --windows {windows} [--last 0]`: the PyTorch reference with the "
          f"cached K^ and V rows rounded to int8 as named (ops.rules.int8_rows, one scale per token), k 0.25 "
          f"group-weighted, budget 512, float32 weights; perplexity of {windows} window(s) of {SEQ_LEN} of "
          f"`{LONG_TEXT}`, scored on the last {LAST} tokens (the rest is their prompt, attended exactly) or on "
          "every token (every row selects its pages, as a folder's token-by-token `eval --folder` does). w is the "
          "calibrated key RMS per coordinate: a weighted rule's float cache holds K^ / w (its int8 cache did before "
          "its nodes carried key_weights; it holds K^ / w^0.5 now, fold.INT8_KEY_SPLIT).", "",
          *table(["variant", "scored", "perplexity", "against none"], cells), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    from aqua_export.reference import attention as ra

    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--last", type=int, default=LAST, help="tokens scored per window (0: every token)")
    ap.add_argument("--variants", default="none,K^ and V,K^ only,V only,K^ / w and V (weighted rules)")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = models.load("llama")
    proj = projection(model, tok)
    text, table_of = corpus.read_text(LONG_TEXT), variants(proj)
    out = BENCHMARKS / "int8_long_study.json"
    rows = json.loads(out.read_text()) if out.is_file() else []  # earlier runs' rows stay, the same ones replaced
    inner = ra.aqua_attention
    try:
        for name in a.variants.split(","):
            k_round, v_round = table_of[name]
            ra.aqua_attention = inner if name == "none" else rounding_attention(inner, proj, k_round, v_round)
            t = time.perf_counter()
            r = evaluate.perplexity(model, tok, text, tokens=a.windows * SEQ_LEN, seq_len=SEQ_LEN, projection=proj,
                                    config=CONFIG, last=a.last)
            rows = [x for x in rows if (x["variant"], x["last"]) != (name, a.last)] + [
                {"variant": name, "last": a.last, "perplexity": r["perplexity"],
                 "predicted_tokens": r["predicted_tokens"], "seconds": time.perf_counter() - t}]
            print(f"{name}, last {a.last}: {r['perplexity']:.4f} ({rows[-1]['seconds']:.0f} s)", flush=True)
            atomic_write_bytes(out, json.dumps(rows, indent=1).encode())
            atomic_write_bytes(BENCHMARKS / "int8_long_study.md", render(rows, a.windows).encode())
    finally:
        ra.aqua_attention = inner
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
