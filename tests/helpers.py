"""Shared test helpers: calibrate a tiny model on random tokens, left-padded batches."""

import torch

from aqua_export import calibrate


def tiny_projection(model, tmp_path, seed: int = 0, n: int = 3, t: int = 48):
    from aqua_export.models import attention_geometry, fingerprint
    import json

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, t), generator=g)
    geo = attention_geometry(model)
    mom = calibrate.Moments.zeros(geo["layers"], geo["kv_heads"], geo["head_dim"])
    with torch.no_grad(), calibrate.recording(model, mom):
        model(input_ids=ids, use_cache=False)
    meta = {"format_version": calibrate.FORMAT_VERSION, "fingerprint": json.dumps(fingerprint(model), sort_keys=True)}
    path = tmp_path / f"tiny-{seed}.safetensors"
    calibrate.write(path, calibrate.projection_tensors(mom), meta)
    return calibrate.load_projection(path)


def left_padded(vocab: int, lengths, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, n - length:] = torch.randint(3, vocab, (length,), generator=g)
        mask[i, n - length:] = 1
    return ids, mask


def folder_cfg(model, config, dtype: str = "float32"):
    """The FolderConfig a build would write for ``model`` exported with ``config`` in a test."""
    from aqua_export.export import contract_for
    from aqua_export.folder import FolderConfig, Geometry
    from aqua_export.models import attention_geometry

    return FolderConfig(model="test", aqua=config, geometry=Geometry(**attention_geometry(model)),
                        contract=contract_for(model, config, {"float32": torch.float32, "float16": torch.float16}[dtype]))


def saved_checkpoint(folder, model_type: str = "llama", dtype=None, **kw):
    """A tiny random checkpoint saved like a real one (save_pretrained) with the embedded SmolLM2 tokenizer,
    so every --model code path (local folder, AutoTokenizer, dtype on disk) runs on it."""
    from transformers import AutoTokenizer

    from aqua_export import models

    tok = AutoTokenizer.from_pretrained(models.resolve("llama")[0])
    m = models.tiny_model(model_type, vocab=len(tok), **kw)
    if dtype is not None:
        m = m.to(dtype)
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
