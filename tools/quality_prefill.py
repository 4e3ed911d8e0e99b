"""Sparse prefill's quality (section prefill of tools/quality.py): folders of the embedded model built with each
setting and run by ONNX Runtime (native kernels), every prompt row through the folder's prompt path.

    ppl      perplexity of builtin:licenses (not the calibration text), its first TOKENS tokens in non-overlapping
             windows of 2048 / 4096 / 8192, each window one forward (`aqua-export eval --folder`): the rows of a
             window's sparse query blocks attend the key blocks their estimate keeps
    share    key blocks of 64 computed over the causal ones (all query blocks, the dense last 128 rows included), summed
             over layers and KV heads: the reference's choice (ops.rules.prefill_chosen) on each length's first window
    passkey  lm-eval's aqua_passkey (a key at 5 depths of 1k / 4k / 8k fillers) through each folder
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from aqua_export import corpus, evaluate
from aqua_export.config import AquaConfig
from aqua_export.ops import rules
from aqua_export.settings import prefill
from tools.harness import table
from tools.quality_long import built, passkey_cells, passkey_run

TEXT = "builtin:licenses"
LENGTHS = (2048, 4096, 8192)
TOKENS = 16384  # per length: 8 / 4 / 2 windows
SETTINGS = {"dense": AquaConfig(), "sparse prefill 0.98": AquaConfig(prefill_threshold=0.98),
            # the prompt's attention products in bfloat16 (settings/precision.py; float32 on a CPU without AVX512_BF16)
            "dense, bfloat16 prompt": AquaConfig(prompt_precision="bfloat16"),
            "sparse prefill 0.98, bfloat16 prompt": AquaConfig(prefill_threshold=0.98, prompt_precision="bfloat16")}
BLOCK = 64


def _coordinates(ratio: float) -> str:
    return "all r coordinates" if ratio == 1.0 else f"the top {ratio:g} r of its |q^| coordinates"


def block_share(model, tok, proj, cfg: AquaConfig, length: int) -> float:
    """Chosen over causal (query block, key block) pairs of the first window of ``length`` tokens, through the
    reference (rules.prefill_choice counted as it is called: every layer, KV head and chunk of rows)."""
    from aqua_export.reference.attention import apply_aqua

    ids = corpus.tokenize(tok, corpus.read_text(TEXT), length)[None]
    counts = [0, 0]
    choose = rules.prefill_choice  # what the reference asks (its margin and mass besides the choice)

    def counted(estimate, visible, real, positions, start, end, threshold, stride):
        out = choose(estimate, visible, real, positions, start, end, threshold, stride)
        for i, m in enumerate((out[0], visible)):
            pad = -m.shape[-1] % BLOCK
            m = torch.nn.functional.pad(m, (0, pad)).unflatten(-1, (-1, BLOCK)).any(-1).float()  # [B, Hkv, T, NBk]
            qb = positions // BLOCK
            onehot = (qb[:, None] == torch.arange(int(qb.min()), int(qb.max()) + 1)).float()  # [T, NBq]
            counts[i] += int((torch.einsum("tq,bhtk->bhqk", onehot, m) > 0).sum())
        return out

    rules.prefill_choice = counted
    try:
        with torch.no_grad(), apply_aqua(model, proj, cfg):
            model(ids)
    finally:
        rules.prefill_choice = choose
    assert counts[1] > 0, "the reference made no sparse prefill choice: block_share counts nothing"
    return counts[0] / counts[1]


def measure(model, tok, proj, work) -> dict:
    """Each setting's folder: perplexity per window length, block share, pass keys."""
    text = corpus.read_text(TEXT)
    out = {}
    shares: dict = {}  # the reference's choice ignores the prompt's precision: one count per (choice, length)
    for name, cfg in SETTINGS.items():
        with built(model, tok, proj, cfg, Path(work) / name.replace(" ", "-")) as folder:
            r: dict = {"ppl": {}, "share": {}}
            for n in LENGTHS:
                t = time.perf_counter()
                ppl = evaluate.folder_perplexity(folder, text, tokens=TOKENS, seq_len=n, threads=2)
                r["ppl"][str(n)] = ppl["perplexity"]
                key = (dataclasses.replace(cfg, prompt_precision="float32"), n)
                if key not in shares:
                    shares[key] = block_share(model, tok, proj, key[0], n) if cfg.sparse_prefill else 1.0
                r["share"][str(n)] = shares[key]
                print(f"prefill {name} @ {n}: ppl {r['ppl'][str(n)]:.4f}, blocks {r['share'][str(n)]:.1%} "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
            t = time.perf_counter()
            r["passkey"] = passkey_run(folder)[0]
        print(f"prefill {name}: pass keys {sum(r['passkey'].values())}/{len(r['passkey'])} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        out[name] = r
    return out


def lines(data: dict) -> list[str]:
    """quality.md's section."""
    if not data:
        return []
    from aqua_export.lm_eval_tasks.aqua_tasks import PASSKEY_DEPTHS, PASSKEY_LENGTHS

    dense = data["dense"]["ppl"]
    rows = []
    for name, r in data.items():
        cells = [f"{r['ppl'][str(n)]:.4f} ({100 * (r['ppl'][str(n)] / dense[str(n)] - 1):+.2f}%)" for n in LENGTHS]
        rows.append([name, *cells, *(f"{r['share'][str(n)]:.1%}" for n in LENGTHS), *passkey_cells(r["passkey"])])
    return ["\n## Sparse prefill (`--prefill-threshold`) and the prompt's precision (`--prompt-precision`)\n",
            f"Folders built with each setting (float32; the estimate at its defaults: every "
            f"{prefill.STRIDE.default}th row scoring on {_coordinates(prefill.K_RATIO.default)}; a bfloat16 prompt: "
            "`--prompt-precision bfloat16`, on this CPU's AVX512_BF16), run by ONNX Runtime on "
            f"the native kernels: perplexity on `{TEXT}`'s first {TOKENS} tokens in windows of "
            f"{' / '.join(map(str, LENGTHS))}, each window one forward through the sparse prompt path (against dense "
            "in brackets); blocks: key blocks of 64 computed over the causal ones, the dense last 128 rows included "
            "(the float32 reference's choice on each length's first window: a bfloat16 prompt's estimate, in "
            "bfloat16, may keep other near-tie blocks); pass keys through the same folders (depths "
            f"{', '.join(map(str, PASSKEY_DEPTHS))}: `x` retrieved, `.` missed). `python -m tools.quality "
            "--sections prefill`.\n",
            *table(["setting", *(f"ppl @ {n}" for n in LENGTHS), *(f"blocks @ {n}" for n in LENGTHS),
                    *(f"keys @ {n}" for n in PASSKEY_LENGTHS)], rows)]
