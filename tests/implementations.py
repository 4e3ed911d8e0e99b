"""Every implementation of the custom ops, behind one call: run(op, inputs, projected, dtype, attrs) -> outputs.

    function  the op's ONNX function body in ONNX Runtime (any runtime runs it)
    native    the C++ kernels of plugins/ort in ONNX Runtime (built by `make plugin`)
    triton    kernels/triton's host functions: on the GPU when there is one, else in Triton's CPU interpreter

An op with a function body runs under the first two; under Triton when kernels/triton.HOSTS has it. The op
catalogue (op_catalogue.py) is run against each by test_ops.py.
"""

from __future__ import annotations

import numpy as np
import torch

from aqua_export.ops.spec import PROJECTION
from aqua_export.runtime.session import make_session, native_library


class OnnxRuntime:
    def __init__(self, kernel: str):
        self.name, self.kernel = kernel, kernel
        self._sessions: dict = {}

    def unavailable(self) -> str | None:
        if self.kernel == "native" and native_library() is None:
            return "native kernel not built (run `make plugin`)"
        return None

    def supports(self, op) -> bool:
        return op.body is not None

    def session(self, op, dtype: str, projected: bool, attrs: dict, cache_dtype: str | None = None):
        key = (op.name, dtype, cache_dtype, projected,
               tuple(sorted((n, tuple(v) if isinstance(v, list) else v) for n, v in attrs.items())))
        if key not in self._sessions:
            model = op.model(dtype, projected=projected, cache_dtype=cache_dtype, **attrs)
            self._sessions[key] = make_session(model.SerializeToString(), kernel=self.kernel)
        return self._sessions[key]

    def run(self, op, inputs: list, projected: bool, dtype: str, attrs: dict,
            cache_dtype: str | None = None) -> list[torch.Tensor]:
        names = list(op.input_names) + [PROJECTION] * projected
        feed = {n: np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in zip(names, inputs)}
        sess = self.session(op, dtype, projected, attrs, cache_dtype)
        return [torch.from_numpy(np.asarray(o)) for o in sess.run(None, feed)]


class Triton:
    name = "triton"

    def __init__(self):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter

    def unavailable(self) -> str | None:
        import importlib.util

        # not imported here: Triton's language follows the interpreter setting of its first import (select.triton_for)
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (it comes with `pip install -e '.[test]'`)"
        return None

    def supports(self, op) -> bool:
        from aqua_export.kernels.triton import HOSTS

        return op.name in HOSTS

    def run(self, op, inputs: list, projected: bool, dtype: str, attrs: dict,
            cache_dtype: str | None = None) -> list[torch.Tensor]:
        from aqua_export.kernels.triton import HOSTS

        moved = [x.to(self.device) if isinstance(x, torch.Tensor) and x.dim() > 1 else x for x in inputs]
        return [o.cpu() for o in HOSTS[op.name](*moved, **attrs)]


IMPLEMENTATIONS = {"function": OnnxRuntime("function"), "native": OnnxRuntime("native"), "triton": Triton()}
VALIDATING = ("native", "triton")  # check their inputs and refuse bad ones with a message (a function body cannot)
