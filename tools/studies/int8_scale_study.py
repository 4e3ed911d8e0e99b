"""A study for the int8 cache (issue 45): which per-token scale its rows should carry. The PyTorch reference
emulates each candidate: every K^ row (the cached basis, P after RoPE) and V row (P_v's basis) of each forward is
rounded to int8 with its scale and read back, then attention runs as the folder's does (AQUA k 0.75, magnitude;
P calibrated on builtin:python-reference as tools/quality.py calibrates). Perplexity on builtin:gpl-3 in 512-token windows (the text and
windows of `aqua-export eval`), against the same run without rounding.

Candidates, all one scale per token and row (the cache carries one int8 element beside each K^ column / V row):
    power of two      the smallest 2^e >= max |x| / 127 (the first int8 cache)
    quarter power     the smallest 2^(c / 4) >= max |x| / 127: ops.rules.int8_rows itself, the shipped format
    exact             max |x| / 127 in float32 (needs a float scale: two or four bytes beside each row)
    power of two, 32  one power of two per 32 values (two scale elements per row)

    python -m tools.studies.int8_scale_study      (about 5 minutes on 2 cores)
    -> benchmarks/int8_scale_study.json and .md
"""

from __future__ import annotations

import json
import time

import torch

from aqua_export import calibrate, corpus, evaluate, models
from aqua_export.config import AquaConfig
from aqua_export.ops import rules
from aqua_export.outputs import atomic_write_bytes
from aqua_export.projection import Projection, load_projection
from aqua_export.projection import write as write_projection
from tools.harness import BENCHMARKS, ROOT, table
from tools.quality import CALIB

TEXT, SEQ_LEN, TOKENS = "builtin:gpl-3", 512, 8192
CONFIG = AquaConfig(k_ratio=0.75)


def _power_scale(x: torch.Tensor, step: float) -> torch.Tensor:
    """The smallest 2^(j * step) >= max |x| / 127 along the last axis (x [..., w] -> [..., 1])."""
    least = x.abs().amax(-1, keepdim=True) / 127.0
    return torch.exp2(torch.ceil(torch.log2(least.clamp_min(1e-30)) / step) * step)


def _blocks(scale_of, block: int):
    def rounded(x: torch.Tensor) -> torch.Tensor:
        xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
        s = scale_of(xb)
        return (torch.round(xb / s).clamp(-127, 127) * s).reshape(x.shape)
    return rounded


CANDIDATES = {  # name -> x [..., w] -> the values its int8 rows stand for
    "power of two": _blocks(lambda x: _power_scale(x, 1.0), 64),
    "quarter power (shipped)": lambda x: rules.int8_values(rules.int8_rows(x)),
    "exact": _blocks(lambda x: x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0, 64),
    "power of two, 32": _blocks(lambda x: _power_scale(x, 1.0), 32),
}


def rounding_attention(inner, proj: Projection, k_round, v_round):
    """The attention function ``inner`` (reference.attention.aqua_attention) with K^ and V rounded first, each
    through its function (x [B, Hkv, S, w], the layer's index) -> x rounded, or None to leave it (P and P_v
    orthogonal at full width: rotating back is exact up to float32)."""

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        i = module._aqua.index
        P, P_v = proj.P[i].float()[None], proj.P_v[i].float()[None]
        if k_round is not None:
            key = k_round(key @ P, i) @ P.transpose(-1, -2)
        if v_round is not None:
            value = v_round(value @ P_v, i) @ P_v.transpose(-1, -2)
        return inner(module, query, key, value, attention_mask, scaling, dropout, **kw)
    return attend


def projection(model, tok) -> Projection:
    """P calibrated as tools/quality.py calibrates (another text than the evaluations'), made once under build/."""
    path = ROOT / "build" / "int8_scale_study" / "projection.safetensors"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_projection(path, *calibrate.calibrate(model, tok, texts=[CALIB], tokens=16384))
    return load_projection(path)


def render(rows: dict) -> str:
    """benchmarks/int8_scale_study.md from the rows main measured."""
    md = ["# int8 cache: the scale each token's rows carry", "",
          f"`python -m tools.studies.int8_scale_study`: the PyTorch reference with every K^ and V row rounded to int8 "
          f"as the candidate scale says, AQUA k 0.75 (magnitude), perplexity on `{TEXT}` in windows of {SEQ_LEN} "
          f"({rows['none']['tokens']} tokens). Increase against the same run without rounding. One text: a few "
          "tenths of a percent between candidates is within what another text would move; whole powers of two "
          "round up to twice as coarsely as quarter powers, which round no coarser than 2^(1/4) the float scale.", "",
          *table(["scale", "perplexity", "increase"],
                 [[name, f"{r['perplexity']:.4f}", f"{r['increase_percent']:+.2f}%"] for name, r in rows.items()]), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    from aqua_export.reference import attention as ra

    torch.set_num_threads(2)
    model, tok = models.load("llama")
    proj = projection(model, tok)
    text = corpus.read_text(TEXT)
    inner, rows = ra.aqua_attention, {}
    try:
        for name, rounded in {"none": None, **CANDIDATES}.items():
            every_layer = None if rounded is None else (lambda x, i, f=rounded: f(x))  # the same in every layer
            ra.aqua_attention = inner if rounded is None else rounding_attention(inner, proj, every_layer, every_layer)
            t = time.perf_counter()
            r = evaluate.perplexity(model, tok, text, tokens=TOKENS, seq_len=SEQ_LEN, projection=proj, config=CONFIG)
            rows[name] = {"perplexity": r["perplexity"], "tokens": r["tokens"], "seconds": time.perf_counter() - t}
            print(f"{name}: {r['perplexity']:.4f}", flush=True)
    finally:
        ra.aqua_attention = inner
    base = rows["none"]["perplexity"]
    for row in rows.values():
        row["increase_percent"] = 100.0 * (row["perplexity"] / base - 1.0)
    atomic_write_bytes(BENCHMARKS / "int8_scale_study.json", json.dumps(rows, indent=1).encode())
    atomic_write_bytes(BENCHMARKS / "int8_scale_study.md", render(rows).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
