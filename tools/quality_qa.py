"""Long-prompt question answering (section qa of tools/quality.py): questions over a real document of 1k to 8k tokens,
answered greedily by folders of the embedded model, each speed setting's answer compared with the dense folder's at
the same weights, so a setting that derails an answer shows, and so does which part of a folder did it (the weights:
int4 against float; the prompt's attention: a setting against dense at those weights).

    document  builtin:gpl-3 (the GNU GPL v3, 7.7k tokens), its first ~1.2k / ~4.6k tokens or all of it, each with
              two questions whose answer lies in that part (the chat template around "DOCUMENT\n\nQuestion: Q")
    answers   NEW greedy tokens through `aqua-export run`'s loop (ONNX Runtime, native kernels, 2 threads)
    agree     2 LCS / (len a + len b) of the answer's tokens and the dense answer's at the same weights (1: the same)
    repeat    the share of the answer's 4-grams that occur earlier in it (a loop repeating itself: towards 1)

The settings: float32 and int4 weights (`--weights int4`), dense, sparse prefill 0.98, the bfloat16 prompt (where the
CPU has AVX512_BF16; elsewhere it is float32's answer and is not run), and the int4 token folder (token selection).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from aqua_export import corpus
from aqua_export.config import AquaConfig
from tools.harness import table

DOC = "builtin:gpl-3"
# (characters of the document kept, its questions): the answer to each lies in the part kept
PARTS = (
    (5300, ("What does the word \"convey\" mean in this license?",
            "Which freedoms does the preamble say the license is meant to guarantee?")),
    (21000, ("For how many years must a written offer to provide the Corresponding Source remain valid?",
             "In which ways may a covered work be conveyed in object code form? List them.")),
    (None, ("What does section 15 of the license say about warranty?",
            "What happens to your rights under this license if you violate it, and how can they be reinstated?")),
)
NEW = 96
TOKENS = dict(k_ratio=0.25, selection="group-weighted", token_budget=512)  # the int4 token folder's selection


@dataclass(frozen=True)
class Setting:
    """A folder to answer with: its AQUA settings and build options, and the dense folder it is compared with."""

    config: AquaConfig
    weights: str = "float"  # float | int4
    cache_dtype: str | None = None
    dense: str = ""  # the setting it is compared with ("": itself the reference)
    needs_bf16: bool = False  # only where the kernel runs bfloat16 (runtime.session.prompt_bf16_runs)


SETTINGS = {
    "float, dense": Setting(AquaConfig()),
    "float, sparse prefill 0.98": Setting(AquaConfig(prefill_threshold=0.98), dense="float, dense"),
    "int4, dense": Setting(AquaConfig(), "int4", dense="float, dense"),
    "int4, sparse prefill 0.98": Setting(AquaConfig(prefill_threshold=0.98), "int4", dense="int4, dense"),
    "int4, bfloat16 prompt": Setting(AquaConfig(prompt_precision="bfloat16"), "int4", dense="int4, dense",
                                     needs_bf16=True),
    "int4 token folder": Setting(AquaConfig(**TOKENS), "int4", "float16", dense="int4, dense"),
    "int4 token folder, sparse prefill 0.98": Setting(AquaConfig(**TOKENS, prefill_threshold=0.98), "int4", "float16",
                                                      dense="int4 token folder"),
}


def agreement(a: list[int], b: list[int]) -> float:
    """2 |LCS(a, b)| / (|a| + |b|): 1 for the same tokens, 0 for none in common (1 when both are empty)."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return 2 * prev[-1] / (len(a) + len(b))


def repetition(ids: list[int], n: int = 4) -> float:
    """The share of the n-grams of ids that occurred earlier in ids (0: none repeats; a loop: towards 1)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    seen, again = set(), 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return again / len(grams) if grams else 0.0


def prompts(tok, doc: str = DOC, parts=PARTS) -> list[dict]:
    """Each question's chat prompt over its part of the document: [{part, tokens, question, ids}]."""
    from aqua_export.serving.api import chat_ids

    text = corpus.read_text(doc)
    out = []
    for chars, questions in parts:
        part = text[:chars] if chars else text
        for q in questions:
            ids = chat_ids(tok, [{"role": "user", "content": f"{part}\n\nQuestion: {q}"}])
            out.append({"part": len(tok(part)["input_ids"]), "tokens": len(ids), "question": q, "ids": ids})
    return out


def answer(folder: Path, asks: list[dict], new: int = NEW, threads: int = 2) -> list[list[int]]:
    """Greedy answers (token ids, the end-of-turn token and after dropped) through the folder, one prompt at a time."""
    import numpy as np

    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.sampling import SamplingConfig
    from aqua_export.runtime.text import load_tokenizer

    lm = OrtLM.from_folder(folder, threads)
    stop = load_tokenizer(folder).eos_token_id
    out = []
    for a in asks:
        ids = np.array([a["ids"]], np.int64)
        got = [int(t) for t in lm.generate(ids, np.ones_like(ids), SamplingConfig(max_new_tokens=new),
                                           eos_token_id=stop)[0]]
        out.append(got[:got.index(stop)] if stop in got else got)
    return out


def slug(name: str) -> str:
    """A setting's name as a folder's: "int4 token folder, sparse prefill 0.98" -> int4-token-folder-sparse-prefill-098."""
    return name.replace(" + ", "-and-").replace(" ", "-").replace(",", "").replace(".", "")


def build(model, tok, proj, setting: Setting, folder: Path) -> None:
    """The setting's folder (the build's export stage: no calibration, no parity) at ``folder``."""
    from aqua_export.build import export_folder
    from aqua_export.options import BuildOptions
    from aqua_export.quantize import WeightFormat

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    opts = BuildOptions(weights=WeightFormat(bits=4) if setting.weights == "int4" else WeightFormat(),
                        cache_dtype=setting.cache_dtype)
    export_folder(model, tok, proj, setting.config, opts, folder, "llama").seal(folder)


def measure(model, tok, proj, work: Path, settings: dict = SETTINGS, asks: list[dict] | None = None,
            new: int = NEW) -> dict:
    """Each setting's answers to every prompt, and their agreement with its dense setting's."""
    from aqua_export.runtime.session import prompt_bf16_runs

    asks = asks if asks is not None else prompts(tok)
    answers: dict = {}
    out = {"prompts": [{k: a[k] for k in ("part", "tokens", "question")} for a in asks], "new": new, "settings": {}}
    for name, s in settings.items():
        if s.needs_bf16 and not prompt_bf16_runs():
            out["settings"][name] = {"skipped": "float32 here (no AVX512_BF16): the dense answer"}
            continue
        t = time.perf_counter()
        folder = Path(work) / slug(name)
        build(model, tok, proj, s, folder)
        try:
            answers[name] = answer(folder, asks, new)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        ref = answers.get(s.dense)
        out["settings"][name] = {
            "dense": s.dense, "answers": [tok.decode(a) for a in answers[name]],
            "repeat": [repetition(a) for a in answers[name]],
            "agree": [agreement(a, r) for a, r in zip(answers[name], ref)] if ref is not None else None,
            "seconds": time.perf_counter() - t}
        print(f"qa {name}: repeat {_mean(out['settings'][name]['repeat']):.2f}"
              + (f", agree with {s.dense} {_mean(out['settings'][name]['agree']):.2f}" if ref is not None else "")
              + f" ({out['settings'][name]['seconds']:.0f} s)", flush=True)
    return out


def _mean(x: list[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


def lines(data: dict) -> list[str]:
    """quality.md's section: one row per setting, a cell per question (agree / repeat)."""
    if not data:
        return []
    asks = data["prompts"]
    head = ["setting", "against", *(f"{a['part']} tok: Q{i % 2 + 1}" for i, a in enumerate(asks)), "agree (mean)",
            "repeat (mean)"]
    rows = []
    for name, r in data["settings"].items():
        if "skipped" in r:
            rows.append([name, "-", *(["-"] * len(asks)), r["skipped"], "-"])
            continue
        agree = r["agree"] or [None] * len(asks)
        cells = [f"{g:.2f} / {p:.2f}" if g is not None else f"- / {p:.2f}" for g, p in zip(agree, r["repeat"])]
        rows.append([name, r["dense"] or "-", *cells, f"{_mean(r['agree']):.2f}" if r["agree"] else "-",
                     f"{_mean(r['repeat']):.2f}"])
    qs = "; ".join(f"Q{i % 2 + 1} at {a['part']} tokens: {a['question']}" for i, a in enumerate(asks))
    return ["\n## Long-prompt question answering (`--sections qa`)\n",
            f"Questions over `{DOC}` (the document's first ~1.2k / ~4.6k tokens, or all 7.7k), greedy answers of "
            f"{data['new']} tokens through folders of each setting (ONNX Runtime, native kernels), each compared with "
            "the setting named under *against* at the same weights (int4 dense against float dense: the weights' own "
            "effect). Each cell: agree (2 LCS / (len a + len b) of the answer's tokens and the other's: 1 the same) / "
            "repeat (the share of the answer's 4-grams seen earlier in it: a loop towards 1). Questions: " + qs + "\n",
            *table(head, rows)]
