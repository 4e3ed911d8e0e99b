"""A study for the k allocation (issue 29): what a fixed k per (layer, KV head) would give over a k per layer, the
alternative to the pooled selection the kernels take (docs/design.md says why pooled). The reference emulates it:
a layer whose heads differ selects under its own k < r, and a probe (reference.attention.Probe, the parity
instrument) hands each KV head the leading k_h of its rule's ranking (trailing entries repeat the first, so exactly
k_h coordinates are kept; k_h = r keeps all).

Costs: per (layer, KV head) and k in SELECT_WIDTHS (of 64), the mean KL(dense || only that head selecting k) of the
next-token distributions over 512 tokens of the calibration text (builtin:python-reference), rule `weighted`.
Allocation: allocate.water_fill over the 90 (layer, head) curves (the same total as uniform), and over the 30 layer
curves (each the sum of its heads': the per-layer allocation on the same measurements). Evaluation: perplexity on
builtin:gpl-3 in 512-token windows (tools/quality.py's text), dense, uniform k, per layer and per head, at the
same average k; ratio = allocated increase / uniform's. Byte accounting under a per-head k is not measured here.

    python -m tools.studies.head_alloc_study      (about 20 minutes on 2 cores)
    -> benchmarks/head_alloc_study.json and .md
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from aqua_export import corpus, evaluate, models
from aqua_export.allocate import measured_curve, water_fill
from aqua_export.config import AquaConfig
from aqua_export.ops.rules import select_indices
from aqua_export.outputs import atomic_write_bytes
from aqua_export.projection import load_projection
from aqua_export.slice_costs import SELECT_WIDTHS, Costs

RULE, CALIB, EVAL = "weighted", "builtin:python-reference", "builtin:gpl-3"
K_RATIOS = (0.5, 0.4, 0.3)
PROJECTION = ROOT / "benchmarks" / "llama-projection.safetensors"  # tools/quality.py's


class HeadK:
    """Probe: k per KV head for the layers in ``table`` ({layer: [k_h]}); other layers keep their own choice."""

    evictions = False

    def __init__(self, table: dict):
        self.table = table

    def select(self, st, qh, own):
        ks = self.table.get(st.index)
        if ks is None:
            return own
        idx = select_indices(qh, st.r, st.selection, st.key_rms).clone()  # [B, Hkv, g, T, r], best first
        for h, k in enumerate(ks):
            idx[:, h, ..., k:] = idx[:, h, ..., :1]
        return idx


def layer_ks(table: dict, d: int) -> tuple:
    """The layers' own k: below r wherever a head selects, so the probe is asked."""
    return tuple(d - 1 if min(ks) < d else d for ks in table.values())


def head_costs(model, tok, proj) -> np.ndarray:
    """[L, Hkv, len(SELECT_WIDTHS)] measured KL costs."""
    n, hkv, d = len(proj.P), proj.P[0].shape[0], proj.P[0].shape[-1]
    widths = [round(w * d) for w in SELECT_WIDTHS]
    costs, cfg = Costs(model, tok, proj, [CALIB], 512, 512), AquaConfig(k_ratio=0.5, selection=RULE)
    out = np.zeros((n, hkv, len(widths)))
    for layer in range(n):
        selected = tuple(d - 1 if x == layer else d for x in range(n))  # only this layer asks the probe
        for h in range(hkv):
            for i, w in enumerate(widths):
                ks = [w if x == h else d for x in range(hkv)]
                out[layer, h, i] = costs.kl(cfg, selected=selected, probe=HeadK({layer: ks}))
        print(f"layer {layer}: {np.round(out[layer], 5).tolist()}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model, tok = models.load("llama")
    proj = load_projection(PROJECTION)
    n, hkv, d = len(proj.P), proj.P[0].shape[0], proj.P[0].shape[-1]
    costs = head_costs(model, tok, proj)
    widths = [round(w * d) for w in SELECT_WIDTHS]
    curves = torch.stack([measured_curve(widths, torch.from_numpy(costs[x, h]), d)
                          for x in range(n) for h in range(hkv)])
    per_layer = curves.reshape(n, hkv, d + 1).sum(1)
    text = corpus.read_text(EVAL)

    def ppl(cfg, selected=None, probe=None) -> float:
        return evaluate.perplexity(model, tok, text, tokens=100_000, seq_len=512, projection=proj, config=cfg,
                                   selected=selected, probe=probe)["perplexity"]

    res = {"dense": ppl(AquaConfig()), "costs": costs.round(7).tolist(), "widths": widths, "rows": []}
    for k in K_RATIOS:
        cfg = AquaConfig(k_ratio=k, selection=RULE)
        u = cfg.selected_of(d)
        floor = min(u, d // 8)
        heads, layers = water_fill(curves, n * hkv * u, floor), water_fill(per_layer, n * u, floor)
        table = {x: list(heads[x * hkv:(x + 1) * hkv]) for x in range(n)}
        base = float(curves[:, u].sum())
        row = {"k_ratio": k, "k": u, "uniform": ppl(cfg), "per_layer": ppl(cfg, selected=tuple(layers)),
               "per_head": ppl(cfg, selected=layer_ks(table, d), probe=HeadK(table)),
               "predicted_per_layer": float(sum(per_layer[x, w] for x, w in enumerate(layers))) / base,
               "predicted_per_head": float(sum(curves[i, w] for i, w in enumerate(heads))) / base,
               "layers_k": list(layers), "heads_k": list(heads)}
        up = row["uniform"] - res["dense"]
        row["ratio_per_layer"] = (row["per_layer"] - res["dense"]) / up
        row["ratio_per_head"] = (row["per_head"] - res["dense"]) / up
        res["rows"].append(row)
        print(json.dumps({x: v for x, v in row.items() if not x.endswith("_k")}), flush=True)
    res["seconds"] = round(time.perf_counter() - t0)
    out = ROOT / "benchmarks" / "head_alloc_study"
    atomic_write_bytes(out.with_suffix(".json"), json.dumps(res, indent=1).encode())
    atomic_write_bytes(out.with_suffix(".md"), report(res).encode())
    print(f"wrote {out}.json and .md", flush=True)
    return 0


def report(res: dict) -> str:
    lines = ["# k per (layer, KV head) against k per layer (`python -m tools.studies.head_alloc_study`)\n",
             __doc__.split("\n\n")[0].replace("\n", " ") + "\n",
             f"Rule `{RULE}`; costs on {CALIB} (512 tokens), perplexity on {EVAL} (512-token windows); dense "
             f"{res['dense']:.4f}. Ratio = allocated increase / uniform's (issue 29 asks <= 0.5). Predicted: the "
             "sum of the allocated units' costs over uniform's (as if the KL costs added up).\n",
             "| k_ratio | uniform | per layer | per head | ratio per layer | ratio per head | predicted per layer "
             "| predicted per head |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['k_ratio']} | {r['uniform']:.4f} | {r['per_layer']:.4f} | {r['per_head']:.4f} | "
                     f"{r['ratio_per_layer']:.2f} | {r['ratio_per_head']:.2f} | {r['predicted_per_layer']:.2f} | "
                     f"{r['predicted_per_head']:.2f} |")
    lines.append(f"\nMeasured in {res['seconds']} s.\n")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
