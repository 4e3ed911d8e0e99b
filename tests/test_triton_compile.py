"""The Triton kernels compiled for NVIDIA GPUs without one: triton.compile with a GPUTarget (sm_80, sm_90) down to a
cubin (Triton's wheel carries ptxas), for every constexpr combination the hosts launch on the op catalogue's cases
and the page golden table (recorded in the interpreter: kernels.triton.select.LAUNCHES). A shape a GPU compile
rejects is padded in the kernel (a tl.dot's K >= 16 for Triton 3.6), never refused to a user. make test runs this
module under the newest Triton and again under 3.6.0 (what torch 2.11 pins; pyproject's floor)."""

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from implementations import IMPLEMENTATIONS
from op_catalogue import CATALOGUE
from test_tokens import PAGE_GOLDEN, _attrs, _golden_inputs

from aqua_export.ops import aqua_attention

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
KERNELS = {"select_kernel", "topk_gather_dot_kernel", "aqua_attention_kernel", "merge_kernel", "prompt_kernel",
           "page_score_kernel",
           "choose_kernel", "pool_score_kernel", "pool_cut_kernel", "tables_kernel", "score_kernel", "heavy_kernel",
           "evict_kernel"}  # every kernel the hosts launch (generate.py launches these too)

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (it comes with `pip install -e '.[test]'`)", allow_module_level=True)


def _spec(raw, args, kwargs) -> list:
    """A launch -> [module, kernel, signature {arg: type}, constexprs {arg: value}], as ASTSource takes them."""
    names = list(inspect.signature(raw).parameters)
    bound = {**dict(zip(names, args)), **kwargs}
    signature, constexprs = {}, {}
    for name in names:
        v = bound[name]
        if "constexpr" in str(raw.__annotations__.get(name, "")):
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            signature[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        else:
            signature[name] = "fp32"
    return [raw.__module__, raw.__name__, signature, constexprs]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Path:
    """Every launch of the catalogue's Triton cases and the page golden table, recorded (not run, but H2O's, whose
    host reads a kernel's output to launch the next), one spec per distinct combination, in a JSON file."""
    from aqua_export.kernels.triton import select

    triton = IMPLEMENTATIONS["triton"]
    runs = [(oc.op, c.inputs, c.projected, c.dtype, c.attrs, c.cache_dtype) for oc in CATALOGUE
            if triton.supports(oc.op) for c in oc.cases
            if not c.large and not c.error and (not c.only or "triton" in c.only)]
    runs += [(aqua_attention.OP, lambda s=s, n=n, f=f: _golden_inputs(s, n, f), False, "float32", _attrs(**tok), None)
             for s, n, f, tok, _ in PAGE_GOLDEN]
    select.LAUNCHES = []
    try:
        for op, inputs, projected, dtype, attrs, cache_dtype in runs:
            select.DRY = op.name != "H2OAttention"
            triton.run(op, inputs(), projected, dtype, attrs, cache_dtype)
        specs = {json.dumps(_spec(*launch)) for launch in select.LAUNCHES}  # (in the order of the arguments)
    finally:
        select.LAUNCHES, select.DRY = None, False
    path = tmp_path_factory.mktemp("triton-compile") / "launches.json"
    path.write_text("[" + ",".join(sorted(specs)) + "]")
    return path


def _pythons() -> list[str]:
    """This environment's Python (the newest Triton), and those of AQUA_TRITON_PYTHONS (make test: Triton 3.6.0's)."""
    return [sys.executable, *filter(None, os.environ.get("AQUA_TRITON_PYTHONS", "").split(os.pathsep))]


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("python", _pythons(), ids=lambda p: "here" if p == sys.executable else Path(p).parts[-3])
def test_every_launch_compiles_for_a_gpu_target(launches, capability, python):
    """GPUTarget("cuda", capability, 32): each recorded combination compiles to a cubin under that Python's Triton,
    every kernel among them (the launches recorded once: the same hosts launch the same kernels under any Triton)."""
    specs = json.loads(launches.read_text())
    assert {s[1] for s in specs} == KERNELS, "a kernel the hosts launch was not recorded"
    r = subprocess.run([python, str(Path(__file__).with_name("triton_compile_worker.py")), str(launches),
                        str(capability)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"Triton {got['triton']}: {got['compiled']} of {len(specs)} launches compiled for sm_{capability}")
    assert not got["failed"], "\n".join(f"{k}: {e}" for k, e in got["failed"][:5])
    assert got["compiled"] == len(specs)
