"""RULER's needle tasks (section ruler of tools/quality.py): lm-evaluation-harness's offline `ruler` tasks at each
length, answered by folders of the embedded model at every speed setting and by OpenVINO GenAI (dense, XAttention,
Tri-shape) on the same items, each cell with its count and a 95% interval, the dense folder's score beside it.

    python -m tools quality --sections ruler [--ruler-lengths 2048,4096,8192] [--ruler-items 50]
                            [--ruler-tasks niah_single_1,...] [--ruler-engines "dense,openvino xattention"]

Items: the first N lm-eval builds at each length with the embedded tokenizer (tools/ruler_items.py). Ours through
aqua_export.lm_eval_model.AquaLM (ONNX Runtime, native kernels, 2 threads); OpenVINO's through
tools/ruler_openvino.py in its own environment, on its float32 conversion of the same checkpoint. A length where
dense scores near zero is marked and kept out of claims: there the 135M model cannot do the task at all.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

from aqua_export.config import AquaConfig
from tools.harness import table
from tools.quality_qa import TOKENS, Setting, build, slug
from tools.ruler_items import GEN_TOKENS, TASKS, scores

LENGTHS = (2048, 4096, 8192)
ITEMS = 50
SETTINGS = {
    "dense": Setting(AquaConfig()),
    "token selection": Setting(AquaConfig(**TOKENS), dense="dense"),
    "sparse prefill 0.98": Setting(AquaConfig(prefill_threshold=0.98), dense="dense"),
    "bfloat16 prompt": Setting(AquaConfig(prompt_precision="bfloat16"), dense="dense", needs_bf16=True),
    "int8 cache": Setting(AquaConfig(), cache_dtype="int8", dense="dense"),
    # the README's recommendation for speed at float weights (int4 weights loop on the 135M model: section qa)
    "token selection + sparse prefill 0.98 + float16 cache": Setting(AquaConfig(**TOKENS, prefill_threshold=0.98),
                                                                     cache_dtype="float16", dense="dense"),
}
OPENVINO = ("dense", "xattention", "xattention-all", "trishape")  # tools/ruler_openvino.py's modes, its float32 IR
NEAR_ZERO = 0.1  # dense's score at a length below which the length is dropped from claims


def wilson(scores: list[float], z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a share (scores 0 or 1; a partial score counts as its share)."""
    n = len(scores)
    if not n:
        return (0.0, 1.0)
    p = sum(scores) / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, (mid - half) / (1 + z * z / n)), min(1.0, (mid + half) / (1 + z * z / n)))  # no -0.00


def ours(folder: Path, tasks, lengths, items: int, tokenizer: str, threads: int = 2) -> dict:
    from aqua_export.lm_eval_model import AquaLM

    with AquaLM(folder=str(folder), threads=threads) as lm:
        out = scores(lm, tasks, lengths, items, tokenizer)
    for by in out.values():  # each prompt's head on its last row alone (runtime.lm: last_row), as OpenVINO's
        for cell in by.values():
            cell["head"] = "last row"
    return out


def openvino(mode: str, tasks, lengths, items: int, tokenizer: str, work: Path, threads: int = 2) -> dict:
    from tools.folders import PY, make, setup

    setup()
    py = PY["openvino"]
    if subprocess.run([py, "-c", "import lm_eval, wonderwords"], capture_output=True).returncode:
        from importlib.metadata import version  # the same lm-eval as ours: the same items

        # datasets and huggingface-hub held where optimum-intel's converter (hub < 1.22) and transformers still load
        subprocess.run([py, "-m", "pip", "-q", "install", f"lm_eval[ruler]=={version('lm_eval')}", "datasets<5",
                        "huggingface-hub>=1.5,<1.22"], check=True)
    out = work / f"openvino-{mode}.json"
    subprocess.run([py, "-m", "tools.ruler_openvino", make("openvino:fp32"), mode, tokenizer, str(out), "--tasks",
                    ",".join(tasks), "--lengths", ",".join(map(str, lengths)), "--items", str(items), "--threads",
                    str(threads)], check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.read_text())


def measure(model, tok, proj, work: Path, tasks=TASKS, lengths=LENGTHS, items: int = ITEMS,
            settings: dict = SETTINGS, peers=OPENVINO, engines: str = "") -> dict:
    """{engine: {task: {length: {scores, seconds}}}} for ours (each setting's folder, built then removed) and
    OpenVINO's modes; engines: only these (comma-separated names: a setting's, or "openvino <mode>"), or all."""
    if engines:
        wanted = [e.strip() for e in engines.split(",")]
        known = [*settings, *(f"openvino {m}" for m in peers)]
        unknown = [e for e in wanted if e not in known]
        if unknown:
            raise SystemExit(f"--ruler-engines: unknown {', '.join(unknown)}; use any of {', '.join(known)}")
        settings = {k: v for k, v in settings.items() if k in wanted}
        peers = [m for m in peers if f"openvino {m}" in wanted]
    from aqua_export import models
    from aqua_export.runtime.session import prompt_bf16_runs

    tokenizer = str(models.resolve("llama")[0])
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    out = {"tasks": list(tasks), "lengths": list(lengths), "items": items, "engines": {}}
    for name, s in settings.items():
        if s.needs_bf16 and not prompt_bf16_runs():
            out["engines"][name] = {"skipped": "float32 here (no AVX512_BF16): dense's answers"}
            continue
        folder = work / f"ruler-{slug(name)}"
        build(model, tok, proj, s, folder)
        try:
            out["engines"][name] = ours(folder, tasks, lengths, items, tokenizer)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"ruler {name}: {_brief(out['engines'][name])}", flush=True)
    for mode in peers:
        out["engines"][f"openvino {mode}"] = openvino(mode, tasks, lengths, items, tokenizer, work)
        print(f"ruler openvino {mode}: {_brief(out['engines'][f'openvino {mode}'])}", flush=True)
    return out


def merge(old: dict, new: dict) -> dict:
    """new's cells over old's (engine, task, length), when both counted the same items; else new alone."""
    if not old or old.get("items") != new["items"]:
        return new
    engines = {k: dict(v) for k, v in old["engines"].items()}
    for name, cells in new["engines"].items():
        if "skipped" in cells or "skipped" in engines.get(name, {}):
            engines[name] = cells
            continue
        for task, by in cells.items():
            engines.setdefault(name, {}).setdefault(task, {}).update(by)
    union = lambda a, b: [*a, *(x for x in b if x not in a)]  # noqa: E731
    return {**new, "tasks": union(old["tasks"], new["tasks"]), "lengths": sorted(union(old["lengths"], new["lengths"])),
            "engines": engines}


def _brief(cells: dict) -> str:
    return ", ".join(f"{t} {n}: {sum(c['scores'])}/{len(c['scores'])}"
                     for t, by in cells.items() for n, c in by.items())


def _cell(c: dict) -> str:
    lo, hi = wilson(c["scores"])
    return f"{sum(c['scores']) / len(c['scores']):.2f} [{lo:.2f}, {hi:.2f}] (n {len(c['scores'])})"


def lines(data: dict) -> list[str]:
    """quality.md's section: task x length rows, a column per engine (score [95% interval] (n), s per item)."""
    if not data:
        return []
    engines = {k: v for k, v in data["engines"].items() if "skipped" not in v}
    head = ["task", "length", *engines, "dense near zero?"]
    rows, seconds = [], []
    for task in data["tasks"]:
        for n in map(str, data["lengths"]):
            if not any(n in e.get(task, {}) for e in engines.values()):  # a cell no run has measured yet
                continue
            dense = engines.get("dense", {}).get(task, {}).get(n)
            low = dense is not None and sum(dense["scores"]) / len(dense["scores"]) < NEAR_ZERO
            rows.append([task, n, *(_cell(e[task][n]) if n in e.get(task, {}) else "-" for e in engines.values()),
                         "dense not run" if dense is None else "yes: dropped from claims" if low else "no"])
            seconds.append([task, n, *(_seconds(name, e[task][n]) if n in e.get(task, {}) else "-"
                                       for name, e in engines.items()), ""])
    skipped = "; ".join(f"{k}: {v['skipped']}" for k, v in data["engines"].items() if "skipped" in v)
    return ["\n## RULER's needle tasks (`--sections ruler`)\n",
            f"lm-evaluation-harness's offline RULER tasks (`{', '.join(data['tasks'])}`), the first {data['items']} "
            f"items it builds at each length with the embedded tokenizer, greedy answers of up to {GEN_TOKENS} tokens "
            "scored by "
            "its string match. Ours: folders of the embedded model at float32 weights (ONNX Runtime, native kernels, "
            "2 threads); OpenVINO GenAI: its float32 conversion of the same checkpoint, its continuous-batching "
            "pipeline dense, with XAttention (threshold 0.8, blocks 64, stride 8; xattention-all: threshold 0.9999, "
            "which keeps every block's mass, a control that should answer as dense does) and with Tri-shape (its "
            "defaults), 2 threads. Each cell: the share found [95% Wilson interval] (items)."
            + (f" Not run: {skipped}." if skipped else "") + "\n",
            *table(head, rows),
            "\nSeconds per item (its prompt and answer, the engine's whole time over the items):\n",
            *table(head[:-1], [r[:-1] for r in seconds]),
            *([f"\n{OLD_HEAD} measured while lm-eval's prompts still computed the head on every position: slower "
               "than the folder is now (niah_multikey_2 at 2,048, dense: 13.0 s an item then); the scores are the "
               "same greedy answers."]
              if any(OLD_HEAD in x for r in seconds for x in r) else [])]


OLD_HEAD = "*"


def _seconds(engine: str, c: dict) -> str:
    """A cell's seconds per item; ours marked where measured before each prompt's head ran on its last row alone."""
    old = not engine.startswith("openvino") and "head" not in c
    return f"{c['seconds'] / len(c['scores']):.1f}{' ' + OLD_HEAD if old else ''}"
