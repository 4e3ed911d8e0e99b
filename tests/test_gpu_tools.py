"""The GPU tools' checks (tools/bench_gpu.py: every Triton kernel against its float64 reference) at tiny sizes in
Triton's CPU interpreter, so that a change of the kernels' API breaks CI, not the next GPU run."""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (it comes with `pip install -e '.[test]'`)", allow_module_level=True)


@pytest.mark.parametrize("check", ["attention", "scores", "h2o"])
def test_the_gpu_checks_pass_in_the_interpreter(check):
    from tools import bench_gpu as g

    cases = {"attention": g.TINY_ATTENTION, "scores": g.TINY_SCORES, "h2o": g.TINY_H2O}[check]
    lines = getattr(g, f"check_{check}")(cases, device="cpu")  # a failing check raises SystemExit with its line
    assert len(lines) == len(cases) and all(line.endswith(" ok") for line in lines), lines
