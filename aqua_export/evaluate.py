"""Evaluation: perplexity with and without AQUA, and the information retention loss of a projection.

Perplexity: the first ``tokens`` tokens of a text, cut into non-overlapping windows of ``seq_len``
(the last, shorter window kept if it has >= 2 tokens); every window starts fresh; the loss of each
token given the ones before it in its window, averaged over all predicted tokens.

Retention loss (per layer, per query head): the share of a query's energy in P's basis that the
selected coordinates drop, averaged over the evaluation tokens,
    L = E_q[ 1 - ||q^[I]||^2 / ||q^||^2 ],
for 'magnitude' (I = top-k |q^|) and 'static' (I = first k) selection, with P calibrated offline
(another corpus) or online (the evaluation tokens themselves). Since |q^[I].k^[I] - q.k| <=
||q^ outside I|| * ||k||, L bounds the relative score error a head can suffer.
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import numpy as np
import torch

from . import corpus
from .calibrate import Moments, projection_tensors, recording
from .config import AquaConfig, ConfigError
from .models import attention_geometry
from .ops.rules import select_indices, selection_keep
from .outputs import atomic_write_bytes
from .projection import Projection
from .reference.attention import apply_aqua
from .runtime.folder import CONFIG_FILE, FolderConfig
from .runtime.genai import GenaiGraph
from .runtime.lm import OrtLM
from .runtime.text import load_tokenizer


def _nll(model, ids: torch.Tensor, last: int = 0) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of one window [T] (float64 sum): of every token, or of the last
    ``last`` only."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].to(torch.float64)
    first = max(0, ids.numel() - 1 - last) if last else 0
    return torch.nn.functional.cross_entropy(logits[first:], ids[1 + first:], reduction="sum").item(), \
        ids.numel() - 1 - first


def window_length(asked: int | None, context: int | None, what: str = "the model's") -> int:
    """--seq-len: as asked, within the context (one line past it), or the default 512 (the context when shorter)."""
    if asked is None:
        return min(512, context or 512)
    if context and asked > context:
        raise ConfigError(f"--seq-len {asked} is past {what} context of {context} tokens: lower it")
    return asked


def check_windows(tokens: int, seq_len: int) -> None:
    """--tokens and --seq-len that make at least one window with a token to predict, or one line naming them."""
    if tokens < 2:
        raise ConfigError(f"--tokens {tokens} leaves nothing to predict: give 2 or more")
    if seq_len < 2:
        raise ConfigError(f"--seq-len {seq_len} leaves nothing to predict: give 2 or more")


def perplexity(model, tok, text: str, *, tokens: int, seq_len: int, projection: Projection | None = None,
               config: AquaConfig | None = None, progress: bool = False, mean_value: bool = False,
               last: int = 0, selected: tuple | None = None, probe=None) -> dict:
    """Perplexity of ``text``'s first ``tokens`` in non-overlapping windows of seq_len, with AQUA applied (token
    selection on every row, as if each token were decoded; mean_value: SparQ's correction, to measure it).
    last > 0: only each window's last ``last`` tokens are scored, and only their rows select tokens: the rest is
    their prompt, attended exactly as a served prompt is (a long-context measure at a fraction of the cost).
    selected (k per layer) and probe: apply_aqua's."""
    config = config or AquaConfig()
    check_windows(tokens, seq_len)
    ids = corpus.tokenize(tok, text, tokens)
    ws = corpus.windows(ids, seq_len)
    if not ws:
        raise ConfigError("the evaluation text has fewer than 2 tokens")
    config.require_projection(projection is not None, "a projection (--projection FILE)")
    from tqdm import tqdm

    # token selection on every row, as if each token were decoded (a prompt's rows would attend exactly)
    rows_from = max(0, seq_len - 1 - last) if last else 0
    ctx = apply_aqua(model, projection, config, token_rows_from=rows_from, mean_value=mean_value, selected=selected,
                     probe=probe) \
        if projection is not None else contextlib.nullcontext()
    total, count = 0.0, 0
    with torch.no_grad(), ctx:
        for w in tqdm(ws, desc="eval", unit="win", disable=not progress):
            s, n = _nll(model, w, last)
            total, count = total + s, count + n
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": int(sum(w.numel() for w in ws)),
            "predicted_tokens": count, "windows": len(ws), "seq_len": seq_len, "last": last,
            "config": config.to_dict()}


def _decoded_logits(lm, ids: np.ndarray) -> np.ndarray:
    """ids [T] -> logits [T, V], every token its own forward after the ones before it (a decode step: token
    selection chooses its pages, as in serving)."""
    past, out = lm.empty_past(1), []
    for t in range(ids.size):
        logits, past = lm.step(ids[None, t:t + 1], np.ones((1, t + 1), np.int64), past)
        out.append(np.asarray(logits)[0, -1])
    return np.stack(out)


def folder_context(folder: Path) -> int | None:
    """The context of a built folder: this tool's (aqua_config.json) or genai's model builder's (genai_config.json)."""
    import json

    if (folder / CONFIG_FILE).is_file():
        return FolderConfig.from_folder(folder).context_length
    try:
        return int(json.loads((folder / "genai_config.json").read_text())["model"]["context_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def folder_perplexity(folder, text: str, *, tokens: int, seq_len: int | None = None, threads: int = 0,
                      progress: bool = False) -> dict:
    """Perplexity of a built folder run by ONNX Runtime (the same windows as ``perplexity``): this tool's folders
    through their graph contract (runtime.OrtLM, the native kernels when built), a folder of onnxruntime-genai's
    model builder through its genai_config.json (runtime.genai), so two exports of one checkpoint
    compare on the same text. A token-selection folder decodes each window token by token (a forward of a whole
    window would attend exactly, as a prompt does), slower but what serving computes."""
    from pathlib import Path

    from tqdm import tqdm

    folder = Path(folder)
    seq_len = window_length(seq_len, folder_context(folder), f"{folder}'s model")
    check_windows(tokens, seq_len)
    if (folder / CONFIG_FILE).is_file():

        lm = OrtLM.from_folder(folder, threads, serving=(1, seq_len), all_logits=True)
        logits_of, runtime = (lambda w: lm.step(w[None], np.ones((1, w.size), np.int64), lm.empty_past(1))[0][0]), "aqua"
        if lm.cfg.aqua.selects_tokens:  # a window in one forward would attend exactly (a prompt): decode it instead
            logits_of, runtime = (lambda w: _decoded_logits(lm, w)), "aqua, token by token"
    else:

        g = GenaiGraph(folder, threads)
        logits_of, runtime = (lambda w: g.logits(w[None])[0]), "genai graph"
    ws = corpus.windows(corpus.tokenize(load_tokenizer(folder), text, tokens), seq_len)
    total, count = 0.0, 0
    for w in tqdm(ws, desc="eval", unit="win", disable=not progress):
        ids = w.numpy()
        logits = torch.from_numpy(np.asarray(logits_of(ids), np.float64))
        total += torch.nn.functional.cross_entropy(logits[:-1], w[1:], reduction="sum").item()
        count += ids.size - 1
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": int(sum(w.numel() for w in ws)),
            "predicted_tokens": count, "windows": len(ws), "seq_len": seq_len, "folder": str(folder), "runtime": runtime}


# --------------------------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------------------------

def collect_queries_and_moments(model, ids_windows: list[torch.Tensor]) -> tuple[list[torch.Tensor], Moments]:
    """Post-RoPE queries per layer [H, N, d] and the q/k/v moments of the same tokens."""
    geo = attention_geometry(model)
    mom = Moments.zeros(geo["layers"], geo["kv_heads"], geo["head_dim"])
    store: dict = {}
    with torch.no_grad(), recording(model, mom, query_sink=store):
        for w in ids_windows:
            model(input_ids=w[None], use_cache=False)
    return [torch.cat(store[i], dim=1) for i in range(geo["layers"])], mom


def retention_loss(queries: list[torch.Tensor], P: tuple[torch.Tensor, ...], k_ratio: float, selection: str) -> torch.Tensor:
    """queries[l] [H, N, d], P[l] [Hkv, d, d] -> mean dropped query energy [L, H]."""
    out = []
    for q, p in zip(queries, P):
        h, n, d = q.shape
        hkv = p.shape[0]
        k = max(1, round(k_ratio * d))
        qh = q.reshape(hkv, h // hkv, n, d) @ p[:, None]
        idx = select_indices(qh, k, selection)
        kept = torch.gather(qh.square(), -1, idx).sum(-1)
        total = qh.square().sum(-1).clamp_min(1e-30)
        out.append((1 - kept / total).mean(-1).reshape(h))
    return torch.stack(out)


def union_fraction(queries: list[torch.Tensor], P: tuple[torch.Tensor, ...], key_rms: tuple[torch.Tensor, ...],
                   k_ratio: float, selection: str, selected: tuple | None = None, prices: tuple | None = None) -> float:
    """The share of K^'s rows a decode step reads under ``selection``: per layer, KV head and token, the size of
    the union of the g query heads' selected coordinates over d (k/d when the rule shares one selection),
    averaged. queries[l] [H, N, d], P[l] [Hkv, d, d], key_rms[l] [Hkv, d]; selected: k per layer (an allocation;
    default round(k_ratio d) in every layer); prices: per layer the heads' prices, the pooled selection
    (allocate.head_prices), or None."""
    total, count = 0.0, 0
    for i, (q, p, rms) in enumerate(zip(queries, P, key_rms)):
        h, n, d = q.shape
        hkv = p.shape[0]
        k = max(1, round(k_ratio * d)) if selected is None else selected[i]
        qh = (q.reshape(hkv, h // hkv, n, d) @ p[:, None])[None]  # [1, Hkv, g, N, d]
        keep = selection_keep(qh, k, selection, rms, None if prices is None else prices[i])[0]  # [Hkv, g, N, d]
        hit = keep.any(1)
        total += float(hit.sum()) / d
        count += hkv * n
    return total / count


def retention_report(model, tok, text: str, projection: Projection, *, tokens: int, seq_len: int,
                     k_ratio: float) -> dict:
    ids = corpus.tokenize(tok, text, tokens)
    queries, mom = collect_queries_and_moments(model, corpus.windows(ids, seq_len))
    online = projection_tensors(mom)
    P_online = tuple(online[f"layers.{i}.P"] for i in range(len(queries)))
    res = {}
    for pname, P in (("offline", projection.P), ("online", P_online)):
        for sel in ("magnitude", "static"):
            res[f"{sel}/{pname}"] = retention_loss(queries, P, k_ratio, sel)
    return {"k_ratio": k_ratio, "tokens": int(ids.numel()), "loss": {k: v.tolist() for k, v in res.items()},
            "mean": {k: float(v.mean()) for k, v in res.items()}}


def plot_retention(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(report["loss"])
    vmax = max(max(max(r) for r in report["loss"][k]) for k in keys)
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(4 * len(keys) + 5, 5))
    for ax, k in zip(axes, keys):
        im = ax.imshow(torch.tensor(report["loss"][k]).numpy(), aspect="auto", vmin=0, vmax=vmax, cmap="viridis")
        ax.set_title(f"{k}\nmean {report['mean'][k]:.4f}")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=axes[len(keys) - 1])
    ax = axes[-1]
    for k in keys:
        ax.plot(torch.tensor(report["loss"][k]).mean(-1).numpy(), label=k)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean retention loss")
    ax.legend()
    fig.suptitle(f"Information retention loss, k_ratio={report['k_ratio']} ({report['tokens']} tokens)")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
