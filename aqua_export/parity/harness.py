"""Parity: ONNX Runtime vs the PyTorch reference (same AQUA settings), and ORT at k = r vs HF transformers.

Protocol: a real prompt (the first ``prompt_tokens`` tokens of builtin:gpl-3), prefill, then ``steps`` greedy
decode steps chosen by ORT running the folder's graph. Every other run (ORT's variants of the graph, the
reference, HF) is fed the same tokens, so every comparison is between logits of the same context.

Why a shared selection: top-k over |q^| is discontinuous. Two float32 implementations (ORT's MLAS,
PyTorch's kernels) accumulate in different orders, so where the k-th and (k+1)-th magnitudes of a
row are equal to within rounding, they may keep different coordinates, and that row's scores then
differ by a whole q_i k_i term. So parity is checked in two parts:
  1. values: the reference run with ORT's selected indices (read from the TopK outputs of an inlined
     copy of the graph) must match ORT's logits;
  2. selection: every row where the reference's own choice differs from ORT's must be a float
     near-tie (relative gap between the k-th and (k+1)-th |q^|).
The unforced comparison (each side with its own selection) is reported too.

Bounds from the noise they measure: a float32 run is compared with the float64 forward of the same model on the
same tokens (precision.computing_in), and the bound is max(floor, 10 x the float32 reference's own error on those
forwards). Two correct float32 implementations differ by their rounding, which depends on the instruction set the
CPU's kernels use (AVX-512 or not) and on how much the model amplifies it (the embedded model at k = 1: ~40x its
dense error), so a fixed bound at float32's error passes on one machine and fails on the next. ONNX Runtime's own
error is not the reference's: measured against float64 it was 0.4x-2.3x the reference's over the builds here (2.3x
through MatMulNBits' blockwise sums), and 5.8x at k = 1 with PyTorch and MKL held to SSE4.2 (make test's second
run), where the reference's own error fell to 2.6e-3 while ONNX Runtime's stayed at 1.5e-2 (1.1e-2 and 1.6e-2 on
the other instruction-set mixes): one forward's error estimates the noise only to a few times, hence 10x. The near-tie bounds are set the same way from the boundary scores'
relative error (parity_probe). float16 builds are compared with the float32 reference under fixed allowances for
float16's own rounding (TOLERANCE).

A float16 or int8 cache under a float32 graph (contract cache_dtype) rounds each new K^ and V as it is written, which
the reference does not: every gate above runs the graph with its cache float32 (rewrites.float32_cache), and the
folder's own run is compared with that one (top-1 gated at gates.cache_gate's bar, the logit differences reported:
what the cache's rounding costs). The kernels' narrow-cache paths are checked against float64 by the op catalogue.

What each mechanism that chooses at run time adds (its recorded choice, its gate, the prompt that exercises it) is its
settings.base.Probe: this module asks `probes(config)`, never a mechanism by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from .. import corpus, settings
from ..config import AquaConfig, ConfigError
from ..export.rewrites import (all_logits, float32_cache, float32_weight_casts, float_activations, graph_variant,
                               selection_outputs, set_k)
from ..meter import stage_bar
from ..models import cache_keyword
from ..projection import Projection
from ..reference.attention import apply_aqua
from ..reference.exported_weights import ExportedWeights
from ..reference.precision import computing_in
from ..runtime.folder import FolderConfig
from ..runtime.lm import OrtLM
from ..runtime.session import make_session
from ..settings.base import LIVE
from .gates import GATES, TOLERANCE, cache_gate, compare, eviction_agreement, gate, top1_gate
from .probe import NOISE_FACTOR, ReplayProbe, RuntimeRecorder

PARITY_TEXT = "builtin:gpl-3"
PROMPT_TOKENS = 256  # the parity prompt's length unless asked (the build's --parity-prompt-tokens)
PARITY_STEPS = 64  # greedy decode steps unless asked


# --------------------------------------------------------------------------------------------
# Traces: logits per forward ([T, V] at prefill, [1, V] per step) on a prompt and fed tokens
# --------------------------------------------------------------------------------------------

def ort_trace(lm, ids: np.ndarray, steps: int, tokens=None):
    """Logits per forward and the tokens chosen (or fed: ``tokens``); what lm's probe recorded, it holds."""
    mask = np.ones_like(ids)
    past = lm.empty_past(1)
    bar = stage_bar(steps + 1, "ORT forwards", "fwd")
    logits, past = lm.step(ids, mask, past)  # every prompt position (the sessions compute all rows: _ort_phase)
    bar.update(1)
    trace, toks = [logits[0]], []
    for s in range(steps):
        t = int(logits[0, -1].argmax()) if tokens is None else int(tokens[s])
        toks.append(t)
        mask = np.concatenate([mask, [[1]]], axis=1)
        logits, past = lm.step(np.array([[t]]), mask, past)
        trace.append(logits[0])
        bar.update(1)
    bar.close()
    return trace, toks


def torch_trace(model, ids: np.ndarray, toks: list[int], cache, probe: ReplayProbe | None = None):
    """The reference's logits at the positions of an ORT trace on the same prompt and fed tokens, from one forward
    over all of them: attention is causal, so position t sees what it sees decoding step by step (an H2O forward
    evicts token by token as decoding does), and one forward costs one pass over the weights, not one per step."""
    n = ids.shape[1]
    full = torch.from_numpy(np.concatenate([ids[0], np.asarray(toks, np.int64)]))[None]
    if probe is not None:
        probe.next_forward()
    bar = stage_bar(1, "PyTorch forward", "fwd")
    with torch.no_grad():
        logits = model(input_ids=full, use_cache=cache is not None, **{cache_keyword(model): cache}).logits[0].double()
    logits = logits.numpy()
    bar.close()
    return [logits[:n]] + [logits[n + s - 1:n + s] for s in range(1, len(toks) + 1)]


def probes(config: AquaConfig) -> list:
    """The Probes (settings.base.Probe) of the mechanisms this config turns on, in MECHANISMS' order."""
    return [m.probe for m in settings.MECHANISMS if m.probe and m.on(config)]


def _split_selections(extra: list, names: list) -> dict:
    """A debug run's extra outputs per forward (rewrites.selection_outputs: every inlined TopK's indices, in layer
    order) -> {"coordinates": per forward and layer the coordinates' indices, and each Probe's gate: per forward and
    layer its recorded choice (the output named by its source: the pages' order, sparse prefill's kept keys)}."""
    owner = {m.probe.source: m.probe.gate for m in settings.MECHANISMS if m.probe and m.probe.source != LIVE}
    kind = [owner.get(n.split("__")[0], "coordinates") for n in names]  # the inliner suffixes a call's names: __<i>
    return {want: [[x for x, k in zip(f, kind) if k == want] for f in extra]
            for want in ("coordinates", *owner.values())}


def _joined(selections: list) -> list:
    """ORT's TopK indices per forward (prefill, then each step), per layer [B, Hkv, g, T_f, k] -> one forward's
    per layer, the steps' rows after the prefill's (what the reference's one forward selects)."""
    return [[np.concatenate(per, axis=3) for per in zip(*selections)]]


# --------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OrtRun:
    """One ONNX Runtime run of parity, as the README's parity lines name it: its key in the runs, its progress line,
    whether it runs, the kernel, the graph's rewrites (export.rewrites) beyond the ones every run has, and what it
    records from its trace (trace, lm, recorder -> the value under key; the lm is open while it records)."""

    key: str
    says: str
    on: bool
    kernel: str
    rewrites: tuple = ()
    record: object = lambda trace, lm, rec: trace[0]
    recorder: bool = False  # a RuntimeRecorder as its probe (the selections, H2O's evictions)
    own_cache: bool = False  # the folder's own cache type; the others cache float32 (a narrow cache's gated runs)
    lm_cfg: FolderConfig | None = None  # the folder config the run's OrtLM reads (_ort_runs fills it)
    tag: str = ""  # the rewritten graph's file tag, when not key


def _ort_runs(cfg: FolderConfig, config: AquaConfig, kernel: str, sparse: bool, gated: tuple) -> list[OrtRun]:
    """Parity's ONNX Runtime runs, in order; all but the first are fed the first's tokens."""
    chooses = probes(config)
    live = any(p.source == LIVE for p in chooses)
    exposed = sparse or bool(chooses)

    def selections(trace, lm, rec):
        # per forward and layer the coordinates' TopK indices [B, Hkv, g, T, k] and each probe's recorded choice (the
        # pages' order [B, Hkv, 1, T, P], the kept keys [B, Hkv, T, L]); per token and layer the live tokens
        chosen = _split_selections(rec.extra, lm.output_names[lm.n_outputs:])
        return {"trace": trace[0], "coordinates": chosen["coordinates"] if sparse else None,
                **{p.gate: rec.live if p.source == LIVE else chosen[p.gate] for p in chooses}}

    wide_cfg = dataclasses.replace(cfg, contract=dataclasses.replace(cfg.contract, cache_dtype=cfg.contract.dtype))
    # the run at k = r: set_k neutralizes every mechanism that declares neutral attributes, and the loop runs them off
    # (an H2O cache of every token)
    off = {s.name: s.default for m in settings.MECHANISMS if m.neutral for s in m.settings}
    no_aqua = dataclasses.replace(wide_cfg, aqua=dataclasses.replace(cfg.aqua, **off))
    runs = [
        OrtRun("main", "the folder's graph", True, kernel, record=lambda trace, lm, rec: trace, own_cache=True,
               lm_cfg=cfg),
        OrtRun("cache", "the folder's graph with its cache float32", cfg.contract.narrow_cache, kernel,
               record=lambda trace, lm, rec: trace),
        OrtRun("debug", "the graph with its selections exposed", exposed, "function", (*gated, selection_outputs),
               record=selections, recorder=True, tag="selection"),
        # the native kernel against the graph's own portable function body; a quantized folder's values are gated on
        # this run's float32 activations (the selections' run is that run where it happens)
        OrtRun("debug", "the function body" + (" with float32 activations" if gated else ""),
               not exposed and (kernel == "native" or bool(gated)), "function", gated,
               record=lambda trace, lm, rec: {"trace": trace[0]}, tag="function"),
        OrtRun("native", "the native kernel", kernel == "native", "native", gated, recorder=True,
               record=lambda trace, lm, rec: (trace[0], rec.live if live else None)),
        # slice 0: every layer is d wide, so one k = r fits all nodes
        OrtRun("k_eq_r", "the graph with k = r", not config.is_dense and config.slice_ratio == 0, "auto",
               (*gated, set_k(cfg.contract.widths[0])), lm_cfg=no_aqua),
    ]
    return [r if r.lm_cfg else dataclasses.replace(r, lm_cfg=wide_cfg) for r in runs]


def _ort_phase(model_path: Path, cfg: FolderConfig, config: AquaConfig, ids, steps: int, kernel: str, sparse: bool,
               progress) -> dict:
    """Every ONNX Runtime run parity needs (_ort_runs), one session at a time (each freed before the next opens). A
    float16 folder with external weights runs with explicit weight casts (rewrites.float32_weight_casts), so the
    session holds the float16 weights only."""
    lean = cfg.dtype == "float16" and (model_path.parent / (model_path.name + ".data")).exists()
    # every run computes every position's logits (the prompt's are compared too): the folder's graph otherwise
    base = (all_logits,) + ((float32_weight_casts,) if lean else ())
    wide = (float32_cache(cfg.contract),) if cfg.contract.narrow_cache else ()  # a narrow cache's runs: float32
    # quantized folders: the gated runs keep activations float32 (the folder's own level is the main run's)
    gated = (float_activations,) if cfg.weights.quantized and cfg.weights.accuracy_level else ()
    runs: dict = {"float16_weights": "cast per node at run time" if lean else None}
    chooses = probes(config)
    live = any(p.source == LIVE for p in chooses)
    toks = None
    for run in _ort_runs(cfg, config, kernel, sparse, gated):
        if not run.on:
            continue
        progress("ONNX Runtime, " + run.says)
        rec = RuntimeRecorder(evictions=live) if run.recorder else None
        transforms = (*base, *(() if run.own_cache else wide), *run.rewrites)
        with graph_variant(model_path, run.tag or run.key, *transforms) as path:
            lm = OrtLM(make_session(path, kernel=run.kernel, lean=lean), run.lm_cfg, probe=rec, all_rows=True)
            try:
                trace = ort_trace(lm, ids, steps) if toks is None else ort_trace(lm, ids, steps, tokens=toks)
                runs[run.key] = run.record(trace, lm, rec)
            finally:
                lm.session = None  # the session (and its weights) goes now, whoever still holds lm
        toks = runs["main"][1]
    # the trace the values are gated on: the one whose selections are exposed, or the float32-activation one
    exposed = sparse or bool(chooses)
    runs["gated"] = runs["debug"]["trace"] if "debug" in runs and (exposed or gated) else \
        runs.get("cache", runs["main"])[0]
    return runs


def prompt_length(config: AquaConfig, requested: int, steps: int, context: int | None) -> int:
    """The parity prompt's length: ``requested``, lengthened (within the model's context, steps included) until every
    mechanism that chooses at run time is exercised by it (each Probe's prompt: token selection's first decode step
    leaves a page out, sparse prefill's query blocks choose between key blocks), else their gates fail as not
    exercised (ReplayProbe's summaries); check_run refuses up front what no prompt that fits can exercise."""
    limit = (context or 1 << 30) - steps
    n = requested
    while True:  # to a fixed point: each probe's length is at least its input's
        longer = n
        for p in probes(config):
            longer = p.prompt(config, longer, limit)
        if longer == n:
            return n
        n = longer


def parity_lengths(prompt: int | None, steps: int | None, context: int | None) -> tuple[int, int]:
    """(prompt tokens, decode steps) of a parity run: as asked, or by default PROMPT_TOKENS and PARITY_STEPS shortened
    to fit a model whose context is shorter (asked values that do not fit are refused: check_run)."""
    p = PROMPT_TOKENS if prompt is None else prompt
    s = PARITY_STEPS if steps is None else steps
    if context and p + s > context:
        if steps is None:
            s = max(1, min(s, context // 4))
        if prompt is None:
            p = max(16, context - s)
    return p, s


def check_run(config: AquaConfig, requested: int, steps: int, context: int | None) -> None:
    """One ConfigError line, before any work, when the parity run does not fit the model's context, or when no
    prompt that fits it lets token selection leave a page out (its budget, sink and window cover the whole context):
    parity could not test it."""
    if steps < 1 or requested < 16:
        raise ConfigError(f"parity needs a prompt of 16 or more tokens and 1 or more decode steps, not {requested} "
                          f"and {steps}")
    if context and requested + steps > context:
        raise ConfigError(f"a parity prompt of {requested} tokens and {steps} decode steps is past the model's context "
                          f"of {context} tokens: lower them (--parity-prompt-tokens, --parity-steps / --steps)")
    n = prompt_length(config, requested, steps, context)
    for p in probes(config):
        line = p.unexercised(config, n, context)
        if line:
            raise ConfigError(line)


def run_parity(model_path, cfg: FolderConfig, tok, projection: Projection, config: AquaConfig, reference, *,
               prompt_tokens: int = PROMPT_TOKENS, steps: int = 64, dtype: str = "float32", kernel: str = "function",
               progress=None) -> dict:
    """model_path: the folder's model.onnx (rewritten variants are saved beside it and opened by path);
    cfg: its FolderConfig; reference: the HF model it came from (unmodified), or a function loading it,
    called only after every ONNX Runtime session is closed, so one model is in memory at a time.
    kernel: what runs the attention nodes in the main session ("native" or "function")."""
    progress = progress or (lambda text: None)
    prompt_tokens = prompt_length(config, prompt_tokens, steps, cfg.context_length)
    ids = corpus.tokenize(tok, corpus.read_text(PARITY_TEXT), prompt_tokens).numpy()[None]
    tol = TOLERANCE[dtype]
    sparse = cfg.contract.selected != cfg.contract.widths
    res = {"prompt": PARITY_TEXT, "prompt_tokens": int(ids.shape[1]), "decode_steps": steps, "dtype": dtype,
           "kernel": kernel, "noise_factor": NOISE_FACTOR}
    runs = _ort_phase(Path(model_path), cfg, config, ids, steps, kernel, sparse, progress)
    if runs["float16_weights"]:
        res["float16_weights"] = ("cast to float32 per node at run time (the folder's graph with explicit weight "
                                  "casts, ONNX Runtime's own CPU arithmetic without its float32 weight copies)")
    progress("the PyTorch reference on the same tokens" + (", in float32 and float64" if dtype == "float32" else "")
             + (f", with the folder's {cfg.weights.name} weights" if cfg.weights.quantized else ""))
    model = reference() if callable(reference) and not isinstance(reference, torch.nn.Module) else reference
    weights = None
    if cfg.weights.quantized:
        weights = ExportedWeights(model, projection, config, cfg.contract, cfg.weights)
        _quantization_reports(res, runs, model, ids, projection, config, tol, cfg)
    _reference_phase(res, runs, model, ids, projection, config, tol, sparse, weights)
    _versus_hf(res, runs, model, ids, config, tol, weights)
    if "cache" in runs:
        moved = [p.cache_top1 for p in probes(config) if p.cache_top1]
        res["cache_rounding"] = cache_gate(runs["main"][0], runs["cache"][0], tol, cfg.contract.cache_dtype,
                                           min(moved) if moved else None)
    res["failed"] = [GATES[g] for g in GATES if g in res and not res[g].get("pass", True)]
    res["pass"] = not res["failed"]
    return res


def _reference_phase(res, runs, model, ids, projection, config, tol, sparse, weights=None) -> None:
    """The PyTorch side of every AQUA comparison, on the tokens the ONNX Runtime runs were fed (weights: a quantized
    folder's, exported_weights.ExportedWeights)."""
    ort_trace, toks = runs.get("cache", runs["main"])  # the export as the reference computes it (cache float32)
    chooses = probes(config)
    exact = tol["near_tie"] is not None  # float32 builds: float64 runs measure float32's own error

    def trace(dtype, probe=None):  # token selection on the fed tokens' rows, as the graph's decode steps
        with apply_aqua(model, projection, config, probe=probe, token_rows_from=ids.shape[1]) as aqua, \
                computing_in(model, dtype, weights):
            return torch_trace(model, ids, toks, aqua.new_cache(), probe)

    own = trace(torch.float32)
    res["ort_vs_reference_unforced"] = compare(ort_trace, own, tol["aqua"], tol.get("logit_tie"))
    if sparse or chooses:
        dbg = runs["debug"]
        sel = _joined(dbg["coordinates"]) if dbg["coordinates"] is not None else None
        probes_ = [ReplayProbe(sel, prompt=ids.shape[1], **{p.gate: dbg[p.gate] for p in chooses}) for _ in range(2)]
        ref32 = trace(torch.float32, probes_[0])
        ref64 = trace(torch.float64, probes_[1]) if exact else None
        p32, p64 = probes_[0], probes_[1] if exact else None
        res["ort_vs_reference"] = gate(dbg["trace"], ref32, ref64, tol["aqua"], tol)
        res["selection"] = p32.selection_summary(p64, tol["near_tie"]) if sparse else \
            {"skipped": "k = r: nothing is selected"}
        for p in chooses:
            res[p.gate] = getattr(p32, p.gate + "_summary")(p64, tol["near_tie"])
    else:
        res["ort_vs_reference"] = gate(runs["gated"], own, trace(torch.float64) if exact else None, tol["aqua"], tol)
        res["selection"] = {"skipped": "k = r: nothing is selected"}
    for choice in ("selection", *(p.gate for p in chooses)):  # float16: top-1 agreement, each side choosing alone
        if res.get(choice, {}).get("gated") is False:
            res[choice]["pass"] = res["ort_vs_reference_unforced"]["top1_agreement_beyond_ties"] >= tol["top1"] and \
                res[choice].get("pages_dropped", 1) > 0
    if "native" in runs:
        native, native_log = runs["native"]
        # each side selects on its own here (the native kernel takes no forced indices): their score sums round
        # differently, later layers' q^ differ in the last bits, and a near-tie row can flip
        nf = top1_gate(native, runs["debug"]["trace"], tol)
        # reported: a near-tie of two heavy sums can flip, and the logits gate above judges the outcome
        for p in chooses:
            if p.source == LIVE:
                nf[p.gate] = eviction_agreement(native_log, runs["debug"][p.gate])
        res["native_vs_function_body"] = nf


def _versus_hf(res: dict, runs: dict, model, ids, config: AquaConfig, tol: dict, weights=None) -> None:
    """The folder's graph (a dense build) or its k = r variant against HF transformers, no AQUA at all (with a
    quantized folder's weights: HF's model on the same dequantized weights)."""
    trace = runs["gated"] if config.is_dense else runs.get("k_eq_r")
    if trace is None:
        res["ort_k1_vs_hf"] = {"skipped": "slice_ratio > 0 changes the model itself; HF comparison needs slice 0"}
        return
    toks = runs["main"][1]
    with computing_in(model, torch.float32, weights):
        hf32 = torch_trace(model, ids, toks, None)
    hf64 = None
    if tol["near_tie"] is not None:
        with computing_in(model, torch.float64, weights):
            hf64 = torch_trace(model, ids, toks, None)
    res["ort_k1_vs_hf"] = gate(trace, hf32, hf64, tol["dense_vs_hf"] if config.is_dense else tol["aqua"], tol)
    # set_k's neutral attributes: each mechanism named as its summary names it (AQUA-H2O, token selection, ...)
    off = [m.summary.split(":")[0] for m in settings.MECHANISMS if m.neutral and m.on(config)]
    res["ort_k1_vs_hf"]["graph"] = "the folder's graph" if config.is_dense else \
        "this folder's graph with k set to r (calibrated P kept)" + (f", {' / '.join(off)} off" if off else "")


def _quantization_reports(res, runs, model, ids, projection, config, tol, cfg) -> None:
    """What the weight format changes, reported beside the gates on the export (they test the export, not the
    quantizer): the folder as it runs (its accuracy level's int8 activations, ONNX Runtime's kernel choice) against
    the same graph with float32 activations, and against the reference on the unquantized weights."""
    main, toks = runs.get("cache", runs["main"])
    keep = ("max_abs_logit_diff_prefill", "max_abs_logit_diff_decode", "top1_agreement")
    if cfg.weights.accuracy_level:
        res["activation_accuracy"] = {k: v for k, v in compare(main, runs["gated"], tol["aqua"], None).items()
                                      if k in keep}
    with apply_aqua(model, projection, config, token_rows_from=ids.shape[1]) as aqua, \
            computing_in(model, torch.float32):
        unquantized = torch_trace(model, ids, toks, aqua.new_cache())
    res["vs_float_weights"] = {k: v for k, v in compare(main, unquantized, tol["aqua"], None).items() if k in keep}


