"""RULER's needle tasks as lm-evaluation-harness ships them (its `ruler` group: the items built offline with the
model's own tokenizer at each length asked, the answers scored by its string match), run on any lm-eval model: ours
(tools/quality_ruler.py, aqua_export.lm_eval_model.AquaLM) and OpenVINO GenAI's (tools/ruler_openvino.py, in its own
virtual environment). Imports nothing of this project, so both environments run the same code on the same items.

    scores(lm, ["niah_single_1"], [2048], items=20, tokenizer=DIR)
        -> {"niah_single_1": {"2048": {"scores": [1.0, 0.0, ...], "seconds": s}}}
"""

from __future__ import annotations

import time

# lm-eval's needle tasks whose haystacks need no download (the others read Paul Graham's essays from the hub)
TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
# the suite generates 128 tokens; every answer here is a 7-digit number or a UUID, well inside 48, and lm-eval's
# scorer looks for it anywhere in the text, so fewer tokens change no score and save most of a short item's time
GEN_TOKENS = 48


def scores(lm, tasks: list[str], lengths: list[int], items: int, tokenizer: str,
           gen_tokens: int = GEN_TOKENS) -> dict:
    """Each task's per-item scores (lm-eval's own metric for the length: 1.0 found, 0.0 not) at each length, the first
    ``items`` items lm-eval builds there, and the seconds they took (prompts and answers)."""
    from lm_eval import simple_evaluate

    out: dict = {}
    for length in lengths:  # one length a run: lm-eval's limit takes the first items, all of one length
        t = time.perf_counter()
        res = simple_evaluate(model=lm, tasks=list(tasks), limit=items, log_samples=True, bootstrap_iters=0,
                              metadata={"max_seq_lengths": [length], "tokenizer": tokenizer},
                              gen_kwargs=f"max_gen_toks={gen_tokens}")
        took = time.perf_counter() - t
        for task in tasks:
            got = [float(s[str(length)]) for s in res["samples"][task]]
            out.setdefault(task, {})[str(length)] = {"scores": got, "seconds": took / len(tasks)}
    return out
