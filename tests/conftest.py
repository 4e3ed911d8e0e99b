import os

import pytest
import torch

# two threads, or one in each of make test's two processes (pytest-xdist) so that they do not oversubscribe the cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # Triton's language follows the interpreter setting of its first import: without a GPU every Triton kernel in
    # this session runs interpreted (ahead-of-time compilation is tested in a process of its own)
    os.environ.setdefault("TRITON_INTERPRET", "1")


# make test's two processes take whole modules (pytest-xdist's loadfile) in collection order (make test turns off
# xdist's reordering by test count, which put the slow modules of few tests last): the long modules first, longest
# first, so the short ones fill the end and neither process idles while the other runs a long module. Measured
# with --durations on 2 cores; a module not listed keeps its place after these.
LONG_MODULES = ["test_ops", "test_triton_compile", "test_build", "test_lm_eval_model", "test_genai", "test_reliability", "test_h2o",
                "test_cache_types", "test_cli", "test_bench", "test_portability", "test_calibrate", "test_parity",
                "test_attention", "test_misuse", "test_quantize"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept


class CharTokenizer:
    """A tiny offline tokenizer for the tiny random models: one id per character (ids 3..127)."""

    pad_token = "<pad>"
    eos_token = "<eos>"
    pad_token_id = 0
    eos_token_id = 2
    padding_side = "right"

    def _enc(self, s):
        return [3 + (ord(c) % 125) for c in s]

    def __call__(self, text, add_special_tokens=False, return_attention_mask=True, return_tensors=None, padding=False):
        if isinstance(text, str):
            return {"input_ids": self._enc(text)}
        seqs = [self._enc(t) for t in text]
        n = max(len(s) for s in seqs)
        ids, mask = [], []
        for s in seqs:
            pad = [0] * (n - len(s))
            if self.padding_side == "left":
                ids.append(pad + s)
                mask.append([0] * len(pad) + [1] * len(s))
            else:
                ids.append(s + pad)
                mask.append([1] * len(s) + [0] * len(pad))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


@pytest.fixture
def char_tok():
    return CharTokenizer()


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct (float32), loaded once per test session."""
    from aqua_export import models

    return models.load("llama")


@pytest.fixture(scope="session")
def smollm_projection(smollm, tmp_path_factory):
    from aqua_export import calibrate
    from aqua_export import projection as artifact

    model, tok = smollm
    tensors, meta = calibrate.calibrate(model, tok, texts=["builtin:python-reference"], tokens=2048, seq_len=256,
                                        progress=False)
    path = tmp_path_factory.mktemp("proj") / "smollm.safetensors"
    artifact.write(path, tensors, meta)
    return artifact.load_projection(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(model, projection): the tiny random llama (models.tiny_model("llama")) and a projection calibrated on it,
    made once per test process. Read-only: a test that changes the weights or the config makes its own."""
    from helpers import tiny_projection

    from aqua_export import models

    m = models.tiny_model("llama")
    return m, tiny_projection(m, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def proj(tmp_path, smollm_projection):
    """The session's SmolLM2 projection as a file (a build reuses it instead of calibrating)."""
    from aqua_export.projection import write

    path = tmp_path / "proj.safetensors"
    write(path, smollm_projection.tensors(), smollm_projection.metadata)
    return path
