"""A folder's graph run by ONNX Runtime with nothing but onnxruntime and numpy (no torch, no aqua_export), as on a
deployment machine: test_portability.py runs it under QEMU emulating older CPUs.

    python portable_run.py MODEL_ONNX OUT_NPZ [KERNEL_LIBRARY]

A 40-token prompt, then 4 decode steps of fixed tokens (the same on every CPU), the cache fed back as presents;
writes every forward's logits and the kernel variant the library chose ("" when none or no library).
"""

import ctypes
import sys

import numpy as np
import onnxruntime as ort

PROMPT = (np.arange(40) * 7 + 3) % 100 + 3
STEPS = [11, 29, 47, 5]
TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


def main(model: str, out: str, library: str | None = None) -> None:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    variant = ""
    if library:
        fn = ctypes.CDLL(library).AquaOrtVariant
        fn.restype = ctypes.c_char_p
        variant = fn().decode()
        so.register_custom_ops_library(library)
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    pasts = sess.get_inputs()[2:]
    past = [np.zeros((1, p.shape[1], 0) + tuple(p.shape[3:]), TYPES[p.type]) for p in pasts]
    ids, seen, logits = PROMPT[None].astype(np.int64), 0, []
    for nxt in [None] + STEPS:
        if nxt is not None:
            ids = np.array([[nxt]], np.int64)
        seen += ids.shape[1]
        res = sess.run(None, {"input_ids": ids, "attention_mask": np.ones((1, seen), np.int64),
                              **{p.name: v for p, v in zip(pasts, past)}})
        logits.append(res[0][0, -1])
        past = res[1:]
    np.savez(out, logits=np.stack(logits), variant=np.array(variant))


if __name__ == "__main__":
    main(*sys.argv[1:])
