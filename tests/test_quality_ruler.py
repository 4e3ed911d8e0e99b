"""RULER's needle tasks (tools/quality_ruler.py, `python -m tools quality --sections ruler`) at tiny size, offline:
lm-eval builds the items with the embedded tokenizer and scores the text a model returns; one run through a model
that reads the needle (found) or says nothing (not found), one through tiny folders of two settings."""

import re

import pytest
from helpers import tiny_folder

pytest.importorskip("lm_eval", reason="lm-eval is the eval extra: pip install -e '.[eval]'")

from aqua_export.config import AquaConfig  # noqa: E402
from tools import quality_ruler  # noqa: E402
from tools.quality_qa import Setting  # noqa: E402
from tools.ruler_items import scores  # noqa: E402

TASK, LENGTH = "niah_single_1", 256


def embedded_tokenizer() -> str:
    from aqua_export import models

    return str(models.resolve("llama")[0])


def test_the_suite_scores_a_found_needle_one_and_a_missed_one_zero():
    from lm_eval.api.model import LM

    class Reader(LM):
        """Answers every other item with the needle its prompt asks for, and nothing for the others."""

        def generate_until(self, requests, disable_tqdm=False):
            out = []
            for i, r in enumerate(requests):
                key = re.findall(r"special magic number for ([\w-]+) mentioned", r.args[0])[-1]
                found = re.search(rf"special magic numbers? for {re.escape(key)} is: (\d+)", r.args[0]).group(1)
                out.append(f" {found}." if i % 2 == 0 else " I do not know.")
            return out

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    got = scores(Reader(), [TASK], [LENGTH], 4, embedded_tokenizer())
    assert got[TASK][str(LENGTH)]["scores"] == [1.0, 0.0, 1.0, 0.0]


def test_wilson_interval_brackets_the_share_and_narrows_with_items():
    lo, hi = quality_ruler.wilson([1.0] * 5 + [0.0] * 5)
    assert lo < 0.5 < hi and hi - lo > 0.5
    lo2, hi2 = quality_ruler.wilson([1.0] * 50 + [0.0] * 50)
    assert lo < lo2 < 0.5 < hi2 < hi
    assert quality_ruler.wilson([1.0] * 20)[1] == pytest.approx(1.0) and quality_ruler.wilson([1.0] * 20)[0] > 0.8


def test_each_setting_answers_the_same_items_through_its_folder(tiny_llama, tmp_path, monkeypatch):
    model, proj = tiny_llama

    def build(model_, tok, proj_, setting, folder):  # the tiny model, as lm-eval's HFLM reads a folder
        tiny_folder(model, proj, setting.config, folder, hf=True)  # 4096 positions: an item is ~1k characters

    monkeypatch.setattr(quality_ruler, "build", build)
    settings = {"dense": Setting(AquaConfig(k_ratio=0.5)),
                "sparse": Setting(AquaConfig(k_ratio=0.5, prefill_threshold=0.5), dense="dense")}
    data = quality_ruler.measure(model, None, proj, tmp_path, [TASK], [LENGTH], 2, settings, peers=())
    for name in settings:
        cell = data["engines"][name][TASK][str(LENGTH)]
        assert len(cell["scores"]) == 2 and set(cell["scores"]) <= {0.0, 1.0} and cell["seconds"] > 0
        assert cell["head"] == "last row"
    assert not list(tmp_path.glob("ruler-*"))  # each folder removed after its run
    text = "\n".join(quality_ruler.lines(data))
    assert f"| {TASK} | {LENGTH} |" in text and "(n 2)" in text
    assert "head on every position" not in text  # no cell of this run is marked


def test_seconds_measured_before_the_last_row_head_are_marked():
    data = {"tasks": [TASK], "lengths": [2048], "items": 1,
            "engines": {"dense": {TASK: {"2048": {"scores": [1.0], "seconds": 13.0}}},
                        "int8 cache": {TASK: {"2048": {"scores": [1.0], "seconds": 9.0, "head": "last row"}}},
                        "openvino dense": {TASK: {"2048": {"scores": [1.0], "seconds": 10.0}}}}}
    text = "\n".join(quality_ruler.lines(data))
    assert f"| {TASK} | 2048 | 13.0 * | 9.0 | 10.0 |" in text and "head on every position" in text


def test_a_run_of_some_engines_merges_into_the_last_run_of_the_same_item_count():
    cell = lambda *s: {"scores": list(s), "seconds": 1.0}  # noqa: E731
    old = {"tasks": [TASK], "lengths": [2048], "items": 2,
           "engines": {"dense": {TASK: {"2048": cell(1.0, 1.0)}},
                       "openvino xattention": {TASK: {"2048": cell(0.0, 0.0)}}}}
    new = {"tasks": [TASK], "lengths": [4096], "items": 2,
           "engines": {"dense": {TASK: {"4096": cell(1.0, 0.0)}},
                       "openvino xattention-all": {TASK: {"4096": cell(0.0, 1.0)}}}}
    got = quality_ruler.merge(old, new)
    assert got["lengths"] == [2048, 4096] and set(got["engines"]["dense"][TASK]) == {"2048", "4096"}
    assert got["engines"]["openvino xattention"] == old["engines"]["openvino xattention"]
    assert "openvino xattention-all" in got["engines"]
    assert quality_ruler.merge(old, {**new, "items": 3}) == {**new, "items": 3}  # other counts: not one table
    text = "\n".join(quality_ruler.lines(got))
    assert f"| {TASK} | 4096 |" in text and "| - |" in text  # a cell an engine did not run


def test_an_unknown_engine_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="unknown openvino xattn; use any of dense"):
        quality_ruler.measure(None, None, None, tmp_path, engines="dense,openvino xattn")


def test_every_engine_can_be_named_in_the_comma_separated_list(tmp_path):
    names = [*quality_ruler.SETTINGS, *(f"openvino {m}" for m in quality_ruler.OPENVINO)]
    assert all("," not in n for n in names)  # a comma in a name splits it into two unknown ones
    with pytest.raises(SystemExit, match="unknown x;"):
        quality_ruler.measure(None, None, None, tmp_path, engines=",".join([*names, "x"]))  # refused before anything builds


def test_a_task_and_length_no_run_measured_gets_no_row():
    cell = lambda *s: {"scores": list(s), "seconds": 1.0}  # noqa: E731
    data = {"tasks": [TASK, "niah_multikey_2"], "lengths": [2048, 4096], "items": 2,
            "engines": {"dense": {TASK: {"2048": cell(1.0, 1.0), "4096": cell(1.0, 0.0)}},
                        "sparse prefill 0.98": {"niah_multikey_2": {"2048": cell(0.0, 1.0)}}}}
    text = "\n".join(quality_ruler.lines(data))
    assert f"| {TASK} | 2048 |" in text and f"| {TASK} | 4096 |" in text
    assert "| niah_multikey_2 | 2048 | - | 0.50" in text and "dense not run |" in text
    assert "| niah_multikey_2 | 4096 |" not in text  # neither engine ran it: no row of dashes
