"""A study for the int8 cache (issue 45) at long context: does rounding K^ and V to int8 cost perplexity under token
selection past a few thousand tokens, and which of the two costs it? The PyTorch reference with the cached rows
rounded as the folder rounds them (ops.rules.int8_rows, per token; int8_scale_study's rounding_attention), the
int4 token folder's setting (k 0.25 group-weighted, budget 512) on float32 weights, P calibrated as
tools/quality.py calibrates. Perplexity of the last LAST tokens of windows of 8192 of builtin:licenses (the measure
of tools/quality_long.py: the window's earlier tokens are their prompt, each scored row selects its pages).

Variants: none; both rounded (the shipped cache); K^ only; V only; K^ divided by the calibrated per-coordinate key
RMS before rounding and multiplied back after (a per-coordinate balance ahead of the per-token scale: K^'s leading
coordinates carry most of the energy, so one scale per token leaves the trailing ones few codes).

    python -m tools.studies.int8_long_study [--windows 3] [--variants none,shipped]   (about 3.5 min a window and
    variant on 2 cores)  -> benchmarks/int8_long_study.json and .md
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aqua_export import corpus, evaluate, models
from aqua_export.config import AquaConfig
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
    def rounded(x: torch.Tensor, i: int) -> torch.Tensor:
        rms = proj.key_rms[i].float()[None, :, None, :]  # [1, Hkv, 1, r]
        return _int8(x / rms, i) * rms
    return rounded


def variants(proj) -> dict:
    """name -> (K^'s rounding, V's rounding), each (x [B, Hkv, S, w], layer) -> x rounded, or None."""
    return {"none": (None, None), "shipped": (_int8, _int8), "K only": (_int8, None), "V only": (None, _int8),
            "K balanced + V": (_balanced(proj), _int8)}


def render(rows: dict, windows: int) -> str:
    base = rows.get("none")
    md = ["# int8 cache at long context: where the rounding costs", "",
          f"`python -m tools.studies.int8_long_study --windows {windows}`: the PyTorch reference with the cached K^ "
          f"and V rows rounded to int8 as named (ops.rules.int8_rows, one scale per token), k 0.25 group-weighted, "
          f"budget 512, float32 weights; perplexity of the last {LAST} tokens of {windows} window(s) of {SEQ_LEN} of "
          f"`{LONG_TEXT}` (each scored row selects its pages; the rest is its prompt, attended exactly).", "",
          *table(["variant", "perplexity", "against none"],
                 [[name, f"{r['perplexity']:.4f}",
                   f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%" if base else ""]
                  for name, r in rows.items()]), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    from aqua_export.reference import attention as ra

    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--variants", default="none,shipped,K only,V only,K balanced + V")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = models.load("llama")
    proj = projection(model, tok)
    text, table_of = corpus.read_text(LONG_TEXT), variants(proj)
    inner, rows = ra.aqua_attention, {}
    try:
        for name in a.variants.split(","):
            k_round, v_round = table_of[name]
            ra.aqua_attention = inner if name == "none" else rounding_attention(inner, proj, k_round, v_round)
            t = time.perf_counter()
            r = evaluate.perplexity(model, tok, text, tokens=a.windows * SEQ_LEN, seq_len=SEQ_LEN, projection=proj,
                                    config=CONFIG, last=LAST)
            rows[name] = {"perplexity": r["perplexity"], "predicted_tokens": r["predicted_tokens"],
                          "seconds": time.perf_counter() - t}
            print(f"{name}: {r['perplexity']:.4f} ({rows[name]['seconds']:.0f} s)", flush=True)
    finally:
        ra.aqua_attention = inner
    atomic_write_bytes(BENCHMARKS / "int8_long_study.json", json.dumps(rows, indent=1).encode())
    atomic_write_bytes(BENCHMARKS / "int8_long_study.md", render(rows, a.windows).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
