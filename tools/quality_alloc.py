"""The selection width spread over the layers (`--k-alloc`): section `k-alloc` of tools/quality.py.

Calibration: the projection quality.py calibrates on builtin:python-reference, plus each layer's measured cost of a
narrower selection under RULE on the same text (slice_costs.add_select_costs, kept in the artifact). Evaluation:
builtin:gpl-3 in 512-token windows (quality.py's text) and LONG_LENGTH-token windows of builtin:licenses (the last
LAST tokens of each scored, the rest their prompt): perplexity, and the rows of K^ a decode step reads (the union u
of the group's selections per layer, measured on the evaluation text's first 4096 tokens, averaged over layers),
for uniform k and each allocation at the same average k.
"""

from __future__ import annotations

import time

from aqua_export import corpus, evaluate
from aqua_export.allocate import layer_selected, select_measured_costs
from aqua_export.config import AquaConfig
from aqua_export.slice_costs import add_select_costs

RULE = "weighted"  # the rule the cost curve is quoted for
K_RATIOS = (0.5, 0.4, 0.3)
ALLOCS = ("uniform", "energy", "measured")
LONG = ("uniform", "measured")  # long windows: uniform and the allocation the claim is about
LONG_TEXT, LONG_LENGTH, LONG_TOKENS, LAST = "builtin:licenses", 2048, 4096, 1024


def with_costs(model, tok, proj, proj_path, calib: str):
    """The projection with selection costs for RULE (measured on ``calib`` when the artifact has none)."""
    if proj.has_select_costs(RULE):
        return proj
    t = time.perf_counter()
    proj = add_select_costs(model, tok, proj, proj_path, [calib], RULE)
    print(f"selection costs ({RULE}) measured in {time.perf_counter() - t:.0f} s", flush=True)
    return proj


def predicted(proj, k: float) -> float:
    """What the measured costs themselves promise at average k: the sum over layers of each layer's cost at its
    allocated k over the sum at uniform k (exact if the layers' KL costs added up). Below 0.5 is what the
    allocation would need; the per-layer curves cap what any per-layer allocation can reach."""
    cfg = AquaConfig(k_ratio=k, selection=RULE, k_alloc="measured")
    costs, d = select_measured_costs(proj, cfg), proj.P[0].shape[-1]
    ks = layer_selected(cfg, proj, (d,) * len(proj.P))
    uniform = cfg.selected_of(d)
    return float(sum(costs[i, x] for i, x in enumerate(ks)) / costs[:, uniform].sum())


def measure(model, tok, proj, text: str, queries, a) -> dict:
    """{"dense": ..., "<alloc>/<k>": {"perplexity", "long", "union", "selected"}} (long: LONG allocations only)."""
    d, n = proj.P[0].shape[-1], len(proj.P)
    long_text = corpus.read_text(LONG_TEXT)

    def ppl(cfg, long: bool) -> dict:
        t = time.perf_counter()
        p = None if cfg.is_dense else proj
        r = {"perplexity": evaluate.perplexity(model, tok, text, tokens=a.tokens, seq_len=a.seq_len, projection=p,
                                               config=cfg)["perplexity"]}
        if long:
            r["long"] = evaluate.perplexity(model, tok, long_text, tokens=LONG_TOKENS, seq_len=LONG_LENGTH, last=LAST,
                                            projection=p, config=cfg)["perplexity"]
        r["seconds"] = time.perf_counter() - t
        return r

    out = {"dense": ppl(AquaConfig(), True)}
    for k in K_RATIOS:
        for alloc in ALLOCS:
            cfg = AquaConfig(k_ratio=k, selection=RULE, k_alloc=alloc)
            ks = layer_selected(cfg, proj, (d,) * n)
            r = ppl(cfg, alloc in LONG)
            r.update(selected=list(ks), union=evaluate.union_fraction(queries, proj.P, proj.key_rms, k, RULE, ks))
            if alloc == "measured":
                r["predicted"] = predicted(proj, k)
            out[f"{alloc}/{k}"] = r
            print(f"k-alloc {alloc} k {k}: ppl {r['perplexity']:.4f}, long {r.get('long', float('nan')):.4f}, "
                  f"u {r['union']:.3f}, k per layer {ks} ({r['seconds']:.0f} s)", flush=True)
    return out


def lines(res: dict) -> list[str]:
    """The quality.md section."""
    if not res:
        return []
    dense = res["dense"]
    L = ["\n## Spreading k over the layers (`--k-alloc`)\n",
         f"Rule `{RULE}`; `--k-ratio` is the average: the layers' k sum to uniform's (allocate.layer_selected). "
         "`energy`: water-filling on the calibrated spectra (the share of the q/k energy beyond k); `measured`: on "
         "each layer's measured cost, the KL of the next-token distribution when only that layer selects k "
         "(calibration text, 512 tokens, k of 8, 16, 24, 32, 48). Increase = perplexity - dense; ratio = allocated "
         "increase / uniform's (<= 0.5: at most half). Bytes: a decode step's u K + V against dense's K + V, u the "
         "union of the group's selected rows measured per layer on the evaluation text. Long: windows of "
         f"{LONG_LENGTH} of `{LONG_TEXT}`, their last {LAST} tokens scored.\n",
         f"Dense: {dense['perplexity']:.4f} (512-token windows), {dense['long']:.4f} (long).\n",
         "| k_ratio | " + " | ".join(ALLOCS) + " | " + " | ".join(f"{x} ratio" for x in ALLOCS[1:]) + " | "
         + " | ".join(f"bytes {x}" for x in ALLOCS) + " | " + " | ".join(f"long {x}" for x in LONG)
         + " | long ratio |", "|---|" + "---|" * (2 * len(ALLOCS) - 1 + len(ALLOCS) + len(LONG) + 1)]
    for k in K_RATIOS:
        row = {x: res[f"{x}/{k}"] for x in ALLOCS}
        up = row["uniform"]["perplexity"] - dense["perplexity"]
        ratios = [(row[x]["perplexity"] - dense["perplexity"]) / up for x in ALLOCS[1:]]
        long_up = row["uniform"]["long"] - dense["long"]
        long_ratio = (row[LONG[-1]]["long"] - dense["long"]) / long_up
        L.append(f"| {k} | " + " | ".join(f"{row[x]['perplexity']:.4f}" for x in ALLOCS) + " | "
                 + " | ".join(f"**{r:.2f}**" if r <= 0.5 else f"{r:.2f}" for r in ratios) + " | "
                 + " | ".join(f"{(1 + row[x]['union']) / 2:.3f}" for x in ALLOCS) + " | "
                 + " | ".join(f"{row[x]['long']:.4f}" for x in LONG) + f" | {long_ratio:.2f} |")
    guess = [res[f"measured/{k}"].get("predicted") for k in K_RATIOS]
    if all(g is not None for g in guess):
        L.append("\nWhat the measured costs promise (the ratio if the layers' KL costs added up: the sum of each layer's "
                 "cost at its allocated k over the sum at uniform k): " + ", ".join(
                     f"k {k}: {g:.2f}" for k, g in zip(K_RATIOS, guess)) + ".")
    L.append("\nk per layer (first layer first):\n")
    for k in K_RATIOS:
        for x in ALLOCS[1:]:
            L.append(f"- k_ratio {k}, {x}: {', '.join(map(str, res[f'{x}/{k}']['selected']))}")
    L.append("")
    return L
