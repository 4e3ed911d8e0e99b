"""aqua-export: AQUA attention (Attention via QUery mAgnitudes) for Hugging Face decoder LLMs, exported to ONNX and
served by ONNX Runtime, onnxruntime-genai and TensorRT.

The pipeline, each stage pointing down only (docs/design.md, Where each thing lives):

    models, archs/      loading any supported checkpoint; one adapter per decoder family
    calibrate           P from the second moments of the post-RoPE queries and keys -> projection (the artifact)
    reference/          the PyTorch AQUA (apply_aqua), the precision a model computes in
    export/             the graph contract and the ONNX decoder built from the weights
    ops/                the custom nodes and the rules every implementation mirrors
    kernels/            the Triton kernels (the C++ ones: plugins/ort)
    runtime/            serving a built folder (ONNX Runtime, onnxruntime-genai, TensorRT)
    parity/             a folder against the reference and HF, bounds from measured noise
    build, evaluate, bench, lm_eval_model, cli / commands
"""

__version__ = "0.1.0"



def __getattr__(name: str):
    """aqua_export.AquaConfig / ConfigError, imported when first asked for: a mechanism declared outside settings/
    registers before AquaConfig derives its fields (settings.register)."""
    if name in ("AquaConfig", "ConfigError"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'aqua_export' has no attribute {name!r}")
