import pytest
import torch

from aqua_export import models
from aqua_export.archs import ADAPTERS
from aqua_export.config import ConfigError


@pytest.mark.parametrize("arch", sorted(ADAPTERS))
def test_every_registered_architecture_builds_and_fingerprints(arch):
    m = models.tiny_model(arch)
    fp = models.fingerprint(m)
    assert fp["architecture"] == arch and fp["kv_heads"] == (4 if arch == "gpt2" else 2) and fp["head_dim"] == 16
    with torch.no_grad():
        ADAPTERS[arch].attention_linears(ADAPTERS[arch].layers(m)[1])[0][1].weight[0, 0] += 1e-3
    assert models.fingerprint(m)["attention_sha256"] != fp["attention_sha256"]


def test_unsupported_architecture_is_refused():
    from transformers import BloomConfig

    with pytest.raises(ConfigError, match=f"architecture 'bloom' is not supported: aqua-export handles "
                                          f"{', '.join(sorted(ADAPTERS))}$"):
        models.architecture_of(BloomConfig())


def test_missing_local_folder_and_gguf(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        models.resolve(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="does not exist"):
        models.resolve(str(tmp_path / "nope.gguf"))


@pytest.mark.slow
def test_embedded_default_loads_from_cache(smollm):
    model, tok = smollm
    assert models.fingerprint(model)["architecture"] == "llama"
    assert models.attention_geometry(model) == {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "hidden_size": 576}
    folder, name = models.resolve("llama")
    assert (folder / "model.safetensors").exists() and name == "llama"
    assert tok("Hello world")["input_ids"]
