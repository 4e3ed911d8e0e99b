"""Calibration: stream text through the model, accumulate second moments, write the projection artifact.

Per layer l and KV head h (docs/design.md, Calibration), with the g query heads of the group:
    C_qk[l, h] = sum over tokens of q_1 q_1^T + ... + q_g q_g^T + k k^T   (post-RoPE, float64)
    C_k[l, h]  = sum of k k^T          (for the 'weighted' selection rule)
    C_v[l, h]  = sum of v v^T
P[l, h] = eigenvectors of C_qk, columns by descending eigenvalue, each column's largest-magnitude
entry positive. Memory is L * Hkv * 3 * d * d float64, whatever the token count.

The artifact it writes (layers.{i}.P, P_v, energy, energy_v, key_rms; its metadata) is projection.py's.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass

import torch

from . import __version__, corpus
from .config import ConfigError
from .models import architecture_of, attention_geometry, cache_keyword, fingerprint, returned_cache
from .projection import FORMAT_VERSION
from .reference.precision import float32_compute

_CALIB_IMPL = "aqua_calibrate"


@dataclass
class Moments:
    """Running float64 sums, one [Hkv, d, d] block per layer for each of q/k stack, keys, values."""

    qk: torch.Tensor  # [L, Hkv, d, d]
    k: torch.Tensor  # [L, Hkv, d, d]
    v: torch.Tensor  # [L, Hkv, d, d]
    n_qk: int = 0
    n_k: int = 0

    @classmethod
    def zeros(cls, layers: int, kv_heads: int, d: int, device=None) -> "Moments":
        z = lambda: torch.zeros(layers, kv_heads, d, d, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(), z(), z())

    def cpu(self) -> "Moments":
        return Moments(self.qk.cpu(), self.k.cpu(), self.v.cpu(), self.n_qk, self.n_k)


def _gram(x: torch.Tensor) -> torch.Tensor:
    """x [Hkv, N, d] -> sum over N of outer products, [Hkv, d, d] in float64."""
    x = x.to(torch.float64)
    return x.transpose(1, 2) @ x


def _calibration_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Records post-RoPE q/k and v into module._aqua_moments, then computes eager attention.

    query [B, H, T, d], key/value [B, Hkv, T, d] (no cache during calibration).
    """
    mom: Moments = module._aqua_moments
    li = module.layer_idx
    sink = module._aqua_query_sink
    if sink is not None:  # [H, B*T, d] per call, for retention analysis
        sink.setdefault(li, []).append(query.detach().transpose(0, 1).reshape(query.shape[1], -1, query.shape[-1]))
    b, h, t, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    q = query.reshape(b, hkv, g, t, d).permute(1, 0, 2, 3, 4).reshape(hkv, b * g * t, d)
    k = key.permute(1, 0, 2, 3).reshape(hkv, b * t, d)
    v = value.permute(1, 0, 2, 3).reshape(hkv, b * t, d)
    gk = _gram(k).to(mom.qk.device)  # layers may sit on other devices (accelerate's device_map)
    mom.qk[li] += _gram(q).to(mom.qk.device) + gk
    mom.k[li] += gk
    mom.v[li] += _gram(v).to(mom.qk.device)
    if li == 0:
        mom.n_qk += b * (g + 1) * t
        mom.n_k += b * t
    kr = key.repeat_interleave(g, dim=1)
    vr = value.repeat_interleave(g, dim=1)
    w = (query @ kr.transpose(-1, -2)) * scaling
    softcap = kwargs.get("softcap")
    if softcap:  # Gemma 2
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return (w @ vr).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def recording(model, moments: Moments, query_sink: dict | None = None):
    """Route attention through the recorder; everything is put back on exit.

    With ``query_sink``, each layer's post-RoPE queries are also kept: sink[layer] = list of [H, N, d].
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(_CALIB_IMPL, _calibration_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_CALIB_IMPL, eager_mask)
    previous = model.config._attn_implementation

    arch = architecture_of(model.config)
    attns = [arch.attention(layer) for layer in arch.layers(model)]
    for a in attns:
        a._aqua_moments = moments
        a._aqua_query_sink = query_sink
    model.set_attn_implementation(_CALIB_IMPL)
    try:
        yield moments
    finally:
        model.set_attn_implementation(previous)
        for a in attns:
            del a._aqua_moments, a._aqua_query_sink


def _eig_desc(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c [..., d, d] symmetric -> (eigenvalues descending [..., d], eigenvectors as columns [..., d, d]).

    Sign convention: each column's largest-magnitude entry (lowest index on ties) is positive,
    so the same moments always give the same bytes.
    """
    c = 0.5 * (c + c.transpose(-1, -2))
    w, v = torch.linalg.eigh(c)
    w, v = w.flip(-1), v.flip(-1)
    idx = v.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(v, -2, idx))
    sign[sign == 0] = 1
    return w.clamp_min(0), v * sign


def projection_tensors(mom: Moments) -> dict[str, torch.Tensor]:
    out = {}
    w, p = _eig_desc(mom.qk)
    wv, pv = _eig_desc(mom.v)
    # key_rms in P's basis: sqrt(diag(P^T C_k P) / n_k)
    key_ms = torch.einsum("lhij,lhik,lhkj->lhj", p, mom.k, p) / max(mom.n_k, 1)
    for i in range(p.shape[0]):
        out[f"layers.{i}.P"] = p[i].to(torch.float32)
        out[f"layers.{i}.P_v"] = pv[i].to(torch.float32)
        out[f"layers.{i}.energy"] = (w[i] / max(mom.n_qk, 1)).to(torch.float32)
        out[f"layers.{i}.energy_v"] = (wv[i] / max(mom.n_k, 1)).to(torch.float32)
        out[f"layers.{i}.key_rms"] = key_ms[i].clamp_min(0).sqrt().to(torch.float32)
    return out


def generated_token_stream(model, tok, n_tokens: int, seed: int, batch: int = 8, progress: bool = False
                           ) -> torch.Tensor:
    """Text the model writes itself from fixed prompts and a fixed seed: a corpus that needs no dataset."""
    prompts = [
        "The history of", "In mathematics,", "Once upon a time", "The following program",
        "Scientists recently", "A recipe for", "The city council", "In this chapter we",
    ][:batch]
    per = math.ceil(n_tokens / len(prompts))
    gen = torch.Generator().manual_seed(seed)
    old = tok.padding_side
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    tok.padding_side = old
    ids, mask = enc["input_ids"], enc["attention_mask"]
    out = []
    past = None
    cur_ids, cur_mask = ids, mask
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        for _ in _progress(per, "generating calibration text", progress, unit="step"):
            r = model(input_ids=cur_ids, attention_mask=cur_mask, position_ids=pos, use_cache=True,
                      **{cache_keyword(model): past})
            past = returned_cache(r)
            probs = torch.softmax(r.logits[:, -1, :].float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            out.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            cur_ids, cur_mask = nxt, mask
            pos = pos[:, -1:] + 1
    return torch.cat(out, dim=1).reshape(-1)[:n_tokens]


def execution_device(model) -> torch.device:
    """Where inputs go: the embedding's device (CPU when accelerate has offloaded it to disk: meta)."""
    dev = model.get_input_embeddings().weight.device
    return torch.device("cpu") if dev.type == "meta" else dev


def _chunks(windows: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """One forward's input each: full windows ``batch`` at a time, then any shorter window alone."""
    full = [w for w in windows if w.numel() == windows[0].numel()]
    rest = [w for w in windows if w.numel() != windows[0].numel()]
    return [torch.stack(full[i:i + batch]) for i in range(0, len(full), batch)] + [w[None] for w in rest]


def _world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _accumulate(model, chunks: list[torch.Tensor], geo: dict, group, bar) -> Moments | None:
    """The moments of every chunk, summed in chunk order.

    Byte-identical whatever the number of processes: float64 addition is not associative, so the sum is
    always the same left fold over per-chunk contributions, total = ((c_0 + c_1) + c_2) + ... With one
    process each forward adds its c_j to the running total directly; with N ranks, rank r computes the
    c_j with j = r mod N and rank 0 folds them in order (None on the other ranks). Only the decoder runs:
    the moments are read inside attention, so the vocabulary-wide logits are never computed."""
    rank, world = _world(group)
    dev = execution_device(model)
    decoder = architecture_of(model.config).decoder(model)
    zeros = lambda: Moments.zeros(geo["layers"], geo["kv_heads"], geo["head_dim"], dev)  # noqa: E731
    if world == 1:
        mom = zeros()
        with recording(model, mom):
            for c in chunks:
                decoder(input_ids=c.to(dev), use_cache=False)
                bar.update(c.shape[0])
        return mom.cpu()
    import torch.distributed as dist

    parts = {}
    for j in range(rank, len(chunks), world):
        part = zeros()
        with recording(model, part):
            decoder(input_ids=chunks[j].to(dev), use_cache=False)
        parts[j] = part.cpu()
        bar.update(chunks[j].shape[0])
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(parts, gathered, dst=0, group=group)
    if rank != 0:
        return None
    mom = zeros()
    for j in range(len(chunks)):
        part = next(g[j] for g in gathered if j in g)
        mom.qk += part.qk
        mom.k += part.k
        mom.v += part.v
        mom.n_qk += part.n_qk
        mom.n_k += part.n_k
    return mom


def calibrate(model, tok, *, texts: list[str] | None = None, tokens: int = 16384, seq_len: int = 512,
              seed: int = 0, batch: int = 4, progress: bool = True, group=None):
    """Run calibration; returns (tensors, metadata) of the artifact.

    group: a torch.distributed process group to split the corpus over (data-parallel calibration under
    torchrun); the artifact is byte-identical to one process's, and only rank 0 gets it (None elsewhere)."""
    if tokens < 1 or seq_len < 2:
        raise ConfigError("calibration needs --tokens >= 1 and --seq-len >= 2")
    with float32_compute(model):
        return _calibrate(model, tok, texts, tokens, seq_len, seed, batch, progress, group)


def _calibrate(model, tok, texts, tokens, seq_len, seed, batch, progress, group):
    geo = attention_geometry(model)
    rank, world = _world(group)
    if texts:
        text = corpus.read_texts(texts)
        ids = corpus.tokenize(tok, text, tokens)
        desc, digest = corpus.describe(texts), corpus.sha256_text(text)
    else:
        ids = generated_token_stream(model, tok, tokens, seed, progress=progress) if rank == 0 else None
        if world > 1:  # sampling may round differently per process: every rank takes rank 0's text
            import torch.distributed as dist

            box = [ids]
            dist.broadcast_object_list(box, src=0, group=group)
            ids = box[0]
        desc = f"self-generated(seed={seed})"
        digest = corpus.sha256_text(",".join(map(str, ids.tolist())))
    if ids.numel() < 2:
        raise ConfigError("calibration text has fewer than 2 tokens: give a longer --text")
    windows = corpus.windows(ids, seq_len)
    bar = _progress(len(windows), "calibrate" if world == 1 else f"calibrate (rank {rank}/{world})", progress)
    with torch.no_grad():
        mom = _accumulate(model, _chunks(windows, batch), geo, group, bar)
    bar.close()
    if mom is None:
        return None
    tensors = projection_tensors(mom)
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": json.dumps(fingerprint(model), sort_keys=True),
        "corpus": desc,
        "corpus_sha256": digest,
        "tokens": str(int(sum(w.numel() for w in windows))),
        "seq_len": str(seq_len),
        "seed": str(seed),
        "tool": f"aqua-export {__version__}",
    }
    return tensors, meta


def _progress(total: int, desc: str, enabled: bool, unit: str = "win"):
    """A bar of ``total`` units; iterating it yields range(total) and advances the bar."""
    from tqdm import tqdm

    return tqdm(range(total), total=total, desc=desc, unit=unit, disable=not enabled)
