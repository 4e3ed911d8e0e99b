"""A built int4 MoE folder rewritten to run every expert on every token (the MoE layers as this project computed them
before QMoE: all E experts, weighted by the router's scattered top-k), over the same int4 weights: what
tools/serving.py decodes beside the folder itself, so the chosen-experts speed-up is measured on one weight format.

Per QMoE node (fc1 [E, 2I, H/2] gate / up rows interleaved, fc2 [E, H, I/2], int4 blocks along the inputs):

    h --Reshape [BT, H]--> MatMulNBits(fc1 of all experts as one [E*2I, H] matrix: the same bytes)
      --Reshape [BT, E, I, 2]--> silu(gate) * up  x  router weight of (token, expert)  (0 unless among the top k)
      --Reshape [BT, E*I]--> MatMulNBits(fc2 of all experts as one [H, E*I] matrix: rearranged once, experts.data)

The folder's weights are hard-linked, not copied; its manifest is rewritten (FolderConfig.seal).

    python -m tools.moe_dense SRC DST
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _external(t, folder: Path) -> np.ndarray:
    """The tensor's values, mapped from the folder's external data (small tensors are stored inline)."""
    from onnx import numpy_helper

    info = {e.key: e.value for e in t.external_data}
    if "location" not in info:
        return numpy_helper.to_array(t)
    dtype = {2: np.uint8, 1: np.float32}[t.data_type]
    arr = np.memmap(folder / info["location"], dtype=np.uint8, mode="r", offset=int(info["offset"]),
                    shape=(int(info["length"]),))
    return arr.view(dtype).reshape(tuple(t.dims))


def _alias(t, name: str, dims: list):
    """A tensor of another name and shape over the same external bytes."""
    import onnx

    out = onnx.TensorProto()
    out.CopyFrom(t)
    out.name = name
    del out.dims[:]
    out.dims.extend(dims)
    return out


def all_experts_folder(src: Path, dst: Path) -> None:
    import onnx

    from aqua_export.runtime.folder import FolderConfig
    from aqua_export.export.builder import TensorStore

    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name != "model.onnx":
            (os.link if p.name == "model.onnx.data" else shutil.copy2)(p, dst / p.name)
    m = onnx.load(str(src / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    store = TensorStore(dst / "experts.data")  # the rearranged fc2 of every layer
    nodes = []
    for node in m.graph.node:
        if node.op_type != "QMoE":
            nodes.append(node)
            continue
        nodes += _all_experts(node, inits, src, store, m)
    store.close()
    m.graph.initializer.extend(store.model.graph.initializer)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save(m, str(dst / "model.onnx"))
    cfg = FolderConfig.from_folder(src)
    cfg.seal(dst)


def _all_experts(node, inits: dict, folder: Path, store, m) -> list:
    import torch
    from onnx import helper as H
    from onnx import numpy_helper

    attrs = {a.name: a for a in node.attribute}
    k, bits, block = attrs["k"].i, attrs["expert_weight_bits"].i, attrs["block_size"].i
    h, logits, w1, s1, _, w2, s2 = node.input[:7]
    renormalised = len(node.input) < 15 or not node.input[14]
    e, two_i, _ = inits[w1].dims
    _, hidden, _ = inits[w2].dims
    inter = two_i // 2
    n = node.name
    out = []

    def op(kind, ins, **kw):
        name = f"{n}/dense/{kind}_{len(out)}"
        out.append(H.make_node(kind, ins, [name + "/out"], name=name, **kw))
        return name + "/out"

    def const(name, values):
        t = numpy_helper.from_array(np.asarray(values, np.int64), f"{n}/dense/{name}")
        m.graph.initializer.append(t)
        return t.name

    fc1 = _alias(inits[w1], f"{n}/dense/fc1", [e * two_i, inits[w1].dims[2] * 2 // block, block * bits // 8])
    sc1 = _alias(inits[s1], f"{n}/dense/fc1_scales", [e * two_i, inits[s1].dims[2]])
    m.graph.initializer.extend([fc1, sc1])
    q2 = _external(inits[w2], folder)  # [E, H, I/2]
    s2v = _external(inits[s2], folder)  # [E, H, I/block]
    fc2 = store.add(f"{n}/dense/fc2", torch.from_numpy(np.ascontiguousarray(q2.transpose(1, 0, 2))).reshape(
        hidden, e * inter // block, block * bits // 8)).name
    sc2 = store.add(f"{n}/dense/fc2_scales", torch.from_numpy(np.ascontiguousarray(
        s2v.transpose(1, 0, 2).reshape(hidden, -1)))).name
    x = op("Reshape", [h, const("flat", [-1, hidden])])
    probs = op("Softmax", [logits], axis=-1)
    top = H.make_node("TopK", [probs, const("k", [k])], [f"{n}/dense/topv", f"{n}/dense/topi"], name=f"{n}/dense/TopK")
    out.append(top)
    weights = f"{n}/dense/topv"
    if renormalised:
        weights = op("Div", [weights, op("ReduceSum", [weights, const("last", [-1])], keepdims=1)])
    zeros = op("Sub", [probs, probs])  # [BT, E] of the router's dtype
    dense = op("ScatterElements", [zeros, f"{n}/dense/topi", weights], axis=-1)
    y = op("MatMulNBits", [x, fc1.name, sc1.name], domain="com.microsoft", K=hidden, N=e * two_i, bits=bits,
           block_size=block, accuracy_level=attrs["accuracy_level"].i)
    gu = op("Reshape", [y, const("gu", [-1, e, inter, 2])])
    gate, up = (op("Gather", [gu, const(f"half{j}", j)], axis=-1) for j in (0, 1))
    act = op("Mul", [op("Mul", [gate, op("Sigmoid", [gate])]), up])
    act = op("Mul", [act, op("Unsqueeze", [dense, const("axis", [-1])])])
    y = op("MatMulNBits", [op("Reshape", [act, const("ei", [-1, e * inter])]), fc2, sc2], domain="com.microsoft",
           K=e * inter, N=hidden, bits=bits, block_size=block, accuracy_level=attrs["accuracy_level"].i)
    shape = op("Shape", [h])
    out.append(H.make_node("Reshape", [y, shape], [node.output[0]], name=f"{n}/dense/Out"))
    return out


if __name__ == "__main__":
    all_experts_folder(Path(sys.argv[1]), Path(sys.argv[2]))
