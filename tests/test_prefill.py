"""Sparse prefill (AquaConfig.prefill_threshold): a tiny model's folder, prefilled through the sparse prompt path on
the native kernel and the function body, against the PyTorch reference making its own block choice
(reference.attention, ops.rules.prefill_chosen); and the choice changes the answer (the tests can fail)."""

import pytest
import torch
from conftest import CharTokenizer
from helpers import folder_cfg

from aqua_export import models
from aqua_export.config import AquaConfig
from aqua_export.export.exporter import export_onnx
from aqua_export.parity.harness import run_parity
from aqua_export.runtime.session import native_library

# a random tiny model attends evenly: half the estimated mass leaves blocks out where 0.98 of a trained one does
CONFIG = AquaConfig(k_ratio=0.5, prefill_threshold=0.5, prefill_stride=2)
PROMPT = 448  # query blocks 0-4 are sparse: the last 128 rows of the call attend densely


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import tiny_projection

    m = models.tiny_model("llama")
    tmp = tmp_path_factory.mktemp("prefill")
    return m, tiny_projection(m, tmp), tmp


@pytest.mark.parametrize("kernel", ["function", "native"])
def test_a_sparse_prompt_matches_the_reference(tiny, kernel):
    """The prompt's logits and the decode steps after it: ONNX Runtime against the reference, each side choosing its
    own blocks (a float near-tie of the threshold would show here as a failed gate)."""
    if kernel == "native" and native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    m, proj, tmp = tiny
    path = tmp / f"{kernel}.onnx"
    export_onnx(m, proj, CONFIG, path)
    res = run_parity(path, folder_cfg(m, CONFIG), CharTokenizer(), proj, CONFIG, m, prompt_tokens=PROMPT, steps=4,
                     kernel=kernel)
    assert res["pass"], res
    assert res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-4


def test_the_block_choice_changes_the_answer(tiny):
    """The reference with sparse prefill differs from its dense prompt on the rows of sparse blocks, and equals it on
    the call's last 128 rows' inputs only through the earlier layers (the rows themselves attend densely)."""
    from aqua_export.reference.attention import apply_aqua

    m, proj, _ = tiny
    ids = torch.randint(0, m.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with apply_aqua(m, proj, AquaConfig(k_ratio=0.5)):
            dense = m(ids).logits
        with apply_aqua(m, proj, CONFIG):
            sparse = m(ids).logits
    assert (sparse[0, :64] - dense[0, :64]).abs().max() == 0  # block 0 sees only its own (forced) block
    assert (sparse[0, 64:320] - dense[0, 64:320]).abs().max() > 1e-3
