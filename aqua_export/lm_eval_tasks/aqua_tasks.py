"""Items of the local lm-evaluation-harness tasks (the YAML files beside this one), made at load time from
``builtin:gpl-3`` (corpus.py: a text every fresh machine of ours has, and not the calibration text), so the
repository holds no copy of it. Deterministic: the same machine text gives the same items in the same order.

    aqua_lastword   loglikelihood          a sentence without its last word -> " word" (LAMBADA's form)
    aqua_choice     multiple_choice        a sentence's first half -> its own second half among 4 halves
    aqua_rolling    loglikelihood_rolling  whole paragraphs (word and byte perplexity)
    aqua_copy       generate_until         one worked example, then "Text: <phrase>" -> the phrase repeated
    aqua_passkey    generate_until         a pass key planted at a depth of a long filler -> the key (the needle test
                                           of long-context methods; no machine text: filler written here)

aqua_passkey's items are sized in the embedded model's tokens (its tokenizer loads offline): PASSKEY_LENGTHS x
PASSKEY_DEPTHS, one key each, the key's share of the way into the filler given by the depth.
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


PASSKEY_LENGTHS = (1024, 4096, 8000)  # prompt tokens; 8000 leaves room for the answer in SmolLM2's 8192 positions
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_PASSKEY_HEAD = "There is a pass key hidden in the text below. Find it and remember it.\n"
_PASSKEY_FILLER = ("The river runs past the old mill. The hills are quiet in the evening. A bird sings on the fence. "
                   "Then the day goes on. ")
_PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def _passkey_prompt(n: int, before: int, key: int) -> str:
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return _PASSKEY_HEAD + _PASSKEY_FILLER * before + needle + _PASSKEY_FILLER * (n - before) + _PASSKEY_QUESTION


def passkey(**_):
    from aqua_export import models
    from aqua_export.runtime.text import load_tokenizer

    tok = load_tokenizer(models.resolve("llama")[0])

    def count(text: str) -> int:
        return len(tok(text)["input_ids"])

    per = count(_PASSKEY_FILLER * 8) / 8
    rng = random.Random(2)
    items = []
    for length in PASSKEY_LENGTHS:
        for depth in PASSKEY_DEPTHS:
            key = rng.randrange(10000, 100000)
            n = int((length - count(_passkey_prompt(0, 0, key))) / per)
            while count(_passkey_prompt(n, round(n * depth), key)) > length:
                n -= 1
            items.append({"prompt": _passkey_prompt(n, round(n * depth), key), "target": str(key), "length": length,
                          "depth": depth})
    return _split(items)
