"""Architecture adapters: what differs between decoder families, one small file each, registered by the
``model_type`` of the model's config. The export graph, the reference, the folds and the tests ask the
adapter; adding a family is one file here plus its entry in the test catalogue (its tiny config).
"""

from __future__ import annotations

from ..config import ConfigError
from .base import Adapter

ADAPTERS: dict[str, Adapter] = {}


def register(cls):
    ADAPTERS[cls.model_type] = cls()
    return cls


def adapter_for(config) -> Adapter:
    mt = getattr(config, "model_type", None)
    if mt not in ADAPTERS:
        raise ConfigError(f"architecture {mt!r} is not supported: aqua-export handles {', '.join(sorted(ADAPTERS))}")
    adapter = ADAPTERS[mt]
    adapter.check(config)
    return adapter


from . import gemma2, gemma3, gpt2, llama, mistral, olmoe, phi3, qwen2, qwen3  # noqa: E402,F401  (registration)
