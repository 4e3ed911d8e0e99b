"""What only the Triton kernels have (their op cases are the catalogue's, test_ops.py): the host's launch shapes,
flash-decoding splits that merge exactly, and the kernels on a real GPU when there is one."""

import pytest
import torch
from helpers import attention_inputs
from implementations import IMPLEMENTATIONS

from aqua_export.ops import aqua_attention as attention_op
from aqua_export.ops import rules

if IMPLEMENTATIONS["triton"].unavailable():
    pytest.skip(IMPLEMENTATIONS["triton"].unavailable(), allow_module_level=True)

from aqua_export.kernels.triton.aqua_attention import Tokens, aqua_attention, chosen_pages, split_count  # noqa: E402
from aqua_export.kernels.triton.h2o_attention import block_s  # noqa: E402
from aqua_export.kernels.triton.topk_gather_dot import block_sizes, topk_gather_dot  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_block_sizes():
    assert block_sizes(64, 16384) == (64, 128)
    assert block_sizes(48, 5) == (64, 16)
    assert block_sizes(8, 7) == (8, 16)
    assert block_s(4, 64, 40) == 32  # H2O: r = 64, g = 4: 32 slots per block


def test_split_count_fills_the_gpu_and_keeps_whole_blocks():
    assert split_count(8 * 8, 16384, 64) == 17  # Llama-3.1-8B at batch 8: 64 programs -> 17 splits each
    assert split_count(2000, 16384, 16) == 1  # enough programs already
    assert split_count(1, 40, 16) == 3  # never more splits than blocks


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_attention_splits_merge_exactly(splits):
    """Any split of the positions merges to the same result (the split count is the host's choice)."""
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 32, 500, 512))
    got = aqua_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), length, mask.to(DEV), 16, 1, splits=splits).cpu()
    want = attention_op.reference(q.double(), kc.double(), vc.double(), length, mask, k=16, rule=1)
    assert (got.double() - want).abs().max() <= 2e-5


def test_many_splits_merge_in_chunks():
    """63 splits: more than merge_kernel's 32 per chunk (batch 1 at long contexts has ~100)."""
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 32, 2000, 2000))
    got = aqua_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), length, mask.to(DEV), 16, 1, splits=100, block=16).cpu()
    want = attention_op.reference(q.double(), kc.double(), vc.double(), length, mask, k=16, rule=1)
    assert (got.double() - want).abs().max() <= 2e-5


def test_gpu_present_or_reason():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine: the kernels ran in Triton's CPU interpreter only")
    gen = torch.Generator().manual_seed(0)
    q, kc = torch.randn(2, 3, 3, 1, 64, generator=gen), torch.randn(2, 3, 64, 4096, generator=gen)
    got = topk_gather_dot(q.cuda(), kc.cuda(), 32).cpu()
    from aqua_export.ops.topk_gather_dot import reference

    assert (got - reference(q, kc, k=32)).abs().max() <= 1e-4


def test_compiled_kernels_see_their_constexpr_parameters():
    """The compiled (non-interpreted) binding keeps every kernel's tl.constexpr annotations: without them Triton's
    compiler refuses tl.arange(0, BLOCK) on a GPU, which the CPU interpreter never shows."""
    from aqua_export.kernels.triton.aqua_attention import (aqua_attention_kernel, merge_kernel, page_score_kernel,
                                                           select_kernel)
    from aqua_export.kernels.triton.h2o_attention import h2o_attention_kernel
    from aqua_export.kernels.triton.select import jit
    from aqua_export.kernels.triton.topk_gather_dot import topk_gather_dot_kernel

    for raw in (select_kernel, aqua_attention_kernel, merge_kernel, page_score_kernel, h2o_attention_kernel,
                topk_gather_dot_kernel):
        compiled, _ = jit(raw, False)
        declared = {n for n, a in raw.__annotations__.items() if "constexpr" in str(a)}
        assert declared and {p.name for p in compiled.params if p.is_constexpr} == declared, raw.__name__


@pytest.mark.parametrize("tokens", [Tokens(0.125, 0, 16, 64), Tokens(1.0, 40, 0, 0), Tokens(0.5, 0, 33, 0)])
def test_most_pages_bounds_every_choice(tokens):
    """The host's page count (no device sync) never cuts a row's chosen pages, on ragged masks."""
    gen = torch.Generator().manual_seed(3)
    for total in (1, 15, 16, 17, 300, 1000):
        mask = torch.zeros(3, 1, 1, 1, total)
        mask[1, ..., :total // 2] = float("-inf")
        best = torch.randn(3, 2, -(-total // 16), generator=gen)
        pages = chosen_pages(best, mask, tokens)
        visible = (mask[:, 0, 0, 0] > rules.MASKED)[:, None].expand(3, 2, total)
        forced = rules.forced_pages(visible, tokens.sink, tokens.window)
        want = rules.select_pages(best, forced, rules.tokens_attended(visible, tokens.ratio, tokens.budget))
        assert (pages >= 0).sum(-1).tolist() == want.sum(-1).flatten().tolist()
