"""Arithmetic in one float type over weights kept in the checkpoint's own dtype (bfloat16 / float16 / float32).

A bfloat16 checkpoint loaded as float32 doubles its memory; kept as bfloat16 it computes in bfloat16,
which is imprecise and, on CPUs without bfloat16 instructions, slow. ``computing_in(model, dtype)`` keeps
the weights as they are and gives each decoder layer copies of its own weights in ``dtype`` only while that
layer runs, so memory holds the checkpoint plus one layer in ``dtype``. bfloat16 -> float32 -> float64 are
exact, so calibration and the reference compute exactly what a load in that type would.

    float32_compute(model)               calibration, the parity reference, slice costs
    computing_in(model, torch.float64)   parity's exact answer: float32's own rounding error is measured
                                         against it, and every gate's bound is set above that error
"""

from __future__ import annotations

import contextlib

import torch

from ..models import architecture_of

# vocabulary rows of the output layer computed at a time in a wider type than the weights are stored in: a
# whole float64 copy of Llama-3.1-8B's head would be 4 GiB, a chunk is a few MiB
HEAD_ROWS = 8192


def storage_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _widen_during_forward(mod, dtype: torch.dtype, handles: list, after=None) -> None:
    """mod's parameters are ``dtype`` copies while it runs, put back after (pre/post forward hooks); after(mod), when
    given, then edits those copies (never the model's own tensors)."""
    def widen(m, args):
        m._aqua_stash = [(p, p.data) for p in m.parameters()]
        for p, data in m._aqua_stash:
            p.data = data.to(dtype, copy=after is not None)
        if after is not None:
            after(m)

    def restore(m, args, out):
        for p, data in m._aqua_stash:
            p.data = data
        del m._aqua_stash

    handles += [mod.register_forward_pre_hook(widen), mod.register_forward_hook(restore)]


def _chunked_head(head, dtype: torch.dtype, weights=None):
    """A forward for the output layer in ``dtype`` that widens HEAD_ROWS vocabulary rows of its weight at a time
    (weights: those rows as a quantized folder computes with them)."""
    def forward(x):
        w, b = head.weight, head.bias
        parts = []
        for v0 in range(0, w.shape[0], HEAD_ROWS):
            rows = slice(v0, v0 + HEAD_ROWS)
            y = x.to(dtype) @ (w[rows] if weights is None else weights.rows(w, rows)).to(dtype).T
            parts.append(y if b is None else y + b[rows].to(dtype))
        return torch.cat(parts, -1)

    return forward


def _embedding_rows(emb, dtype: torch.dtype, weights):
    """A forward for the embedding that looks up rows as a quantized folder computes with them, in ``dtype`` (with
    Gemma's scale, which the export also applies after the lookup)."""
    def forward(ids):
        out = weights.rows(emb.weight, ids).to(dtype)
        scale = getattr(emb, "embed_scale", None)
        return out if scale is None else out * torch.as_tensor(scale).to(dtype)

    return forward


@contextlib.contextmanager
def computing_in(model, dtype: torch.dtype, weights=None):
    """Inside the block ``model`` computes in ``dtype`` (embeddings' output cast, each decoder layer and the final
    norm widened while they run, the output layer by chunks of its vocabulary). Nothing is changed when the
    weights are already stored in ``dtype`` and no ``weights`` are given. weights (exported_weights.ExportedWeights):
    the linear layers, experts, output layer and embedding compute with the weights a quantized folder holds.
    Undone on exit."""
    if storage_dtype(model) == dtype and weights is None:
        yield model
        return

    arch = architecture_of(model.config)
    handles: list = []
    emb, wpe = arch.embeddings(model), arch.position_embeddings(model)
    if weights is not None:
        emb.forward = _embedding_rows(emb, dtype, weights)
    for e in (emb, wpe):
        if e is not None:
            handles.append(e.register_forward_hook(lambda mod, args, out: out.to(dtype)))

    def exported(i):  # the layer's weights as the folder holds them, written into its widened copies
        return lambda m: weights.write_layer(i, m)

    for i, mod in enumerate(arch.layers(model)):
        _widen_during_forward(mod, dtype, handles, None if weights is None else exported(i))
    _widen_during_forward(arch.final_norm_module(model), dtype, handles)
    head = model.get_output_embeddings()
    head.forward = _chunked_head(head, dtype, weights)  # an instance attribute over the class's forward, deleted on exit
    experts = getattr(model.config, "_experts_implementation", None)
    if dtype == torch.float64 and experts not in (None, "eager"):
        model.set_experts_implementation("eager")  # torch's grouped GEMM (MoE experts) takes no float64
    try:
        yield model
    finally:
        if dtype == torch.float64 and experts not in (None, "eager"):
            model.set_experts_implementation(experts)
        del head.forward
        if weights is not None:
            del emb.forward
        for h in handles:
            h.remove()


def float32_compute(model):
    """computing_in(model, torch.float32): a float32 model is left alone."""
    return computing_in(model, torch.float32)
