"""The GuideLLM scenarios' own parts (tools/serve_guidellm.py), without a server or GuideLLM: each load's model is a
shape tools/checkpoints.py makes, its prompts are distinct and of the length asked in GuideLLM's JSON-lines form, and
its serve.md section names its model and load."""

import json

from tools import serve_guidellm
from tools.checkpoints import SHAPES
from tools.folders import Text


def test_each_load_names_a_shape_checkpoints_make():
    for load in serve_guidellm.LOADS.values():
        assert load.shape in SHAPES and load.levels == tuple(sorted(load.levels)) and load.prompt > load.output


def test_prompts_are_distinct_and_of_the_length_asked(tmp_path):
    text = Text()
    path = serve_guidellm.prompts_file(text, tmp_path / "p.jsonl", 3, prompt=64, output=8)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and len({r["prompt"] for r in rows}) == 3
    assert all(r["prompt_tokens_count"] == 64 and r["output_tokens_count"] == 8 for r in rows)
    assert all(abs(text.count(r["prompt"]) - 64) <= 2 for r in rows)  # a decoded slice re-tokenizes to about its size


def test_the_section_names_its_model_and_load():
    row = {"streams": 1, "requests": 4, "errored": 0, "duration_s": 9.0, "ttft_p50_s": 1.0, "ttft_p95_s": 2.0,
           "itl_p50_ms": 30.0, "output_tokens_per_s": 12.5, "requests_per_s": 0.4}
    text = "\n".join(serve_guidellm.lines({"ours-tokens-int4": {"rows": [row], "peak_rss_mb": 900}}, "here",
                                          serve_guidellm.LOADS["guidellm-1b"]))
    assert "GuideLLM, 1B: 512-token prompts + 64 generated, at 1, 4 concurrent streams" in text
    assert "random-weight checkpoint of the 1B shape" in text and "| ours-tokens-int4 | 1 |" in text
    assert serve_guidellm.lines({}, "here") == []
