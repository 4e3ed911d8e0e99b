"""The GuideLLM scenarios' own parts (tools/serve_guidellm.py), without a server or GuideLLM: each load's model is a
shape tools/checkpoints.py makes, its prompts are distinct and of the length asked in GuideLLM's JSON-lines form, and
its serve.md section names its model and load."""

import json

from tools import serve_guidellm
from tools.checkpoints import SHAPES
from tools.folders import Text


def test_each_load_names_a_shape_checkpoints_make():
    for load in serve_guidellm.LOADS.values():
        assert load.shape in SHAPES and load.levels == tuple(sorted(load.levels))
        assert min(load.lengths(load.at(load.levels[0]))) > load.output


def test_a_load_of_a_length_range_spreads_its_prompts_over_it():
    load = serve_guidellm.LOADS["guidellm-load"]
    lengths = load.lengths(load.at(16))
    assert len(lengths) == 200 and (min(lengths), max(lengths)) == (50, 400)
    assert lengths != sorted(lengths) and lengths == load.lengths(200)  # shuffled, the same each run
    assert abs(sum(lengths) / 200 - 225) < 1 and serve_guidellm.LOADS["guidellm"].at(4) == 8


def test_prompts_are_distinct_and_of_the_length_asked(tmp_path):
    text = Text()
    path = serve_guidellm.prompts_file(text, tmp_path / "p.jsonl", [64] * 3, output=8)
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
    assert serve_guidellm.lines({}, "here") == [] and "int8 cache" not in text
    assert "GuideLLM CPU s" not in text and "ours-engine" not in text  # a run that measured neither
    load = serve_guidellm.LOADS["guidellm-load"]
    text = "\n".join(serve_guidellm.lines({"ours-tokens-int4-i8": {"rows": [row], "peak_rss_mb": 900}}, "here", load))
    assert "GuideLLM, 135M: 200 requests, 50-400-token prompts + 32 generated, at 16 concurrent streams" in text
    assert "200 requests at each level, every server" in text and "int8 cache, as OpenVINO's own KV cache is u8" in text


def test_a_rate_sweep_offers_each_rate_to_every_server_alike():
    load, streams = serve_guidellm.LOADS["guidellm-rates"], serve_guidellm.LOADS["guidellm-load"]
    assert load.rates and not streams.rates and load.levels == tuple(sorted(load.levels))
    assert load.profile(1.0) == "kind=constant,rate=1.0" and streams.profile(16) == "kind=concurrent,streams=16"
    row = {"rate": 2.0, "requests": 48, "errored": 0, "duration_s": 30.0, "ttft_p50_s": 0.5, "ttft_p95_s": 1.0,
           "itl_p50_ms": 40.0, "output_tokens_per_s": 50.0, "requests_per_s": 1.6, "arrived_per_s": 3.9}
    text = "\n".join(serve_guidellm.lines({"vllm": {"rows": [row], "peak_rss_mb": 5000}}, "here", load))
    assert "48 requests at each rate, 50-400-token prompts + 32 generated, at 0.5, 1.0, 2.0 requests/s" in text
    assert "| engine | offered |" in text and "| vllm | 2.0/s (3.9/s arrived) |" in text
    assert "`constant` profile" in text
    starts = [{"request_start_time": 100.0 + 0.5 * i} for i in (3, 0, 2, 1)]  # 2 a second, in any order
    assert serve_guidellm.arrived(starts) == 2.0 and serve_guidellm.arrived(starts[:1]) != 2.0
    assert "No openvino-cb row" in text


def test_serve_md_names_the_machine_of_each_section_a_part_run_measured(tmp_path, monkeypatch):
    from tools import bench_serve

    monkeypatch.setattr(bench_serve, "BENCHMARKS", tmp_path)
    prefix = {"ours-tokens-int4": {"system_tokens": 2048, "cold_ttft_s": 8.2, "second_ttft_s": 8.0,
                                   "warm_ttft_s": 0.37, "ratio": 22.2}}
    bench_serve.write({"threads": 2, "load": {}, "batching": {}, "peers": {}, "prefix": prefix,
                       "measured_on": {"prefix": "an AVX2 CPU"}})
    text = (tmp_path / "serve.md").read_text()
    assert "Measured on an AVX2 CPU." in text.split("## Prefix cache")[1].split("##")[0]
    assert "Measured on" not in text.split("## Prefix cache")[0]  # the load's and batching's: none recorded
    assert "| ours-tokens-int4 | 2048 | 8.2 | 8.0 | 0.37 | 22.2x |" in text


FAKE_GUIDELLM = """#!{python}
import json, sys, time
out = next(a for a in sys.argv if a.startswith("kind=json,path=")).split("path=", 1)[1]
t = time.process_time()
while time.process_time() - t < 0.4:  # the CPU a client takes from the server's cores
    pass
p = {{"percentiles": {{"p50": 1500.0, "p95": 2500.0}}, "mean": 10.0}}
metrics = {{"time_to_first_token_ms": {{"successful": p}}, "inter_token_latency_ms": {{"successful": p}},
           "output_tokens_per_second": {{"successful": p}}, "requests_per_second": {{"successful": p}},
           "request_totals": {{"successful": 4, "errored": 0}}}}
json.dump({{"benchmarks": [{{"metrics": metrics, "duration": 9.0, "requests": {{"successful": []}}}}]}}, open(out, "w"))
"""


def test_a_row_counts_the_cpu_guidellm_took_from_the_servers_cores(tmp_path, monkeypatch):
    import sys

    exe = tmp_path / "guidellm" / "bin" / "guidellm"
    exe.parent.mkdir(parents=True)
    exe.write_text(FAKE_GUIDELLM.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setattr(serve_guidellm, "VENVS", tmp_path)
    load = serve_guidellm.LOADS["guidellm-1b-16"]
    row = serve_guidellm.guidellm(1, "m", load, 16, 16, tmp_path / "out.json", tmp_path / "data.jsonl")
    assert row["client_cpu_s"] >= 0.3 and row["ttft_p50_s"] == 1.5 and row["requests"] == 4
    text = "\n".join(serve_guidellm.lines({"vllm": {"rows": [row], "peak_rss_mb": 5000},
                                           "openvino-cb (in process)": {"rows": [serve_guidellm.of_summary(
                                               {"concurrency": 16, "answered": 16, "requests": 16, "wall_s": 8.0,
                                                "ttft_p50_s": 1.0, "ttft_p95_s": 2.0, "tokens_per_s": 9.0})],
                                               "peak_rss_mb": 900}}, "here", load))
    assert "GuideLLM, 1B: 16 requests, 1000-token prompts + 128 generated, at 16 concurrent streams" in text
    assert f"| 10.0 | 10.0 | {row['client_cpu_s']} | 5000 |" in text and "| 9.0 | 2.0 | - | 900 |" in text
    assert "GuideLLM CPU s: the CPU seconds" in text and "ours-engine" not in text
