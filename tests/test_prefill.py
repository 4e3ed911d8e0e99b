"""Sparse prefill (AquaConfig.prefill_threshold): a tiny model's folder, prefilled through the sparse prompt path on
the native kernel and the function body, against the PyTorch reference (reference.attention, ops.rules.prefill_chosen)
under ORT's block choice, replayed, and making its own; the replay is what the reference attends, and the choice
changes the answer (the tests can fail)."""

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
    """The prompt's logits and the decode steps after it: ONNX Runtime against the reference under ORT's block
    choice (the graph's kept keys replayed) and each side choosing its own (a float near-tie of the threshold would
    show as a differing row in the block gate)."""
    if kernel == "native" and native_library() is None:
        pytest.skip("native kernel not built (run `make plugin`)")
    m, proj, tmp = tiny
    path = tmp / f"{kernel}.onnx"
    export_onnx(m, proj, CONFIG, path)
    res = run_parity(path, folder_cfg(m, CONFIG), CharTokenizer(), proj, CONFIG, m, prompt_tokens=PROMPT, steps=4,
                     kernel=kernel)
    assert res["pass"], res
    assert res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-4
    blocks = res["prefill_blocks"]  # the reference replayed ORT's block choice: the gate saw sparse rows
    assert blocks["rows"] > 0 and blocks["pass"], blocks


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


def test_a_replayed_block_choice_is_attended_and_gated(tiny):
    """The reference attends the key blocks the probe replays, not its own: replaying "every block kept" gives the
    dense prompt's logits, and the block gate counts those rows as differing by far more than a near-tie."""
    import numpy as np

    from aqua_export.parity.harness import torch_trace
    from aqua_export.parity.probe import ReplayProbe
    from aqua_export.reference.attention import apply_aqua

    m, proj, _ = tiny
    ids = torch.randint(0, m.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1)).numpy()
    layers, hkv = m.config.num_hidden_layers, m.config.num_key_value_heads
    every = [[np.ones((1, hkv, PROMPT, PROMPT), dtype=bool) for _ in range(layers)]]
    probe = ReplayProbe(prefill_blocks=every)
    with torch.no_grad():
        with apply_aqua(m, proj, CONFIG, probe=probe, token_rows_from=PROMPT) as aqua:
            replayed = torch_trace(m, ids, [], aqua.new_cache(), probe)[0]
        with apply_aqua(m, proj, AquaConfig(k_ratio=0.5), token_rows_from=PROMPT) as aqua:
            dense = torch_trace(m, ids, [], aqua.new_cache())[0]
    assert np.abs(replayed - dense).max() < 1e-9
    summary = probe.prefill_blocks_summary(None, 1e-4)
    assert summary["rows_differing"] > 0 and summary["max_gap_of_differing"] > 1e-2 and not summary["pass"], summary
    assert not ReplayProbe().prefill_blocks_summary(None, 1e-4)["pass"]  # no sparse row seen: not exercised, not a pass


def test_the_parity_prompt_is_long_enough_to_choose_blocks():
    """A 256-token parity prompt's sparse rows see only forced blocks (query block 1: its sink and its diagonal), so
    the block gate would say "not exercised": parity lengthens it to the third block plus the dense tail."""
    from aqua_export.parity.harness import prompt_length

    assert prompt_length(CONFIG, 256, 4, None) == 320
    assert prompt_length(CONFIG, 512, 4, None) == 512
    assert prompt_length(CONFIG, 16, 2, 100) == 98  # within the context, the steps' positions kept free


def test_a_bfloat16_prompt_passes_parity_and_rounds_where_the_cpu_has_it(tiny):
    """--prompt-precision bfloat16 with sparse prefill: parity passes (the export gated with the prompt in float32,
    the bfloat16 native kernel by top-1 against the function body), and the folder's prompt logits differ from the
    float32 folder's exactly where the kernel runs bfloat16 (runtime.session.prompt_bf16_runs), by a bfloat16
    rounding's worth."""
    import dataclasses

    import numpy as np

    from aqua_export.runtime.lm import OrtLM
    from aqua_export.runtime.session import native_variant, prompt_bf16_runs

    if native_library() is None or not native_variant():
        pytest.skip("native kernel not built (run `make plugin`)")
    m, proj, tmp = tiny
    bf16 = dataclasses.replace(CONFIG, prompt_precision="bfloat16")
    logits = {}
    for name, cfg in (("float32", CONFIG), ("bfloat16", bf16)):
        path = tmp / f"precision-{name}.onnx"
        export_onnx(m, proj, cfg, path)
        if name == "bfloat16":
            res = run_parity(path, folder_cfg(m, cfg), CharTokenizer(), proj, cfg, m, prompt_tokens=PROMPT, steps=4,
                             kernel="native")
            assert res["pass"], res
        lm = OrtLM.open(path, folder_cfg(m, cfg), kernel="native", all_logits=True)
        ids = np.random.default_rng(0).integers(0, m.config.vocab_size, (1, PROMPT))
        logits[name] = lm.prefill(ids, np.ones_like(ids))[0]
    gap = float(np.abs(logits["bfloat16"] - logits["float32"]).max())
    if prompt_bf16_runs():
        assert 1e-4 < gap < 0.5, gap
    else:
        print("no AVX512_BF16 here (or not the AVX-512 variant): the bfloat16 folder computes float32")
        assert gap == 0.0, gap
