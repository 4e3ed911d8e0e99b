"""Shared test helpers: calibrate a tiny model on random tokens, left-padded batches, H2OAttention inputs."""

import numpy as np
import torch

from aqua_export import calibrate
from aqua_export import projection as artifact


def tiny_projection(model, tmp_path, seed: int = 0, n: int = 3, t: int = 48):
    import json

    from aqua_export.models import attention_geometry, fingerprint

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, t), generator=g)
    geo = attention_geometry(model)
    mom = calibrate.Moments.zeros(geo["layers"], geo["kv_heads"], geo["head_dim"])
    with torch.no_grad(), calibrate.recording(model, mom):
        model(input_ids=ids, use_cache=False)
    meta = {"format_version": artifact.FORMAT_VERSION, "fingerprint": json.dumps(fingerprint(model), sort_keys=True)}
    path = tmp_path / f"tiny-{seed}.safetensors"
    artifact.write(path, calibrate.projection_tensors(mom), meta)
    return artifact.load_projection(path)


def left_padded(vocab: int, lengths, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, n - length:] = torch.randint(3, vocab, (length,), generator=g)
        mask[i, n - length:] = 1
    return ids, mask


def folder_cfg(model, config, dtype: str = "float32", projection=None, fused: bool = True, cache_dtype=None):
    """The FolderConfig a build would write for ``model`` exported with ``config`` in a test (fused False: a
    TensorRT build's graph; cache_dtype as export_onnx's)."""
    from aqua_export.export.exporter import contract_for
    from aqua_export.models import attention_geometry
    from aqua_export.runtime.folder import FolderConfig, Geometry

    return FolderConfig(model="test", aqua=config, geometry=Geometry(**attention_geometry(model)),
                        contract=contract_for(model, config, {"float32": torch.float32, "float16": torch.float16}[dtype],
                                              projection, cache_dtype, fused=fused))


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


H2O_MASKS = {"full": np.ones((1, 24), np.int64),
             # left padding, a padding gap in the middle (right-padded prompt, then generated tokens)
             "padded": np.array([[0, 0, 0] + [1] * 21, [1] * 7 + [0, 0] + [1] * 15])}


def h2o_inputs(b, hkv, g, t, r, mask, past=None, dtype=torch.float32, seed=0, rv=None):
    """H2OAttention's inputs (h2o.INPUTS): random q^, k^, v of T new tokens (v rv wide, r unless given), an empty
    past unless given."""
    rv = r if rv is None else rv
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(b, hkv, g, t, r, generator=gen), torch.randn(b, hkv, t, r, generator=gen),
         torch.randn(b, hkv, t, rv, generator=gen)]
    x = [a.to(dtype) for a in x]
    if past is None:
        past = (torch.zeros(b, hkv, 0, r, dtype=dtype), torch.zeros(b, hkv, 0, rv, dtype=dtype), torch.zeros(b, hkv, 0),
                torch.zeros(b, hkv, 0, dtype=torch.int64))
    return x + list(past) + [torch.as_tensor(mask, dtype=torch.int64)]


def h2o_token_by_token(run, ins, cap: int):
    """H2OAttention fed ins's T new tokens one forward each, from empty buffers of cap slots: (out [B, Hkv, g,
    T, r], final state). run(inputs) -> the node's outputs as torch tensors."""
    b, hkv, g, t, r = ins[0].shape
    past = [torch.zeros(b, hkv, cap, r), torch.zeros(b, hkv, cap, r), torch.zeros(b, hkv, cap),
            torch.full((b, hkv, cap), -1, dtype=torch.int64)]
    outs = []
    for i in range(t):
        one = [ins[0][:, :, :, i:i + 1], ins[1][:, :, i:i + 1], ins[2][:, :, i:i + 1]] + past + [ins[7][:, :i + 1]]
        res = run(one)
        outs.append(res[0])
        past = res[1:]
    return torch.cat(outs, 3), past


MIN = float(torch.finfo(torch.float32).min)


def attention_inputs(shape, dtype=torch.float32, seed=0, pad=True, rv=None):
    """AquaAttention's inputs (q, kc, vc, length, attention_mask) for shape (B, Hkv, g, T, r, L, C): a tie in the first
    query row, the T new tokens the last of L (causal: ops.rules.visible), left padding of the later rows (a prompt
    covering it has query rows that see nothing)."""
    b, hkv, g, t, r, length, cap = shape
    rv = r if rv is None else rv
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, t, r, generator=gen)
    q[0, 0, 0, 0, : min(4, r)] = 1.5  # a tie: the lower index wins
    kc = torch.randn(b, hkv, r, cap, generator=gen)
    vc = torch.randn(b, hkv, cap, rv, generator=gen)
    attention_mask = torch.ones(b, length, dtype=torch.int64)
    if pad and b > 1:
        attention_mask[1:, : length // 3] = 0  # left padding of the later rows
    return q.to(dtype), kc.to(dtype), vc.to(dtype), length, attention_mask


def random_projection(hkv, d, r, seed=1):
    """P [Hkv, d, r]: the first r columns of a random orthogonal matrix per KV head."""
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0][..., :r].contiguous()


def one_line(capsys, needle: str = "") -> str:
    """The one error line a command left on stderr (progress bars and warnings aside): it starts "aqua-export:
    error: ", contains needle, and no traceback came with it."""
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines()
             if x.strip() and not x.startswith("aqua-export: warning") and "%|" not in x]
    assert len(lines) == 1 and lines[0].startswith("aqua-export: error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_folder(model, proj, config, folder, cache_dtype=None, hf: bool = False):
    """A sealed folder of the tiny model exported with ``config`` (a character tokenizer; hf: also what
    transformers' AutoConfig / AutoTokenizer read, as lm-eval's HFLM does, served at 4096 positions)."""
    import json

    from aqua_export.export.exporter import export_onnx

    folder.mkdir(parents=True, exist_ok=True)
    export_onnx(model, proj, config, folder / "model.onnx", cache_dtype=cache_dtype)
    char_tokenizer(folder)
    if hf:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg | {"tokenizer_class": "PreTrainedTokenizerFast"}))
        # the source's config, as a build copies it
        (folder / "config.json").write_text(json.dumps(model.config.to_dict() | {"max_position_embeddings": 4096}))
    folder_cfg(model, config, projection=proj if cache_dtype else None, cache_dtype=cache_dtype).seal(folder)
    return folder


def char_tokenizer(folder) -> None:
    """A character tokenizer of the tiny model's 128 ids (0 pad, 1 bos, 2 eos, printable ASCII and newline), with a
    chat template: the files a folder's runtime.tokenizer reads."""
    import json

    from tokenizers import Tokenizer, decoders, models

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "\n": 3} | {chr(c): 4 + i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
