"""Parity: a built folder in ONNX Runtime against the PyTorch reference and HF transformers, gated by bounds set
from the noise they measure.

    harness   run_parity: the runs (every ONNX Runtime session, then the reference) on one prompt and fed tokens
    gates     the comparisons and their bounds (TOLERANCE, NOISE_FACTOR's use)
    probe     the instruments passed to the reference (ReplayProbe) and to the runtime (RuntimeRecorder)
    report    parity.json in words
"""
