"""Items of the local lm-evaluation-harness tasks (the YAML files beside this one), made at load time from
``builtin:gpl-3`` (corpus.py: a text every fresh machine of ours has, and not the calibration text), so the
repository holds no copy of it. Deterministic: the same machine text gives the same items in the same order.

    aqua_lastword   loglikelihood          a sentence without its last word -> " word" (LAMBADA's form)
    aqua_choice     multiple_choice        a sentence's first half -> its own second half among 4 halves
    aqua_rolling    loglikelihood_rolling  whole paragraphs (word and byte perplexity)
    aqua_copy       generate_until         one worked example, then "Text: <phrase>" -> the phrase repeated
"""

from __future__ import annotations

import random
import re


def _paragraphs() -> list[str]:
    from aqua_export import corpus

    text = corpus.read_text("builtin:gpl-3")
    return [p for p in (" ".join(x.split()) for x in re.split(r"\n\s*\n", text)) if len(p.split()) >= 8]


def _sentences() -> list[list[str]]:
    """Sentences of 8..40 words that end in a plain word, as word lists."""
    out = []
    for p in _paragraphs():
        for s in re.split(r"(?<=[.;])\s+", p):
            w = s.split()
            if 8 <= len(w) <= 40 and re.fullmatch(r"[A-Za-z]+[.;]?", w[-1]):
                out.append(w[:-1] + [w[-1].rstrip(".;")])
    return out


def _split(items: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(items)}


def lastword(**_):
    return _split([{"context": " ".join(w[:-1]), "target": " " + w[-1]} for w in _sentences()])


def choice(**_):
    sents = _sentences()
    rng = random.Random(0)
    items = []
    for i, w in enumerate(sents):
        cut = len(w) // 2
        others = rng.sample([j for j in range(len(sents)) if j != i], 3)
        endings = [" " + " ".join(w[cut:])] + [" " + " ".join(sents[j][len(sents[j]) // 2:]) for j in others]
        label = rng.randrange(4)
        endings[0], endings[label] = endings[label], endings[0]
        items.append({"context": " ".join(w[:cut]), "choices": endings, "label": label})
    return _split(items)


def rolling(**_):
    return _split([{"text": p} for p in _paragraphs() if len(p.split()) >= 40][:30])


_COPY_SHOT = "Repeat the text.\nText: the source code of the work\nRepeat: the source code of the work\n"


def copy(**_):
    rng = random.Random(1)
    items = []
    for w in _sentences()[:40]:
        n = rng.randrange(4, 9)
        start = rng.randrange(0, len(w) - n + 1)
        phrase = " ".join(w[start:start + n])
        items.append({"prompt": f"{_COPY_SHOT}Text: {phrase}\nRepeat:", "target": phrase})
    return _split(items)
