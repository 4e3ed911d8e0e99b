"""A study for sparse prefill (issue 64), before any kernel: how few blocks of a prompt's causal attention keep a
given share of its softmax mass, and how close estimates built from AQUA's own quantities come to that oracle.

The embedded model on prose (builtin:licenses, not the calibration text), exact attention in float32. Per layer, KV
head and query block of QUERY tokens (its g query heads' rows together: the native prompt kernel's task), the true
mass of each causal key block of KEYS keys is the block's softmax probability summed over its keys and averaged over
the rows. The first (sink) block and the query block's diagonal block are always kept. For a threshold tau:

    oracle        blocks taken by true mass until tau of it is kept: the fewest any choice needs
    by estimate   blocks taken in the estimate's order until tau of the TRUE mass is kept: how good its order is
    self-stopped  blocks taken in the estimate's order until tau of the ESTIMATED mass: what a kernel could do (it
                  knows only its estimate); the true mass it keeps is reported (mean and the worst 1% of blocks)

Estimates (q^ = q P, K^ = K P with the calibrated P; k of the d coordinates by |q^|, as AQUA's magnitude rule):
    mean k=K      the block's mean q^, its top k coordinates, against each key block's mean K^ (plus log of the
                  block's key count): one score per key block, the crude estimate of the issue
    rows s=S k=K  every S-th token's rows (each of its g heads), each with its own top k coordinates, scored
                  against every visible key; softmax per row; mass per key block averaged over the sampled rows.
                  Its product costs (1/S)(k/d) of the exact scores'

    python -m tools.studies.sparse_prefill_study [--lengths 2048,4096,8000] [--taus 0.9,0.95,0.98,0.99]
    -> benchmarks/sparse_prefill_study.json and .md
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import torch

from aqua_export import corpus, models
from aqua_export.outputs import atomic_write_bytes
from tools.harness import BENCHMARKS, table
from tools.studies.int8_scale_study import projection

TEXT = "builtin:licenses"
QUERY = 64  # tokens per query block (the prompt kernel's task at g = 3: 192 rows)
KEYS = 64  # keys per key block
ESTIMATES = {"mean k=16": ("mean", 1, 16), "rows s=16 k=16": ("rows", 16, 16), "rows s=8 k=16": ("rows", 8, 16),
             "rows s=4 k=16": ("rows", 4, 16), "rows s=8 k=32": ("rows", 8, 32), "rows s=8 k=64": ("rows", 8, 64),
             "union s=16 k=16": ("union", 16, 16), "union s=8 k=16": ("union", 8, 16),
             "oracle per row": ("union", 1, 64)}


@dataclass
class Tally:
    """Blocks chosen and true mass kept, summed over (layer, head, query block), per (rule, tau)."""

    causal: int = 0
    chosen: dict = field(default_factory=dict)  # (rule, tau) -> blocks
    kept: dict = field(default_factory=dict)  # (estimate, tau) -> [true mass kept, per block], self-stopped

    def add(self, key, n: int) -> None:
        self.chosen[key] = self.chosen.get(key, 0) + n


def _take(order_by: torch.Tensor, stop_on: torch.Tensor, forced: torch.Tensor, tau: float) -> torch.Tensor:
    """order_by, stop_on [H, N] (stop_on sums to 1 per row), forced [N] bool -> counts [H]: the forced blocks, then the
    others in descending order_by until stop_on's sum over the taken reaches tau."""
    key = torch.where(forced, torch.full_like(order_by, float("inf")), order_by)
    idx = key.argsort(dim=-1, descending=True)
    cum = stop_on.gather(-1, idx).cumsum(-1)
    need = (cum < tau - 1e-6).sum(-1) + 1  # blocks until the sum reaches tau
    return torch.maximum(need.clamp(max=order_by.shape[-1]), forced.sum().expand_as(need))


def _chosen(order_by: torch.Tensor, stop_on: torch.Tensor, forced: torch.Tensor, tau: float) -> torch.Tensor:
    """The blocks _take counts, as a mask [H, N] (1.0 where chosen)."""
    n = _take(order_by, stop_on, forced, tau)
    key = torch.where(forced, torch.full_like(order_by, float("inf")), order_by)
    idx = key.argsort(dim=-1, descending=True)
    rank = torch.arange(idx.shape[-1]).expand_as(idx)
    return torch.zeros_like(order_by).scatter(-1, idx, (rank < n[:, None]).to(order_by.dtype))


def causal_scores(qh: torch.Tensor, kh: torch.Tensor, scaling: float, t0: int, t1: int) -> torch.Tensor:
    """qh [H, g, T, d] rows t0..t1 against keys 0..t1 -> scores [H, g, t1 - t0, t1], the later keys -inf."""
    s = torch.einsum("hgtd,hsd->hgts", qh[:, :, t0:t1], kh[:, :t1]) * scaling
    return s.masked_fill(torch.arange(t1)[None, :] > torch.arange(t0, t1)[:, None], float("-inf"))


def block_masses(scores: torch.Tensor) -> torch.Tensor:
    """Exact: causal_scores' [H, g, R, t1] -> mass per key block [H, ceil(t1 / KEYS)], averaged over the rows."""
    return _per_block(torch.softmax(scores, dim=-1).mean(dim=(1, 2)), scores.shape[-1])


def _forced(t0: int, t1: int) -> torch.Tensor:
    """The sink block and the query block's diagonal block(s), always kept: [ceil(t1 / KEYS)] bool."""
    forced = torch.zeros(-(-t1 // KEYS), dtype=torch.bool)
    forced[[0, t0 // KEYS, (t1 - 1) // KEYS]] = True
    return forced


def _per_block(p: torch.Tensor, t1: int) -> torch.Tensor:
    nb = -(-t1 // KEYS)
    p = torch.nn.functional.pad(p, (0, nb * KEYS - t1))
    return p.reshape(p.shape[0], nb, KEYS).sum(-1)


def estimate(kind: str, stride: int, k: int, qh, kh, kmeans, scaling: float, t0: int, t1: int) -> torch.Tensor:
    """The estimated mass per key block [H, nb] (sums to 1 per head)."""
    nb = -(-t1 // KEYS)
    if kind == "mean":
        q = qh[:, :, t0:t1].mean(dim=(1, 2))  # [H, d]
        top = q.abs().topk(k, dim=-1).indices
        qs = torch.zeros_like(q).scatter(-1, top, q.gather(-1, top))
        score = torch.einsum("hd,hnd->hn", qs, kmeans[:, :nb]) * scaling
        count = torch.full((nb,), float(KEYS))
        count[-1] = t1 - (nb - 1) * KEYS
        return torch.softmax(score + count.log(), dim=-1)
    rows = torch.arange(t0 + stride - 1, t1, stride)
    if len(rows) == 0:
        rows = torch.tensor([t1 - 1])
    q = qh[:, :, rows]  # [H, g, R, d]
    top = q.abs().topk(k, dim=-1).indices
    qs = torch.zeros_like(q).scatter(-1, top, q.gather(-1, top))
    s = torch.einsum("hgrd,hsd->hgrs", qs, kh[:, :t1]) * scaling
    p = torch.softmax(s.masked_fill(torch.arange(t1)[None, :] > rows[:, None], float("-inf")), dim=-1)
    if kind == "union":  # each sampled row's own masses [H, g * R, nb]: its blocks are chosen for it (choose)
        return _per_block(p.reshape(p.shape[0], -1, t1).flatten(0, 1), t1).reshape(p.shape[0], -1, nb)
    return _per_block(p.mean(dim=(1, 2)), t1)


def choose(e: torch.Tensor, forced: torch.Tensor, tau: float) -> torch.Tensor:
    """Chosen key blocks [H, nb] (1.0 / 0.0) self-stopped at tau: e [H, nb] one mass per block, or [H, X, nb] each of
    X rows' masses, the union of the blocks each row takes for its own tau."""
    if e.dim() == 2:
        return _chosen(e, e, forced, tau)
    flat = e.flatten(0, 1)
    return _chosen(flat, flat, forced, tau).reshape(e.shape).amax(1)


def _rotated(query: torch.Tensor, key: torch.Tensor, P: torch.Tensor):
    """query [1, H, T, d], key [1, Hkv, T, d], P [Hkv, d, d] -> q^ [Hkv, g, T, d], K^ [Hkv, T, d], the key blocks'
    mean K^ [Hkv, nb, d]."""
    _, h, t, d = query.shape
    hkv = key.shape[1]
    qh = query[0].reshape(hkv, h // hkv, t, d).float() @ P[:, None]
    kh = key[0].float() @ P
    nb = -(-t // KEYS)
    count = torch.full((nb,), float(KEYS))
    count[-1] = t - (nb - 1) * KEYS
    kpad = torch.nn.functional.pad(kh, (0, 0, 0, nb * KEYS - t))
    return qh, kh, kpad.reshape(hkv, nb, KEYS, d).sum(2) / count[None, :, None]


def study_layer(query: torch.Tensor, key: torch.Tensor, P: torch.Tensor, scaling: float, taus, tally: Tally) -> None:
    """query [1, H, T, d], key [1, Hkv, T, d] (post-RoPE), P [Hkv, d, d]: every query block's oracle and estimates."""
    qh, kh, kmeans = _rotated(query, key, P)
    hkv, t = kh.shape[0], kh.shape[1]
    for t0 in range(0, t, QUERY):
        t1 = min(t, t0 + QUERY)
        true = block_masses(causal_scores(qh, kh, scaling, t0, t1))
        forced = _forced(t0, t1)
        tally.causal += hkv * true.shape[-1]
        est = {name: estimate(kind, s, k, qh, kh, kmeans, scaling, t0, t1)
               for name, (kind, s, k) in ESTIMATES.items()}
        for tau in taus:
            tally.add(("oracle", tau), int(_take(true, true, forced, tau).sum()))
            for name, e in est.items():
                if e.dim() == 2:  # one order over the blocks: how good it is, against the oracle's
                    tally.add((name, tau), int(_take(e, true, forced, tau).sum()))
                taken = choose(e, forced, tau)
                tally.add((name + " self", tau), int(taken.sum()))
                tally.kept.setdefault((name, tau), []).extend((taken * true).sum(-1).tolist())


def sparse_layer(query, key, value, P: torch.Tensor, scaling: float, rule: str, tau: float) -> torch.Tensor:
    """The layer's attention with each query block attending only the key blocks ``rule`` chooses at ``tau``
    (self-stopped; "oracle": by the true mass): query [1, H, T, d], key / value [1, Hkv, T, d] -> [1, T, H, d]."""
    qh, kh, kmeans = _rotated(query, key, P)
    hkv, g, t, d = qh.shape
    v = value[0].float()
    out = torch.empty(hkv, g, t, v.shape[-1])
    for t0 in range(0, t, QUERY):
        t1 = min(t, t0 + QUERY)
        s = causal_scores(qh, kh, scaling, t0, t1)  # q^ . K^ = q . K: P is orthogonal
        if rule == "oracle":
            e = block_masses(s)
        else:
            kind, stride, k = ESTIMATES[rule]
            e = estimate(kind, stride, k, qh, kh, kmeans, scaling, t0, t1)
        keep = choose(e, _forced(t0, t1), tau).repeat_interleave(KEYS, -1)[:, :t1] > 0  # [Hkv, t1]
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        out[:, :, t0:t1] = torch.softmax(s, dim=-1) @ v[:, None, :t1]
    return out.reshape(1, hkv * g, t, -1).transpose(1, 2).to(query.dtype).contiguous()


def run_length(model, tok, proj, tokens: int, taus, sparse: tuple[str, float] | None = None) -> dict:
    """One prompt of ``tokens`` prose tokens through the model and its perplexity: with ``sparse`` (rule, tau) every
    row's attention block-sparse as that rule chooses; without, exact, every layer studied in its attention call."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    ids = corpus.tokenize(tok, corpus.read_texts([TEXT]), tokens)[None]
    tally = Tally()

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        P = proj.P[module.layer_idx].float()
        if sparse is not None:
            return sparse_layer(query, key, value, P, scaling, *sparse), None
        study_layer(query, key, P, scaling, taus, tally)
        g = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("aqua_sparse_study", attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register("aqua_sparse_study", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("aqua_sparse_study")
    start = time.time()
    try:
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
    finally:
        model.set_attn_implementation(previous)
    ppl = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp())
    out = {"tokens": tokens, "seconds": round(time.time() - start, 1), "perplexity": round(ppl, 4), "rules": {}}
    if sparse is not None:
        return out
    for (rule, tau), n in sorted(tally.chosen.items(), key=lambda x: (x[0][1], x[0][0])):
        row = out["rules"].setdefault(rule, {})
        row[f"share@{tau}"] = round(n / tally.causal, 4)
        base = rule.removesuffix(" self")
        if rule.endswith(" self"):
            kept = torch.tensor(tally.kept[(base, tau)])
            row[f"kept_mean@{tau}"] = round(float(kept.mean()), 4)
            row[f"kept_p1@{tau}"] = round(float(kept.quantile(0.01)), 4)
    return out


# (rule, tau) whose perplexity is measured with every row's attention block-sparse as the rule chooses
SPARSE_RUNS = [("oracle", 0.95), ("oracle per row", 0.9), ("rows s=8 k=16", 0.95), ("rows s=8 k=16", 0.98),
               ("rows s=8 k=16", 0.99), ("rows s=4 k=16", 0.98), ("rows s=8 k=64", 0.95), ("rows s=8 k=64", 0.98),
               ("mean k=16", 0.95), ("union s=8 k=16", 0.9), ("union s=8 k=16", 0.95)]


def _ppl_rows(r: dict) -> list[list]:
    rows = [["dense (exact)", "100%", f"{r['perplexity']:.3f}", ""]]
    for name, v in r.get("sparse", {}).items():
        rule, tau = name.rsplit("@", 1)
        share = r["rules"][rule if rule == "oracle" else rule + " self"][f"share@{tau}"]
        rows.append([f"{rule}, self-stopped at {tau}" if rule != "oracle" else f"oracle at {tau}", f"{share:.1%}",
                     f"{v['perplexity']:.3f}", f"{v['increase_percent']:+.2f}%"])
    return rows


def render(res: dict) -> str:
    taus = res["taus"]
    md = ["# Sparse prefill: how few blocks, and how good AQUA's estimates are", "",
          f"`python -m tools.studies.sparse_prefill_study`: the embedded model on `{TEXT}`, exact attention in float32, "
          f"query blocks of {QUERY} tokens (all g heads' rows), key blocks of {KEYS}, the sink and diagonal blocks always "
          "kept. Share: chosen blocks over causal blocks, summed over layers, KV heads and query blocks. The tool's "
          "docstring defines each rule.", ""]
    for r in res["lengths"]:
        rows = []
        names = dict.fromkeys(n.removesuffix(" self") for n in r["rules"])
        for name in names:
            v = r["rules"].get(name, {})
            me = r["rules"].get(name + " self", {})
            cells = [name] + [f"{v[f'share@{t}']:.1%}" if v else "" for t in taus]
            for t in taus:
                cells.append(f"{me[f'share@{t}']:.1%} ({me[f'kept_mean@{t}']:.3f} / {me[f'kept_p1@{t}']:.3f})"
                             if me else "")
            rows.append(cells)
        heads = ["rule"] + [f"share for {t:g} of the true mass" for t in taus] + \
            [f"self-stopped at {t:g}: share (true mass kept: mean / worst 1%)" for t in taus]
        md += [f"## {r['tokens']} tokens ({r['seconds']} s)", "", *table(heads, rows), "",
               "Perplexity of the same prompt with every row's attention block-sparse as the rule chooses (all of its "
               "layers, the first token's row included; share as above):", "",
               *table(["attention", "blocks computed", "perplexity", "against dense"], _ppl_rows(r)), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8000")
    ap.add_argument("--taus", default="0.9,0.95,0.98,0.99")
    ap.add_argument("--out", default=str(BENCHMARKS / "sparse_prefill_study"))
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    lengths = [int(x) for x in a.lengths.split(",")]
    taus = [float(x) for x in a.taus.split(",")]
    model, tok = models.load("llama")
    proj = projection(model, tok)
    res = {"text": TEXT, "query": QUERY, "keys": KEYS, "taus": taus, "lengths": []}
    for n in lengths:
        r = run_length(model, tok, proj, n, taus)
        r["sparse"] = {}
        for rule, tau in SPARSE_RUNS:
            if tau in taus:
                ppl = run_length(model, tok, proj, n, taus, (rule, tau))["perplexity"]
                r["sparse"][f"{rule}@{tau}"] = {"perplexity": ppl,
                                                "increase_percent": round(100 * (ppl / r["perplexity"] - 1), 3)}
        res["lengths"].append(r)
        print(json.dumps(r), flush=True)
    atomic_write_bytes(a.out + ".json", (json.dumps(res, indent=1) + "\n").encode())
    atomic_write_bytes(a.out + ".md", render(res).encode())
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
