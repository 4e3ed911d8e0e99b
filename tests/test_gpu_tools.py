"""The GPU tools' checks (tools/bench_gpu.py: every Triton kernel against its float64 reference) at tiny sizes: in
Triton's CPU interpreter, so that a change of the kernels' API breaks CI, not the next GPU run; on the GPU where
there is one (a process's Triton kernels are all interpreted or all compiled: conftest.py)."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (it comes with `pip install -e '.[test]'`)", allow_module_level=True)


@pytest.mark.parametrize("check", ["attention", "scores", "h2o"])
def test_the_gpu_checks_pass_at_tiny_sizes(check):
    from tools import bench_gpu as g

    cases = {"attention": g.TINY_ATTENTION, "scores": g.TINY_SCORES, "h2o": g.TINY_H2O}[check]
    lines = getattr(g, f"check_{check}")(cases, device="cuda" if torch.cuda.is_available() else "cpu")  # a failing check raises SystemExit with its line
    assert len(lines) == len(cases) and all(line.endswith(" ok") for line in lines), lines


def test_the_gpu_tools_rows_run_at_a_tiny_size():
    """Every timed step and part of tools/bench_gpu.py called once (in the interpreter without a GPU): the rows
    take the node's current inputs, so an API change fails here rather than on the next lent GPU."""
    from tools import bench_gpu as g

    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = [(name, fn) for name, _, fn in g.steps(640, 1, {}, device)] + g.part_steps(640, 1, device)
    assert len(calls) == 13
    for name, fn in calls:
        out = fn()
        first = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(first.float()).all(), name
