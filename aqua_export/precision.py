"""Float32 arithmetic over weights kept in the checkpoint's own dtype (bfloat16 / float16).

A bfloat16 checkpoint loaded as float32 doubles its memory; kept as bfloat16 it computes in bfloat16,
which is imprecise and, on CPUs without bfloat16 instructions, slow. ``float32_compute(model)`` keeps
the weights as they are and gives each decoder layer float32 copies of its own weights only while that
layer runs, so memory holds the checkpoint plus one layer in float32. bfloat16 -> float32 is exact, so
calibration and the reference compute exactly what a float32 load would.
"""

from __future__ import annotations

import contextlib

import torch


def storage_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


@contextlib.contextmanager
def float32_compute(model):
    """Inside the block ``model`` computes in float32 (embeddings' output cast up, each decoder layer, the
    final norm and the LM head upcast while they run). A float32 model is left alone. Undone on exit."""
    if storage_dtype(model) == torch.float32:
        yield model
        return
    handles = []

    def upcast(mod, args, kwargs=None):
        mod._aqua_stash = [(p, p.data) for p in mod.parameters()]
        for p, data in mod._aqua_stash:
            p.data = data.to(torch.float32)

    def restore(mod, args, out):
        for p, data in mod._aqua_stash:
            p.data = data
        del mod._aqua_stash

    from .models import architecture_of

    arch = architecture_of(model.config)
    for emb in (arch.embeddings(model), arch.position_embeddings(model)):
        if emb is not None:
            handles.append(emb.register_forward_hook(lambda mod, args, out: out.to(torch.float32)))
    for mod in [*arch.layers(model), arch.final_norm_module(model), model.get_output_embeddings()]:
        handles.append(mod.register_forward_pre_hook(upcast))
        handles.append(mod.register_forward_hook(restore))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
