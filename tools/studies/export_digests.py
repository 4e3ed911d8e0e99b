"""What a user sees of a build, as digests to compare across two checkouts: the exported model.onnx of a tiny model
under each build option and mechanism, and default folder names. A structural change must leave them all equal
(issue 66: run it in a worktree of the commit before and in the one after, then diff the two outputs).

    python -m tools.studies.export_digests > after.json     # and the same in the other checkout

Prints one JSON object (case -> the first 16 hex digits of model.onnx's sha256; folder name -> ""). Nothing is written
under benchmarks/: the record is the diff, stated where the change is.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path


def _projection(model, folder: Path):
    """A projection calibrated on 3 random sequences of 48 tokens (seed 0): the tests' tiny one."""
    import torch

    from aqua_export import calibrate
    from aqua_export import projection as artifact
    from aqua_export.models import attention_geometry, fingerprint

    ids = torch.randint(3, model.config.vocab_size, (3, 48), generator=torch.Generator().manual_seed(0))
    geo = attention_geometry(model)
    mom = calibrate.Moments.zeros(geo["layers"], geo["kv_heads"], geo["head_dim"])
    with torch.no_grad(), calibrate.recording(model, mom):
        model(input_ids=ids, use_cache=False)
    meta = {"format_version": artifact.FORMAT_VERSION, "fingerprint": json.dumps(fingerprint(model), sort_keys=True)}
    artifact.write(folder / "projection.safetensors", calibrate.projection_tensors(mom), meta)
    return artifact.load_projection(folder / "projection.safetensors")


def main() -> None:
    import torch

    from aqua_export import models
    from aqua_export.build import default_out
    from aqua_export.config import AquaConfig
    from aqua_export.export.exporter import export_onnx
    from aqua_export.quantize import WeightFormat

    try:
        from aqua_export.options import BuildOptions
    except ImportError:  # before issue 66 the build options lived in build.py
        from aqua_export.build import BuildOptions

    m = models.tiny_model("llama")
    tmp = Path(tempfile.mkdtemp())
    proj = _projection(m, tmp)
    cases = {"dense": (AquaConfig(), {}), "k0.5": (AquaConfig(k_ratio=0.5), {}),
             "kv-f16": (AquaConfig(k_ratio=0.5), dict(cache_dtype="float16")),
             "kv-int8": (AquaConfig(k_ratio=0.5, token_budget=32, selection="group-weighted"),
                         dict(cache_dtype="int8")),
             "int4": (AquaConfig(k_ratio=0.5), dict(weights=WeightFormat(bits=4))),
             "int8w-zp": (AquaConfig(k_ratio=0.5), dict(weights=WeightFormat(bits=8, symmetric=False,
                                                                             accuracy_level=0))),
             "standard": (AquaConfig(k_ratio=0.5), dict(ops="standard")),
             "f16": (AquaConfig(k_ratio=0.5), dict(dtype=torch.float16)),
             "h2o": (AquaConfig(k_ratio=0.5, h2o_ratio=0.5), {}),
             "prefill": (AquaConfig(k_ratio=0.5, prefill_threshold=0.9), {}),
             "alloc": (AquaConfig(k_ratio=0.5, k_alloc="energy"), {}),
             "trt": (AquaConfig(k_ratio=0.5), dict(fused=False))}
    out = {}
    for name, (cfg, kw) in cases.items():
        p = tmp / name / "model.onnx"
        p.parent.mkdir()
        export_onnx(m, proj, cfg, p, **kw)
        out[name] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    names = [(AquaConfig(k_ratio=0.5), BuildOptions(weights=WeightFormat(bits=4, block=64, symmetric=False,
                                                                          accuracy_level=0), cache_dtype="int8")),
             (AquaConfig(), BuildOptions(runtime="tensorrt", trt_limits=(1, 2, 3), dtype="float16")),
             (AquaConfig(k_ratio=0.75, token_budget=512), BuildOptions(ops="standard", cache_dtype="float32")),
             (AquaConfig(k_ratio=0.75, prefill_threshold=0.98), BuildOptions(cache_dtype="float16",
                                                                              weights=WeightFormat(bits=4)))]
    out.update({str(default_out("m", cfg, o)): "" for cfg, o in names})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
