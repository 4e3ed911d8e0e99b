"""Building an ONNX graph node by node, with weights streamed to external data as they are made.

Why not trace: torch.onnx.export holds the PyTorch model, the traced program and the whole ModelProto
(weights included) at once, then serialises it in one piece, which protobuf refuses past 2 GiB. Here
each weight is written to ``model.onnx.data`` the moment it is produced and only a reference stays in
the graph, so memory holds the source weights plus one tensor, and the ModelProto that is serialised is
the graph alone (kilobytes), whatever the model's size (docs/design.md, The ONNX graph).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ONNX_LIMIT = 1_800_000_000  # stay clear of protobuf's 2 GiB limit
# Weights above this go to external data by default: past protobuf's limit they must, and from here on an
# inline model costs its size again at every load (parsed protobuf beside the tensors made from it)
EXTERNAL_ABOVE = 512 * 2**20
ALIGN = 4096  # page-aligned offsets let ONNX Runtime map external weights instead of copying them
INLINE_BELOW = 1024  # bytes: small constants (shapes, axes, biases of tiny models) stay in the graph

_ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int64: 7, torch.int32: 6,
               torch.bool: 9, torch.uint8: 2}


def onnx_type(dtype: torch.dtype) -> int:
    return _ONNX_TYPES[dtype]


class TensorStore:
    """Initializers, inline or appended to one external data file beside the model.

    external: write tensors of INLINE_BELOW bytes or more to ``data_path`` (page-aligned), keeping only
    (location, offset, length) in the graph; otherwise every tensor is inline.
    """

    def __init__(self, data_path: Path | None):
        import onnx

        self.data_path = data_path
        self._f = open(data_path, "wb") if data_path is not None else None
        # initializers are made in place inside the final ModelProto: inline weights are never copied
        self.model = onnx.ModelProto()

    def add(self, name: str, t: torch.Tensor):
        from onnx import TensorProto

        t = t.detach().contiguous().cpu()
        proto = self.model.graph.initializer.add()
        proto.name = name
        proto.dims.extend(t.shape)
        proto.data_type = onnx_type(t.dtype)
        raw = _raw_bytes(t)
        if self._f is not None and raw.nbytes >= INLINE_BELOW:
            offset = -(-self._f.tell() // ALIGN) * ALIGN
            self._f.seek(offset)
            self._f.write(raw.data)
            proto.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(raw.nbytes))):
                entry = proto.external_data.add()
                entry.key, entry.value = k, v
        else:
            proto.raw_data = raw.tobytes()
        return proto

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's little-endian bytes as a flat uint8 array (bfloat16 has no NumPy dtype: view it as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8)


class GraphBuilder:
    """Nodes, inputs, outputs and initializers of one graph; node names are the caller's stable paths.

    ``op("/model/layers.0/attn/q_proj/MatMul", "MatMul", [x, w])`` adds a node whose outputs are named
    ``<name>/output_<i>``, so a value's name says which node made it.
    """

    def __init__(self, store: TensorStore):
        self.store = store
        self.nodes: list = []
        self.inputs: list = []
        self.outputs: list = []
        self._consts: dict[tuple, str] = {}

    def op(self, name: str, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "",
           outputs: list[str] | None = None, **attrs) -> str | list[str]:
        from onnx import helper as H

        outs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(H.make_node(op_type, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if n_out == 1 and outputs is None else outs

    def weight(self, name: str, t: torch.Tensor) -> str:
        self.store.add(name, t)
        return name

    def const(self, values, dtype: torch.dtype = torch.int64) -> str:
        """A small constant, shared by value: /const/<dtype>/<values>."""
        t = torch.as_tensor(values, dtype=dtype)
        key = (str(dtype), tuple(t.shape), tuple(t.reshape(-1).tolist()))
        if key not in self._consts:
            name = f"/const/{str(dtype).split('.')[-1]}/{'_'.join(map(str, key[2]))}{'' if t.dim() else '/scalar'}"
            self.store.add(name, t)
            self._consts[key] = name
        return self._consts[key]

    def input(self, name: str, elem: int, shape: list) -> str:
        from onnx import helper as H

        self.inputs.append(H.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, elem: int, shape: list) -> None:
        from onnx import helper as H

        self.outputs.append(H.make_tensor_value_info(name, elem, shape))

    def model(self, graph_name: str, opsets: dict[str, int], functions: list, producer: str):
        """The ModelProto the store's initializers already live in, completed with the graph around them."""
        from onnx import helper as H

        m = self.store.model
        m.graph.name = graph_name
        m.graph.node.extend(self.nodes)
        m.graph.input.extend(self.inputs)
        m.graph.output.extend(self.outputs)
        # IR 10: ONNX Runtime 1.31 refuses IR versions above 13, TensorRT 10 above 10 (docs/design.md, The ONNX graph)
        m.ir_version = 10
        m.producer_name = producer
        m.opset_import.extend(H.make_opsetid(d, v) for d, v in opsets.items())
        m.functions.extend(functions)
        return m


def save_graph(model, path: Path) -> None:
    """Write a ModelProto whose large weights are already external: the proto itself is small.

    The serialised size is checked, so nothing ever asks protobuf for more than it can hold."""
    size = model.ByteSize()
    if size > ONNX_LIMIT:
        raise RuntimeError(f"graph proto is {size} bytes with inline weights: build with external data")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def load_graph(path: Path):
    """The ModelProto of a saved model without reading its external weights (they stay on disk)."""
    import onnx

    return onnx.load(str(path), load_external_data=False)


