"""The selection width spread over the layers and their heads (`--k-alloc`): section `k-alloc` of tools/quality.py.

Calibration: the projection quality.py calibrates on builtin:python-reference, plus the measured costs of a narrower
selection under RULE on the same text (slice_costs.add_select_costs: each KV head's, then each layer's with its heads
sharing k; kept in the artifact). Evaluation on other texts: builtin:gpl-3 in 512-token windows (quality.py's text)
and LONG_LENGTH-token windows of builtin:licenses (the last LAST tokens of each scored, the rest their prompt).

    same k      uniform, energy and measured at each k of K_RATIOS: perplexity, and the rows of K^ a decode step
                reads (the union u of the group's selections per layer and KV head, measured on the evaluation
                text's first 4096 tokens, averaged; the pooled selection where the heads share k)
    same bytes  uniform at the K_GRID k as well: its perplexity against bytes, interpolated at each allocation's
                bytes (what uniform gives reading exactly those bytes)
    combined    the allocation with token selection (long windows) and with AQUA-Memory's widths (COMBINED)
"""

from __future__ import annotations

import time

import numpy as np

from aqua_export import corpus, evaluate
from aqua_export.allocate import head_prices, layer_selected, select_measured_costs
from aqua_export.config import AquaConfig
from aqua_export.slice_costs import add_select_costs
from tools.harness import table

RULE = "weighted"  # the rule the cost curve is quoted for
K_RATIOS = (0.5, 0.4, 0.3)
K_GRID = (0.25, 0.35, 0.45)  # uniform only: its curve of perplexity against bytes between and around K_RATIOS
ALLOCS = ("uniform", "energy", "measured")
LONG = ("uniform", "measured")  # long windows: uniform and the allocation the claim is about
LONG_TEXT, LONG_LENGTH, LONG_TOKENS, LAST = "builtin:licenses", 2048, 4096, 1024
# the allocation with the other modes, against uniform under the same settings: (label, settings, long windows)
COMBINED = (("token selection, budget 512 tokens, k 0.4", dict(k_ratio=0.4, token_budget=512), True),
            ("AQUA-Memory slice 0.25, k 0.5", dict(k_ratio=0.5, slice_ratio=0.25), False))


def with_costs(model, tok, proj, proj_path, calib: str):
    """The projection with selection costs for RULE (measured on ``calib`` when the artifact has none)."""
    if proj.has_select_costs(RULE):
        return proj
    t = time.perf_counter()
    proj = add_select_costs(model, tok, proj, proj_path, [calib], RULE)
    print(f"selection costs ({RULE}) measured in {time.perf_counter() - t:.0f} s", flush=True)
    return proj


def predicted(proj, k: float) -> float:
    """What the measured layer costs themselves promise at average k: the sum over layers of each layer's cost at
    its allocated k over the sum at uniform k (exact if the layers' KL costs added up)."""
    cfg = AquaConfig(k_ratio=k, selection=RULE, k_alloc="measured")
    costs, d = select_measured_costs(proj, cfg), proj.P[0].shape[-1]
    ks = layer_selected(cfg, proj, (d,) * len(proj.P))
    uniform = cfg.selected_of(d)
    return float(sum(costs[i, x] for i, x in enumerate(ks)) / costs[:, uniform].sum())


def measure(model, tok, proj, text: str, queries, a) -> dict:
    """{"dense": ..., "<alloc>/<k>": {"perplexity", "long"?, "union", "selected"}, "combined": {label: {alloc: ...}}}
    (long: LONG allocations at K_RATIOS; the K_GRID rows are uniform's, without long windows)."""
    d, n = proj.P[0].shape[-1], len(proj.P)
    long_text = corpus.read_text(LONG_TEXT)

    def ppl(cfg, long: bool, short: bool = True) -> dict:
        t = time.perf_counter()
        p = None if cfg.is_dense else proj
        r = {}
        if short:
            r["perplexity"] = evaluate.perplexity(model, tok, text, tokens=a.tokens, seq_len=a.seq_len, projection=p,
                                                  config=cfg)["perplexity"]
        if long:
            r["long"] = evaluate.perplexity(model, tok, long_text, tokens=LONG_TOKENS, seq_len=LONG_LENGTH, last=LAST,
                                            projection=p, config=cfg)["perplexity"]
        r["seconds"] = time.perf_counter() - t
        return r

    out = {"dense": ppl(AquaConfig(), True)}
    runs = [(k, x) for k in K_RATIOS for x in ALLOCS] + [(k, "uniform") for k in K_GRID]
    for k, alloc in runs:
        cfg = AquaConfig(k_ratio=k, selection=RULE, k_alloc=alloc)
        ks = layer_selected(cfg, proj, (d,) * n)
        r = ppl(cfg, alloc in LONG and k in K_RATIOS)
        r.update(selected=list(ks), union=evaluate.union_fraction(queries, proj.P, proj.key_rms, k, RULE, ks,
                                                                  head_prices(cfg, proj)))
        if alloc == "measured":
            r["predicted"] = predicted(proj, k)
        out[f"{alloc}/{k}"] = r
        print(f"k-alloc {alloc} k {k}: ppl {r['perplexity']:.4f}, long {r.get('long', float('nan')):.4f}, "
              f"u {r['union']:.3f}, k per layer {ks} ({r['seconds']:.0f} s)", flush=True)
    out["combined"] = {}
    for label, settings, long in COMBINED:
        row = {}
        for alloc in LONG:
            row[alloc] = ppl(AquaConfig(selection=RULE, k_alloc=alloc, **settings), long, short=not long)
            print(f"k-alloc {label}, {alloc}: {row[alloc]}", flush=True)
        out["combined"][label] = row
    return out


def _bytes(union: float) -> float:
    """A step's bytes against dense's: u of K^ plus all of V, over K + V."""
    return (1 + union) / 2


def same_bytes(res: dict, union: float) -> float:
    """Uniform's perplexity at the bytes a step reading the union ``union`` reads: linear in bytes between its
    measured k (K_RATIOS and K_GRID)."""
    pts = sorted((_bytes(res[f"uniform/{k}"]["union"]), res[f"uniform/{k}"]["perplexity"])
                 for k in K_RATIOS + K_GRID)
    x, y = zip(*pts)
    return float(np.interp(_bytes(union), x, y))


def lines(res: dict) -> list[str]:
    """The quality.md section."""
    if not res or "combined" not in res:
        return []
    dense = res["dense"]
    L = ["\n## Spreading k over the layers and their heads (`--k-alloc`)\n",
         f"Rule `{RULE}`; `--k-ratio` is the average: the layers' k sum to uniform's. `energy`: over the layers by "
         "water-filling on the calibrated spectra, a layer's heads sharing its k per token at one price; `measured`: "
         "the heads' prices from each KV head's measured cost (the KL of the next-token distribution when only that "
         "head selects k, 3 k) over the selection score it drops, then the layers by water-filling on each layer's "
         "measured cost with its heads sharing k (5 k). Costs measured on the calibration text (512 tokens), "
         "perplexity on others. Increase = perplexity - dense; ratio = allocated increase / uniform's (<= 0.5: at "
         "most half). Bytes: a decode step's u K + V against dense's K + V, u the union of the group's selected rows "
         f"measured per layer and KV head on the evaluation text. Long: windows of {LONG_LENGTH} of `{LONG_TEXT}`, "
         f"their last {LAST} tokens scored.\n",
         f"Dense: {dense['perplexity']:.4f} (512-token windows), {dense['long']:.4f} (long).\n",
         "### At the same average k\n"]
    rows = []
    for k in K_RATIOS:
        row = {x: res[f"{x}/{k}"] for x in ALLOCS}
        up = row["uniform"]["perplexity"] - dense["perplexity"]
        ratios = [(row[x]["perplexity"] - dense["perplexity"]) / up for x in ALLOCS[1:]]
        long_ratio = (row[LONG[-1]]["long"] - dense["long"]) / (row["uniform"]["long"] - dense["long"])
        rows.append([k, *(f"{row[x]['perplexity']:.4f}" for x in ALLOCS),
                     *(f"**{r:.2f}**" if r <= 0.5 else f"{r:.2f}" for r in ratios),
                     *(f"{_bytes(row[x]['union']):.4f}" for x in ALLOCS), *(f"{row[x]['long']:.4f}" for x in LONG),
                     f"{long_ratio:.2f}"])
    L += table(["k_ratio", *ALLOCS, *(f"{x} ratio" for x in ALLOCS[1:]), *(f"bytes {x}" for x in ALLOCS),
                *(f"long {x}" for x in LONG), "long ratio"], rows)
    L += ["\n### At the same bytes\n",
          "Uniform's perplexity against bytes (k " + ", ".join(map(str, sorted(K_RATIOS + K_GRID))) + "), "
          "interpolated at each `measured` setting's bytes: what uniform gives reading exactly those bytes.\n"]
    rows = []
    for k in K_RATIOS:
        m = res[f"measured/{k}"]
        u = same_bytes(res, m["union"])
        ratio = (m["perplexity"] - dense["perplexity"]) / (u - dense["perplexity"])
        rows.append([k, f"{_bytes(m['union']):.4f}", f"{m['perplexity']:.4f}", f"{u:.4f}", f"{ratio:.2f}"])
    L += table(["k_ratio", "bytes measured", "measured", "uniform at those bytes", "ratio"], rows)
    L.append("\nUniform's curve: " + ", ".join(
        f"k {k}: {res[f'uniform/{k}']['perplexity']:.4f} at bytes {_bytes(res[f'uniform/{k}']['union']):.4f}"
        for k in sorted(K_RATIOS + K_GRID)) + ".")
    L += ["\n### With the other modes\n"]
    rows = []
    for label, _, long in COMBINED:
        row, key = res["combined"][label], "long" if long else "perplexity"
        base = dense[key]
        ratio = (row["measured"][key] - base) / (row["uniform"][key] - base)
        rows.append([label, "long" if long else "512", f"{row['uniform'][key]:.4f}", f"{row['measured'][key]:.4f}",
                     f"{ratio:.2f}"])
    L += table(["settings", "windows", "uniform", "measured", "ratio"], rows)
    L.append("\nWhat the measured layer costs promise (the ratio if the layers' KL costs added up, the heads sharing "
             "k in both): " + ", ".join(f"k {k}: {res[f'measured/{k}']['predicted']:.2f}" for k in K_RATIOS) + ".")
    L.append("\nk per layer (first layer first):\n")
    for k in K_RATIOS:
        for x in ALLOCS[1:]:
            L.append(f"- k_ratio {k}, {x}: {', '.join(map(str, res[f'{x}/{k}']['selected']))}")
    L.append("")
    return L
