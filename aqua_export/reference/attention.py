"""The PyTorch reference of AQUA attention, registered through transformers' attention interface.

Nothing happens on import. ``apply_aqua(model, projection, config)`` is a context manager that
registers the ``aqua`` attention function, attaches per-layer state, projects values by P_v for
AQUA-Memory, and undoes all of it on exit.

Per layer, per query head of KV group h (docs/design.md, The operator), with r the retained width, k selected:

    q^ = (q P_h)[:r]            k^ = (k P_h)[:r]  (cached: the cache holds k^, r wide)
    I  = top-k(|q^|)            (ties -> lower index; other rules: ops.rules.selection_score)
    s_j = scale * q^[I] . k^_j[I]      softmax over visible j, times V (P_v basis, r wide)

AQUA-H2O keeps ceil(h2o_ratio * n) of the n tokens a sequence has seen, half of them the most
recent, the rest the heavy hitters by accumulated softmax(approximate scores) summed over the
query heads of the group. A multi-token forward simulates the token-by-token eviction exactly, so
perplexity evaluation and prefill agree with step-by-step generation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..allocate import head_prices, layer_selected, layer_widths
from ..config import AquaConfig, ConfigError
from ..models import architecture_of, attention_geometry, cache_keyword
from ..ops import rules
from ..ops.rules import budget as h2o_budget
from ..settings.h2o import keeps_a_share
from ..ops.rules import h2o_keep, select_indices
from ..projection import Projection
from .cache import AquaCache, AquaLayerCache

IMPL = "aqua"


# --------------------------------------------------------------------------------------------
# The operator
# --------------------------------------------------------------------------------------------

def approx_scores(qh: torch.Tensor, kh: torch.Tensor, k: int, selection: str,
                  key_rms: torch.Tensor | None = None, idx: torch.Tensor | None = None) -> torch.Tensor:
    """qh [B, Hkv, g, Tq, r], kh [B, Hkv, S, r] -> q^[I] . k^[:, I]^T, [B, Hkv, g, Tq, S] (unscaled).

    idx [B, Hkv, g, Tq, k] (or a keep mask [B, Hkv, g, Tq, r] bool: the pooled selection's), when given, is used
    as I instead of selecting (parity under a shared selection).
    """
    r = qh.shape[-1]
    if k < r:
        if idx is None:
            idx = select_indices(qh, k, selection, key_rms)
        keep = idx.to(qh.dtype) if idx.dtype == torch.bool else torch.zeros_like(qh).scatter_(-1, idx, 1.0)
        qh = qh * keep  # zeroed coordinates add exact zeros: same as gathering I
    return qh @ kh[:, :, None].transpose(-1, -2)


# --------------------------------------------------------------------------------------------
# Attention function
# --------------------------------------------------------------------------------------------

class Probe(Protocol):
    """An instrument passed to ``apply_aqua(probe=...)`` (the parity harness's): it sees each choice the reference
    makes and may replace it by another implementation's, so two implementations can be compared under one
    choice. Without a probe the reference runs on its own choices."""

    def select(self, st: "LayerAqua", qh: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """qh [B, Hkv, g, T, r]; own: the rule's indices [B, Hkv, g, T, k] -> the indices to score with."""

    def evict(self, st: "LayerAqua", layer: "AquaLayerCache", token: int, visible, acc, budget, own, hidden,
              real) -> torch.Tensor:
        """One token's H2O decision (token: its index in the sequence). visible / own / hidden [B, Hkv, S] bool
        (own: the slots the keep rule keeps), acc [B, Hkv, S], budget [B], real [B] -> the slots kept."""

    def pages(self, st: "LayerAqua", positions: torch.Tensor, score, forced, attended, own) -> torch.Tensor:
        """Token selection's pages for the rows at sequence ``positions`` [R]: score / forced / own [B, Hkv, R, P]
        (ops.rules.page_scores, forced_pages, select_pages), attended [B, Hkv, R] -> the pages attended."""

    def blocks(self, st: "LayerAqua", positions: torch.Tensor, visible, own, margin, before) -> torch.Tensor:
        """Sparse prefill's key blocks for the rows at sequence ``positions`` [R]: visible / own [B, Hkv, R, S]
        (the keys the mask allows; those the rule keeps of them), margin / before [B, Hkv, R]
        (ops.rules.prefill_choice) -> the keys attended."""


@dataclass(frozen=True)
class TokenSelection:
    """Token selection in the reference (ops.rules): ratio / budget / sink / window as AquaConfig's token_* fields.
    rows_from: the rows at sequence positions >= it select (None: the rows of one-token forwards, as the graph does:
    a prompt attends exactly); mean_value: SparQ's mean-value correction, out = a attn + (1 - a) mean(V) with a the
    approximate softmax mass of the chosen tokens (measured by tools/quality.py; the graph has none)."""

    ratio: float
    budget: int
    sink: int
    window: int
    rows_from: int | None = None
    mean_value: bool = False


@dataclass(eq=False)
class LayerAqua:
    """Per-layer state attached to the attention module while AQUA is applied."""

    P_r: torch.Tensor  # [Hkv, d, r]
    r: int
    k: int
    d: int
    selection: str
    key_rms: torch.Tensor  # [Hkv, r]
    h2o_ratio: float
    rv: int | None = None  # V's cached width when it differs from K^'s r (allocated AQUA-Memory)
    P_v_r: torch.Tensor | None = None  # [Hkv, d, rv]: values are cached in P_v's basis, sliced, when rv < d
    index: int = 0  # the layer's index
    tokens: TokenSelection | None = None  # token selection, or None
    probe: "Probe | None" = field(default=None, repr=False)  # apply_aqua's probe (parity), or None
    prices: tuple | None = None  # [Hkv] floats: the heads share the layer's k per step (rules, pooled), or None
    # sparse prefill's (threshold, stride, k_ratio, rows_from) (rules.prefill_chosen; rows_from: apply_aqua's
    # token_rows_from, where a forward's decoded tokens start), or None
    prefill: tuple | None = None
    fresh: tuple | None = field(default=None, repr=False)

    @property
    def evicts(self) -> bool:
        return keeps_a_share(self.h2o_ratio)

    @property
    def value_width(self) -> int:
        return self.r if self.rv is None else self.rv

    def values_in(self, v: torch.Tensor) -> torch.Tensor:
        """v [B, Hkv, S, d] -> the cached values: in P_v's basis, sliced to rv, when slicing (the export folds P_v
        into W_V and W_O instead: the same arithmetic, and the model's weights stay as they are here)."""
        return v if self.P_v_r is None else v @ self.P_v_r[None].to(v.dtype)


def _take_layer_cache(st: LayerAqua, key: torch.Tensor) -> AquaLayerCache | None:
    fresh, st.fresh = st.fresh, None
    if fresh is not None and fresh[0] is key:
        return fresh[1]
    return None


def aqua_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention interface. query [B, H, Tq, d]; key/value [B, Hkv, S, d] (or k^/v from
    an AquaCache, r wide); attention_mask [B, 1, Tq, S_logical] float (0 = attend). Returns [B, Tq, H, d]."""
    st: LayerAqua = module._aqua
    layer = _take_layer_cache(st, key)
    b, h, tq, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    P_r = st.P_r.to(query.dtype)
    qh = query.reshape(b, hkv, g, tq, d) @ P_r[None, :, None]
    if layer is not None:
        kh, v = key, value
    else:
        if st.evicts and key.shape[2] > tq:
            raise ConfigError("AQUA-H2O needs an AquaCache to evict from: pass past_key_values=session.new_cache()")
        kh, v = key @ P_r[None], st.values_in(value)
    idx = None
    if st.k < st.r:
        idx = select_indices(qh, st.k, st.selection, st.key_rms) if st.prices is None else \
            rules.selection_keep(qh, st.k, st.selection, st.key_rms, st.prices)  # a keep mask
        if st.probe is not None:
            idx = st.probe.select(st, qh, idx)
    allowed, is_real = _visible(layer, attention_mask, b, hkv, tq, kh.shape[2], query.device)
    softcap = kwargs.get("softcap")
    if st.evicts:
        out = _h2o_attend(st, layer, _scores(st, qh, kh, idx, scaling, softcap), allowed, is_real, v)
    else:  # query rows in chunks: a long window's [rows, S] scores stay a few hundred MiB
        position0 = (layer.seen if layer is not None else kh.shape[2]) - tq
        # chunks end at multiples of ROWS positions, so that no query block of sparse prefill is cut in two
        cuts = [0, *range(ROWS - position0 % ROWS, tq, ROWS), tq]
        # one forward over a prompt and the tokens decoded after it (rows_from): sparse prefill's call is the prompt
        rows_from = st.prefill[3] if st.prefill is not None else None
        end = position0 + tq if rows_from is None or rows_from <= position0 else min(position0 + tq, rows_from)
        call = (position0, end, is_real)
        out = torch.cat([_attend(st, qh[:, :, :, t0:t1], kh, v, None if idx is None else idx[:, :, :, t0:t1],
                                 allowed[:, :, t0:t1], scaling, softcap, position0 + t0, call)
                         for t0, t1 in zip(cuts, cuts[1:]) if t1 > t0], dim=3)
    if st.P_v_r is not None:  # back from P_v's sliced basis into the model's, where o_proj takes it
        out = out @ st.P_v_r.transpose(-1, -2)[None, :, None].to(out.dtype)
    return out.reshape(b, h, tq, d).transpose(1, 2).contiguous(), None


ROWS = 1024  # query rows attended at a time


def _scores(st: LayerAqua, qh, kh, idx, scaling, softcap):
    """The approximate scores [B, Hkv, g, T, S] of the k selected coordinates (idx), scaled, soft-capped."""
    scores = approx_scores(qh, kh, st.k, st.selection, st.key_rms, idx=idx) * scaling
    if softcap:  # Gemma 2: tanh soft-capping of the scores, before the mask
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _visible(layer, attention_mask, b: int, hkv: int, tq: int, s: int, device):
    """(allowed [B, Hkv, Tq, S]: which slots each query row sees, is_real [B, Tq]: which new tokens are not padding)."""
    if attention_mask is not None:
        ok = (attention_mask == 0)[:, 0]  # [B, Tq, S_logical]
    else:
        ok = torch.ones(tq, s, dtype=torch.bool, device=device).tril(s - tq).expand(b, tq, s)
    new_ok = ok[..., -tq:]  # the chunk's own keys: causal + padding
    is_real = torch.diagonal(new_ok, dim1=-2, dim2=-1)  # [B, Tq] token is not padding
    if layer is None:
        return ok[:, None].expand(b, hkv, tq, s), is_real
    past = s - tq
    layer.valid[:, :, past:] &= is_real[:, None, :]
    # a cached slot is visible if it is live (not padding, not evicted) and the mask allows its token
    # (a sliding window, say); slots hold tokens pos[...] of the logical sequence the mask is laid over
    slot_tok = layer.pos[:, :, None, :past].expand(b, hkv, tq, past)
    ok_past = torch.gather(ok[:, None, :, : ok.shape[-1] - tq].expand(b, hkv, tq, -1), 3, slot_tok)
    return torch.cat([layer.valid[:, :, None, :past].expand(b, hkv, tq, past) & ok_past,
                      new_ok[:, None].expand(b, hkv, tq, tq)], dim=-1), is_real


def _attend(st: LayerAqua, qh, kh, v, idx, allowed, scaling, softcap, position0: int, call=None):
    """Softmax attention of the rows qh [B, Hkv, g, R, r] (at sequence positions position0..) -> [B, Hkv, g, R, rv]:
    over the approximate scores, or with token selection over the chosen pages' exact scores; call: the forward's
    (first position, end, is_real [B, Tq]), which sparse prefill's choice reads."""
    if st.prefill is not None and call is not None:
        allowed = _prefill_allowed(st, qh, kh, allowed, scaling, softcap, position0, call)
    mean_mass = None
    rows = _selecting_rows(st.tokens, position0, qh.shape[3]) if st.tokens is not None else None
    if rows is not None and not rows.any() and st.probe is None:
        scores = _exact_scores(qh, kh, scaling, softcap)  # a prompt's rows: nothing approximate to compute
    else:  # (a probe sees every forward's selection, as the graph computes it)
        scores = _scores(st, qh, kh, idx, scaling, softcap)
        if rows is not None:
            scores, allowed, mean_mass = _select_tokens(st, qh, kh, scores, allowed, scaling, softcap, position0)
    if mean_mass is not None:
        return _mean_corrected(scores, allowed, v, *mean_mass)
    neg = torch.finfo(scores.dtype).min
    w = torch.softmax(scores.masked_fill(~allowed[:, :, None], neg), dim=-1, dtype=torch.float32)
    return w.to(v.dtype) @ v[:, :, None]


def _prefill_allowed(st: LayerAqua, qh, kh, allowed, scaling, softcap, position0: int, call) -> torch.Tensor:
    """allowed [B, Hkv, R, S] with sparse prefill's unkept key blocks hidden from the rows of sparse query blocks
    (ops.rules.prefill_chosen, the estimate as the node makes it)."""
    threshold, stride, k_ratio, _ = st.prefill
    start, end, is_real = call
    rows = qh.shape[3]
    positions = torch.arange(position0, position0 + rows)
    if not bool(rules.prefill_rows(positions, start, end).any()):
        return allowed
    rule = "weighted" if st.selection.endswith("weighted") else "magnitude"
    est = approx_scores(qh, kh, rules.estimate_k(st.r, k_ratio), rule, st.key_rms).double() * scaling
    if softcap:
        est = torch.tanh(est / softcap) * softcap
    real = is_real[:, position0 - start:position0 - start + rows]
    own, margin, before = rules.prefill_choice(est, allowed, real, positions, start, end, threshold, stride)
    return own if st.probe is None else st.probe.blocks(st, positions, allowed, own, margin, before)


def _selecting_rows(tk: TokenSelection, position0: int, tq: int) -> torch.Tensor:
    """[tq] bool: which of the rows at positions position0.. select tokens (TokenSelection.rows_from)."""
    positions = torch.arange(position0, position0 + tq)
    return positions >= tk.rows_from if tk.rows_from is not None else torch.full_like(positions, tq == 1, dtype=bool)


def _exact_scores(qh, kh, scaling, softcap):
    """Every coordinate's scores [B, Hkv, g, Tq, S], soft-capped as the model's."""
    exact = (qh @ kh[:, :, None].transpose(-1, -2)) * scaling
    return torch.tanh(exact / softcap) * softcap if softcap else exact


def _select_tokens(st: LayerAqua, qh, kh, scores, allowed, scaling, softcap, position0: int):
    """Token selection (ops.rules) on the rows that select: (exact scores [B, Hkv, g, Tq, S] (all r coordinates),
    allowed [B, Hkv, Tq, S] with those rows' unchosen pages hidden, the mean-value correction's inputs or None).
    Rows that do not select (a prompt's, as in the graph) attend every visible token exactly."""
    tk = st.tokens
    b, hkv, g, tq, s = scores.shape
    exact = _exact_scores(qh, kh, scaling, softcap)
    positions = torch.arange(position0, position0 + tq, device=qh.device)
    rows = _selecting_rows(tk, position0, tq)
    if not rows.any():
        return exact, allowed, None
    vis = allowed[:, :1, rows]  # [B, 1, R, S]: every KV head sees the same tokens (nothing is evicted)
    score = rules.page_scores(scores[:, :, :, rows].transpose(2, 3), vis)  # [B, Hkv, R, P]
    forced = rules.forced_pages(vis, tk.sink, tk.window).expand(score.shape)
    attended = rules.tokens_attended(vis, tk.ratio, tk.budget).expand(score.shape[:-1])
    pages = rules.select_pages(score, forced, attended)
    if st.probe is not None:
        pages = st.probe.pages(st, positions[rows], score, forced, attended, pages)
    chosen = allowed.clone()
    chosen[:, :, rows] = allowed[:, :, rows] & rules.page_tokens(pages, vis)
    mass = None
    if tk.mean_value:  # the approximate softmax mass of the chosen tokens, on the selecting rows
        p = torch.softmax(scores.masked_fill(~allowed[:, :, None], torch.finfo(scores.dtype).min), -1)
        a = (p * chosen[:, :, None]).sum(-1, keepdim=True)  # [B, Hkv, g, Tq, 1]
        mass = (torch.where(rows[:, None], a, torch.ones_like(a)), allowed)
    return exact, chosen, mass


def _mean_corrected(scores, allowed, v, mass, visible):
    """SparQ's correction: a softmax(chosen) @ V + (1 - a) mean over the visible tokens of V."""
    neg = torch.finfo(scores.dtype).min
    w = torch.softmax(scores.masked_fill(~allowed[:, :, None], neg), dim=-1, dtype=torch.float32)
    attn = w.to(v.dtype) @ v[:, :, None]
    vis = visible[:, :, None].to(v.dtype)  # [B, Hkv, 1, Tq, S]
    mean = (vis @ v[:, :, None]) / vis.sum(-1, keepdim=True).clamp_min(1)
    return mass.to(v.dtype) * attn + (1 - mass.to(v.dtype)) * mean


def _h2o_attend(st: LayerAqua, layer: AquaLayerCache | None, scores, allowed, is_real, v):
    """Token-by-token attention with H2O eviction. scores [B, Hkv, g, Tq, S], allowed [B, Hkv, Tq, S]."""
    b, hkv, g, tq, s = scores.shape
    dev = scores.device
    if layer is not None:
        acc, n_real = layer.acc.clone(), layer.n_real.clone()
    else:
        acc = torch.zeros(b, hkv, s, device=dev)
        n_real = torch.zeros(b, dtype=torch.int64, device=dev)
    keep = torch.ones(b, hkv, s, dtype=torch.bool, device=dev)
    neg = torch.finfo(scores.dtype).min
    outs = []
    for t in range(tq):
        vis = allowed[:, :, t] & keep
        w = torch.softmax(scores[:, :, :, t].masked_fill(~vis[:, :, None], neg), dim=-1, dtype=torch.float32)
        outs.append(w.to(v.dtype) @ v)  # [B, Hkv, g, r]
        real = is_real[:, t]
        acc = acc + w.sum(2) * real[:, None, None]
        n_real = n_real + real.to(torch.int64)
        budget = h2o_budget(st.h2o_ratio, n_real)
        kept = h2o_keep(vis, acc, budget) | ~allowed[:, :, t]
        if st.probe is not None and layer is not None:
            kept = st.probe.evict(st, layer, layer.seen + t - tq, vis, acc, budget, kept, ~allowed[:, :, t], real)
        keep = torch.where(real[:, None, None], keep & kept, keep)
    if layer is not None:
        layer.valid &= keep
        layer.acc = acc
        layer.n_real = n_real
        layer.compact()
    return torch.stack(outs, dim=3)


# --------------------------------------------------------------------------------------------
# Applying AQUA to a model
# --------------------------------------------------------------------------------------------

def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(IMPL, aqua_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPL, eager_mask)


def layer_states(model, projection: Projection, config: AquaConfig, widths: tuple | None = None,
                 value_widths: tuple | None = None, probe: Probe | None = None,
                 tokens: TokenSelection | None = None, selected: tuple | None = None,
                 prices: tuple | None = None, prefill_rows_from: int | None = None) -> list[LayerAqua]:
    """One LayerAqua per layer; widths / value_widths: K^'s and V's width per layer (default: config's allocation,
    allocate.layer_widths; value_widths alone defaults to widths); tokens: token selection (config's, or None);
    selected: k per layer (default: config's k allocation over the widths, allocate.layer_selected); prices: per
    layer the heads' prices or None (default: config's, allocate.head_prices; with ``selected`` given, none);
    prefill_rows_from: sparse prefill's (LayerAqua.prefill)."""
    geo = attention_geometry(model)
    d = geo["head_dim"]
    if widths is None:
        widths, value_widths = layer_widths(config, projection, geo["layers"], d)
    if selected is None:
        selected = layer_selected(config, projection, widths)
        prices = head_prices(config, projection) if prices is None else prices
    states = []
    for i, (r, k) in enumerate(zip(widths, selected, strict=True)):
        rv = None if value_widths is None else value_widths[i]
        vw = r if rv is None else rv
        states.append(LayerAqua(
            P_r=projection.P[i][:, :, :r].contiguous(), r=r, k=k, d=d, selection=config.selection,
            key_rms=projection.key_rms[i][:, :r].contiguous(), h2o_ratio=config.h2o_ratio, rv=rv, index=i,
            P_v_r=projection.P_v[i][:, :, :vw].contiguous() if vw < d else None,
            tokens=tokens, probe=probe, prices=None if prices is None or k >= r else prices[i],
            prefill=(config.prefill_threshold, config.prefill_stride, config.prefill_k_ratio, prefill_rows_from)
            if config.sparse_prefill else None,
        ))
    return states


class AquaSession:
    """What ``apply_aqua`` yields: the states, and a cache factory for generation."""

    def __init__(self, model, config: AquaConfig, states: list[LayerAqua]):
        self.model, self.config, self.states = model, config, states

    def new_cache(self) -> AquaCache:
        return AquaCache(self.states)

    def generate(self, **kwargs):
        """model.generate with an AquaCache (needed for H2O eviction and the narrow Memory cache)."""
        kwargs.setdefault(cache_keyword(self.model), self.new_cache())
        return self.model.generate(**kwargs)


@contextlib.contextmanager
def apply_aqua(model, projection: Projection, config: AquaConfig, widths: tuple | None = None,
               value_widths: tuple | None = None, probe: Probe | None = None, token_rows_from: int | None = None,
               mean_value: bool = False, selected: tuple | None = None, prices: tuple | None = None):
    """Run ``model`` with AQUA attention inside the block; the model is restored exactly on exit. widths: the
    cached width of each layer's K^ and V (default: config's allocation, allocate.layer_widths); probe: an
    instrument that sees (and may replace) each selection and eviction (Probe). With token selection:
    token_rows_from, the rows at sequence positions >= it select (0: every row, as if each were decoded: what
    perplexity measures; None: one-token forwards only, as the graph) and, under sparse prefill, a forward's rows
    from there on are not its prompt (the runtime decoded them); mean_value: TokenSelection's; selected: k
    per layer (default: config's k allocation, allocate.layer_selected); prices: per layer the heads' prices
    (layer_states')."""
    arch = architecture_of(model.config)
    projection.check_model(model)
    arch.check_settings(model.config, config)
    _register()
    tokens = TokenSelection(config.token_ratio, config.token_budget, config.token_sink, config.token_window,
                            token_rows_from, mean_value) if config.selects_tokens else None
    states = layer_states(model, projection, config, widths, value_widths, probe, tokens, selected, prices,
                          token_rows_from)
    previous = model.config._attn_implementation
    attns = [arch.attention(layer) for layer in arch.layers(model)]
    try:
        for a, st in zip(attns, states):
            a._aqua = st
        model.set_attn_implementation(IMPL)
        yield AquaSession(model, config, states)
    finally:
        model.set_attn_implementation(previous)
        for a in attns:
            if hasattr(a, "_aqua"):
                del a._aqua
