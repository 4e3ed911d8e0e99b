"""python tests/triton_compile_worker.py SPECS.json CAPABILITY: compiles each recorded launch (test_triton_compile.py)
for NVIDIA's sm_CAPABILITY to a cubin with triton.compile and a GPUTarget, no GPU needed, and prints one JSON line:
{"compiled": n, "failed": [[kernel, error], ...], "triton": version}. A process of its own: one that ran the
interpreter cannot compile (the interpreter patches triton.language)."""

import importlib
import json
import os
import sys


def main(path: str, capability: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from aqua_export.kernels.triton import select

    compiled, failed = 0, []
    with select.triton_for(False):
        for module, name, signature, constexprs in json.loads(open(path).read()):
            fn = select.jit(getattr(importlib.import_module(module), name), False)[0]
            try:
                out = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", capability, 32))
                assert out.asm.get("cubin"), "no cubin"
                compiled += 1
            except Exception as e:  # every failure reported, not the first only
                failed.append([name, f"{type(e).__name__}: {str(e)[-600:]}"])
    return {"compiled": compiled, "failed": failed, "triton": triton.__version__}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # (a test session interprets): set before triton is first imported
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
