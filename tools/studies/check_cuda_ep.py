"""The exported TopKGatherDot node (its portable function body) on ONNX Runtime's CUDA provider, when the
installed onnxruntime has one: float32 and float16 against the PyTorch reference. Run on a GPU machine."""

from __future__ import annotations


import numpy as np
import torch



def main(argv: list[str] | None = None) -> None:
    import onnxruntime as ort

    from aqua_export.ops import topk_gather_dot

    provs = ort.get_available_providers()
    print(f"onnxruntime {ort.__version__}: {provs}")
    if "CUDAExecutionProvider" not in provs:
        print("no CUDA execution provider in this onnxruntime build: nothing to check")
        return
    gen = torch.Generator().manual_seed(0)
    for dt, tol in (("float32", 1e-5), ("float16", 2e-3)):
        sess = ort.InferenceSession(topk_gather_dot.OP.model(dt, k=48).SerializeToString(),
                                    providers=["CUDAExecutionProvider"])
        q = torch.randn(2, 8, 4, 3, 64, generator=gen)
        kc = torch.randn(2, 8, 64, 1000, generator=gen)
        npdt = np.float32 if dt == "float32" else np.float16
        got = sess.run(None, {"query_hat": q.numpy().astype(npdt), "key_cache": kc.numpy().astype(npdt),
                              "total_length": np.array([kc.shape[-1]])})[0].astype(np.float64)
        ref = topk_gather_dot.reference(q.to(torch.float16 if dt == "float16" else torch.float32).double(),
                                        kc.to(torch.float16 if dt == "float16" else torch.float32).double(), k=48).numpy()
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print(f"CUDA provider, function body, {dt}: relative error {rel:.1e} ({'ok' if rel < tol else 'FAIL'}), "
              f"ran on {sess.get_providers()[0]}")


if __name__ == "__main__":
    main()
