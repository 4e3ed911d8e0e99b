"""The long-prompt question-answering check (tools/quality_qa.py, `python -m tools quality --sections qa`): its two
measures, and a run over a tiny folder per setting that compares each answer with its dense setting's."""

import numpy as np
from helpers import char_tokenizer, tiny_folder

from aqua_export.config import AquaConfig
from aqua_export.runtime.text import load_tokenizer
from tools import quality_qa
from tools.quality_qa import Setting, agreement, repetition


def test_agreement_and_repetition_measure_what_they_say():
    assert agreement([1, 2, 3], [1, 2, 3]) == 1.0 and agreement([1, 2, 3], [4, 5]) == 0.0
    assert agreement([1, 2, 3, 4], [1, 3]) == 2 * 2 / 6 and agreement([], []) == 1.0
    assert repetition(list(range(20))) == 0.0
    loop = [7, 8, 9, 10] * 6  # "1. Convey the work in object code format. 2. Convey ..."
    assert repetition(loop) > 0.8 and repetition([1, 2, 3]) == 0.0


def test_each_setting_is_compared_with_its_dense_one_at_the_same_weights(tiny_llama, tmp_path, monkeypatch):
    model, proj = tiny_llama

    def build(model_, tok, proj_, setting, folder):  # the tiny model's folder
        tiny_folder(model, proj, setting.config, folder)

    monkeypatch.setattr(quality_qa, "build", build)
    (tmp_path / "tok").mkdir()
    char_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    ids = (np.arange(320) * 7 % 90 + 4).tolist()  # long enough for sparse query blocks
    asks = [{"part": 300, "tokens": 320, "question": "what?", "ids": ids}]
    settings = {"dense": Setting(AquaConfig(k_ratio=0.5)),
                "sparse": Setting(AquaConfig(k_ratio=0.5, prefill_threshold=0.5), dense="dense"),
                "again": Setting(AquaConfig(k_ratio=0.5), dense="dense")}
    data = quality_qa.measure(model, tok, proj, tmp_path / "work", settings, asks, new=12)
    s = data["settings"]
    assert s["dense"]["agree"] is None and len(s["dense"]["answers"]) == 1
    assert s["again"]["agree"] == [1.0]  # the same folder answers the same
    assert 0.0 <= s["sparse"]["agree"][0] <= 1.0 and 0.0 <= s["sparse"]["repeat"][0] <= 1.0
    text = "\n".join(quality_qa.lines(data))
    assert "| sparse | dense |" in text and "| again | dense | 1.00 /" in text
