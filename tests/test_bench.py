"""`aqua-export bench`: folders measured in fresh processes, rounds interleaved, one JSON object or a table."""

import json

import pytest
from helpers import folder_cfg

from aqua_export.cli import main
from aqua_export.config import AquaConfig
from aqua_export.export.exporter import export_onnx


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("bench")
    m, proj = tiny_llama
    out = []
    for cfg in (AquaConfig(), AquaConfig(k_ratio=0.5, slice_ratio=0.25), AquaConfig(k_ratio=0.75, h2o_ratio=0.5)):
        d = tmp / f"k{cfg.k_ratio}-s{cfg.slice_ratio}-h{cfg.h2o_ratio}"
        d.mkdir()
        export_onnx(m, proj, cfg, d / "model.onnx")
        folder_cfg(m, cfg).seal(d)
        out.append(d)
    return out


def test_bench_measures_every_folder(tiny_folders, capsys):
    args = ["bench", *map(str, tiny_folders), "--context", "40", "--batch", "2", "--steps", "2", "--rounds", "2",
            "--threads", "1", "--capacity", "300"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["context"] == 40 and res["batch"] == 2 and res["capacity"] == 300
    assert sorted(res["folders"]) == sorted(map(str, tiny_folders))
    for r in res["folders"].values():
        assert r["tokens_per_s"] > 0 and r["decode_rss_mb"] > 0
    assert main(args[:-2]) == 0
    table = capsys.readouterr().out
    assert "| folder | tokens/s | vs first |" in table and table.count("1.00x") >= 2


def test_bench_refuses_what_it_cannot_measure(tiny_folders, tmp_path, capsys):
    assert main(["bench", str(tmp_path), "--context", "8"]) == 2
    assert "is not an aqua-export folder (no aqua_config.json)" in capsys.readouterr().err
    assert main(["bench", str(tiny_folders[0]), "--context", "0"]) == 2
    assert "--context, --batch, --steps and --rounds must be >= 1" in capsys.readouterr().err


def test_bench_times_prefill(tiny_folders, capsys):
    """--prefill: whole prompts from an empty cache (the H2O folder's prompt is one forward evicting inside)."""
    args = ["bench", str(tiny_folders[0]), str(tiny_folders[2]), "--batch", "2", "--steps", "2", "--rounds", "1",
            "--threads", "1", "--prefill", "24", "--json"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["prefill"] == 24 and all(r["tokens_per_s"] > 0 for r in res["folders"].values())
    assert main(args[:-1] + ["--runtime", "genai-io"]) == 2
    assert "--prefill is measured in this project's runtime only" in capsys.readouterr().err


def test_bench_profiles_where_a_step_goes(tiny_folders, capsys):
    """--profile: ms a step per op type from ONNX Runtime's profiler; the attention node is among them."""
    args = ["bench", str(tiny_folders[0]), "--context", "40", "--steps", "2", "--rounds", "1", "--threads", "1",
            "--profile"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prof = res["folders"][str(tiny_folders[0])]["profile_ms"]
    assert prof["AquaAttention"] > 0 and all(ms >= 0 for ms in prof.values())
    assert main(args) == 0
    assert "| folder | op type | ms a step | share |" in capsys.readouterr().out
    assert main(args + ["--runtime", "genai-io"]) == 2
    assert "--profile reads ONNX Runtime's profiler in this project's runtime only" in capsys.readouterr().err


def test_op_times_counts_the_runs_after_the_skipped(tmp_path):
    from aqua_export.bench import op_times

    def node(op, ts, dur):
        return {"cat": "Node", "name": f"n_{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 50},
              node("MatMul", 1, 9000),  # the skipped warm-up run
              {"cat": "Session", "name": "model_run", "ts": 100, "dur": 50}, node("MatMul", 101, 2000),
              node("If", 102, 3000), {"cat": "Session", "name": "model_run", "ts": 200, "dur": 50},
              node("MatMul", 201, 4000)]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(events))
    assert op_times(str(path), skip=1) == {"MatMul": 3.0, "If": 1.5}
    assert op_times(str(path), skip=3) == {}
