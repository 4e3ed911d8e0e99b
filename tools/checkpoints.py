"""Random-weight checkpoints of real model shapes, made in code (no hub): what tools/scale.py and tools/serving.py
build and serve. Written tensor by tensor (a meta-device model gives the names and shapes; no model is ever
materialised), bfloat16 in safetensors shards of at most 2 GB, with the embedded SmolLM2 tokenizer; MoE experts one
matrix each, as the released checkpoints store them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# name: (HF architecture, its config).  Llama's vocabulary is SmolLM2's unless the model's own is the point.
_LLAMA = dict(bos_token_id=1, eos_token_id=2)
SHAPES = {
    "135M": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, **_LLAMA)),  # SmolLM2
    "0.5B": ("llama", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=49152, tie_word_embeddings=True, **_LLAMA)),
    "1B": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, **_LLAMA,  # Llama-3.2-1B
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "1.1B": ("llama", dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=49152, tie_word_embeddings=False, **_LLAMA)),  # TinyLlama
    "8B": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, **_LLAMA,  # Llama-3.1-8B
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "OLMoE-1B-7B": ("olmoe", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                                  intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                  vocab_size=50304, tie_word_embeddings=False, max_position_embeddings=4096,
                                  bos_token_id=1, eos_token_id=2)),  # OLMoE-1B-7B-0924
}
SHARD_BYTES = 2 * 10**9


def _hub_tensors(name: str, shape) -> list:
    """(name, shape) as the hub's checkpoints store a parameter: transformers fuses each MoE layer's experts into
    one [E, ...] parameter when it loads, the released checkpoints keep one matrix per expert."""
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
        base, (e, two_i, h) = name[:-len("gate_up_proj")], shape
        return [(f"{base}{j}.{w}.weight", (two_i // 2, h)) for j in range(e) for w in ("gate_proj", "up_proj")]
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        base, (e, h, i) = name[:-len("down_proj")], shape
        return [(f"{base}{j}.down_proj.weight", (h, i)) for j in range(e)]
    return [(name, tuple(shape))]


def write_checkpoint(folder: Path, name: str, seed: int = 0) -> int:
    """A random-weight checkpoint of SHAPES[name] in bfloat16 safetensors shards; returns its parameter count.

    Weights N(0, 0.02) as HF initialises them (norms 1), except the output layer, scaled so that logits
    spread like a trained model's: random-init logits are within float16 rounding of each other."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from aqua_export import models

    arch, kwargs = SHAPES[name]
    cfg = AutoConfig.for_model(arch, torch_dtype="bfloat16", **kwargs)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    cfg.architectures = [type(meta).__name__]  # as a hub config names it (genai's builder dispatches on it)
    shapes = [t for n, p in meta.state_dict().items() for t in _hub_tensors(n, p.shape)]
    tied, hidden = cfg.tie_word_embeddings, cfg.hidden_size
    if tied:
        shapes = [(n, s) for n, s in shapes if n != "lm_head.weight"]
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shard, size, index, files = {}, 0, {}, []

    def flush():
        nonlocal shard, size
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            files.append(fname)
            index.update({k: fname for k in shard})
            shard, size = {}, 0

    params = 0
    for n, shape in shapes:
        t = torch.ones(shape) if n.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        if n == "lm_head.weight" or (tied and n == "model.embed_tokens.weight"):
            # logits spread like a trained model's (std ~5, not ~0.5): top-1 is not decided by float16 rounding
            t *= 5.0 / (0.02 * hidden ** 0.5)
        t = t.to(torch.bfloat16)
        params += t.numel()
        if size + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[n] = t
        size += t.numel() * 2
    flush()
    total = sum((tmp / f).stat().st_size for f in files)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    cfg.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(models.resolve("llama")[0]).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return params
