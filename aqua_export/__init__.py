"""aqua-export: AQUA attention (Attention via QUery mAgnitudes) for Hugging Face decoder LLMs.

Pipeline stages, one module each: ``models`` (registry + loading), ``calibrate`` (P from
second moments), ``fold`` (exact weight folds), ``attention`` (the PyTorch reference),
``evaluate`` (perplexity, retention), ``cli``.
"""

__version__ = "0.1.0"

from .config import AquaConfig, ConfigError  # noqa: F401
