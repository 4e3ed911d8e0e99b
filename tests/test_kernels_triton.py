"""What only the Triton kernels have (their op cases are the catalogue's, test_ops.py): the host's launch shapes,
flash-decoding splits that merge exactly, sparse prefill's block lists against the rule, and the kernels on a real GPU
when there is one."""

import pytest
import torch
from helpers import attention_inputs
from implementations import IMPLEMENTATIONS

from aqua_export.ops import aqua_attention as attention_op
from aqua_export.ops import rules

if IMPLEMENTATIONS["triton"].unavailable():
    pytest.skip(IMPLEMENTATIONS["triton"].unavailable(), allow_module_level=True)

from aqua_export.kernels.triton.aqua_attention import aqua_attention, split_count  # noqa: E402
from aqua_export.kernels.triton.tokens import Tokens, choose  # noqa: E402
from aqua_export.kernels.triton.h2o_attention import block_s  # noqa: E402
from aqua_export.kernels.triton.topk_gather_dot import block_sizes, topk_gather_dot  # noqa: E402
from aqua_export.ops.spec import GROUP

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_block_sizes():
    assert block_sizes(64, 16384) == (64, 128)
    assert block_sizes(48, 5) == (64, 16)
    assert block_sizes(8, 7) == (8, 16)
    assert block_s(40) == 64 and block_s(10) == 16 and block_s(5000) == 64  # H2O: slots per block


def test_split_count_fills_the_gpu_and_keeps_whole_blocks():
    assert split_count(8 * 8, 16384, 64) == 17  # Llama-3.1-8B at batch 8: 64 programs -> 17 splits each
    assert split_count(2000, 16384, 16) == 1  # enough programs already
    assert split_count(1, 40, 16) == 3  # never more splits than blocks


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_attention_splits_merge_exactly(splits):
    """Any split of the positions merges to the same result (the split count is the host's choice)."""
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 32, 500, 512))
    got = aqua_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), length, mask.to(DEV), 16, 1, splits=splits).cpu()
    want = attention_op.reference(q.double(), kc.double(), vc.double(), length, mask, k=16, rule=GROUP)
    assert (got.double() - want).abs().max() <= 2e-5


def test_many_splits_merge_in_chunks():
    """63 splits: more than merge_kernel's 32 per chunk (batch 1 at long contexts has ~100)."""
    q, kc, vc, length, mask = attention_inputs((1, 2, 3, 1, 32, 2000, 2000))
    got = aqua_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), length, mask.to(DEV), 16, 1, splits=100, block=16).cpu()
    want = attention_op.reference(q.double(), kc.double(), vc.double(), length, mask, k=16, rule=GROUP)
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
    from aqua_export.kernels.triton.aqua_attention import aqua_attention_kernel, merge_kernel
    from aqua_export.kernels.triton.h2o_attention import evict_kernel, heavy_kernel, score_kernel, tables_kernel
    from aqua_export.kernels.triton.h2o_attention import merge_kernel as h2o_merge_kernel
    from aqua_export.kernels.triton.prompt import prompt_kernel
    from aqua_export.kernels.triton.select import jit, select_kernel
    from aqua_export.kernels.triton.tokens import choose_kernel, page_score_kernel
    from aqua_export.kernels.triton.topk_gather_dot import topk_gather_dot_kernel

    h2o_kernels = (tables_kernel, score_kernel, h2o_merge_kernel, heavy_kernel, evict_kernel)
    for raw in (select_kernel, aqua_attention_kernel, merge_kernel, prompt_kernel, page_score_kernel, choose_kernel,
                *h2o_kernels, topk_gather_dot_kernel):
        compiled, _ = jit(raw, False)
        declared = {n for n, a in raw.__annotations__.items() if "constexpr" in str(a)}
        assert declared and {p.name for p in compiled.params if p.is_constexpr} == declared, raw.__name__


@pytest.mark.parametrize("tokens", [Tokens(0.125, 0, 16, 64), Tokens(1.0, 40, 0, 0), Tokens(0.5, 0, 33, 0),
                                    Tokens(0.3, 0, 0, 17)])
def test_choose_kernel_is_the_page_rule(tokens):
    """choose_kernel (on the device, no host sync) chooses exactly rules.select_pages' pages, on ragged masks, with
    ties among the scores (integer-valued) and -0.0 against +0.0, and its list (most_pages long) cuts none."""
    gen = torch.Generator().manual_seed(3)
    for total in (1, 15, 16, 17, 300, 1000):
        mask = torch.zeros(3, 1, 1, 1, total)
        mask[1, ..., :total // 2] = float("-inf")
        mask[2, ..., 3:total // 3] = float("-inf")
        visible = (mask[:, 0, 0, 0] > rules.MASKED)[:, None].expand(3, 2, total)
        n_pages = -(-total // 16)
        best = torch.randint(-3, 4, (3, 2, n_pages), generator=gen).float()
        best[best == 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (int((best == 0).sum()),), generator=gen)]
        count = rules.from_origin(visible, visible, False).int().reshape(3, 2, n_pages, 16).sum(-1)  # from the origin
        best = best.masked_fill(count == 0, float("-inf"))
        got = choose(best.reshape(6, -1).to(DEV), count.reshape(6, -1).int().to(DEV), tokens, total,
                     interpret=DEV == "cpu").cpu()
        forced = rules.forced_pages(visible, tokens.sink, tokens.window)
        want = rules.select_pages(best, forced, rules.tokens_attended(visible, tokens.ratio, tokens.budget))
        chosen = torch.zeros(6, n_pages + 1, dtype=torch.bool)
        chosen.scatter_(1, torch.where(got >= 0, got, n_pages).long(), True)
        assert torch.equal(chosen[:, :n_pages], want.reshape(6, -1)), (tokens, total)
        assert all(torch.equal(row[row >= 0], row[row >= 0].sort().values) for row in got)  # ascending


def test_h2o_tables_are_the_rules():
    """tables_kernel's prefix sums (in blocks, carried) and budgets equal rules.budget over the cumulative real
    tokens, for a ratio that float32 would round (0.3) and a mask longer than a block."""
    from aqua_export.kernels.triton.h2o_attention import slot_tables

    gen = torch.Generator().manual_seed(6)
    mask = (torch.rand(3, 20000, generator=gen) > 0.2).long()
    mask[1, :700] = 0
    for ratio in (0.3, 0.5, 1.0):
        before, keep = (x.cpu() for x in slot_tables(mask.to(DEV), ratio, interpret=DEV == "cpu"))
        want = torch.nn.functional.pad(mask.cumsum(1), (1, 0))
        assert torch.equal(before, want)
        assert torch.equal(keep, rules.budget(ratio, want[:, 1:]))


@pytest.mark.parametrize("shape,window", [((2, 2, 3, 560, 32, 600, 640), 0), ((1, 2, 4, 700, 16, 700, 700), 200)])
def test_prefill_lists_are_the_rules_blocks_in_any_chunking(shape, window, monkeypatch):
    """block_lists (on the device, float32, in chunks of sampled rows) keeps exactly the key blocks
    rules.prefill_choice keeps in float64 for every sparse query block, among those its rows can see (left padding, a
    chunk starting mid-block, a sliding window), and every visible block for the call's dense ones; one sampled row
    per chunk lists the same."""
    from op_catalogue import _prefill_inputs

    from aqua_export.kernels.triton import prefill
    from aqua_export.ops import prefill as prefill_op
    from aqua_export.ops.spec import PREFILL_BLOCK

    q, kc, _, total, mask = _prefill_inputs(shape)
    total = int(total)
    b, hkv, g, t, r = q.shape
    setting = prefill.Prefill(0.9, 4, 0.5)
    lists, counts, nbq = prefill.block_lists(q.to(DEV), kc.to(DEV), mask.to(DEV).int(), total, window, 0.0, setting)
    allowed = prefill_op.choice(q.double(), kc[..., :total].unsqueeze(2).double(), rules.additive_mask(mask, t, window),
                                mask, 0.0, setting.threshold, setting.stride, setting.k_ratio)  # [B, Hkv, T, L]
    nb = -(-total // PREFILL_BLOCK)
    first = (total - t) // PREFILL_BLOCK
    listed = lists.cpu().long()
    assert torch.equal((listed >= 0).sum(1), counts.cpu().long())
    assert bool((listed[listed >= 0] % PREFILL_BLOCK == 0).all())  # first slots of blocks
    at_block = torch.where(listed >= 0, listed // PREFILL_BLOCK, nb)
    got = torch.zeros(b * hkv * nbq, nb + 1, dtype=torch.bool).scatter_(1, at_block, True)[:, :nb]
    got = got.reshape(b, hkv, nbq, nb)
    visible = rules.visible(mask, t, window)  # [B, T, L]
    n_sparse = 0
    for qb in range(nbq):
        rows = torch.arange(max((first + qb) * PREFILL_BLOCK, total - t), min((first + qb + 1) * PREFILL_BLOCK, total))
        at = rows - (total - t)
        seen = rules.key_blocks(visible[:, at].any(1).double(), nb) > 0  # [B, NB]: what the rows can see
        want = rules.key_blocks(allowed[:, :, at].any(2).double(), nb) > 0  # [B, Hkv, NB]
        assert not bool((got[:, :, qb] & ~(torch.arange(nb) <= first + qb)).any())  # nothing after the diagonal
        assert torch.equal(got[:, :, qb] & seen[:, None], want), qb
        dropped = not torch.equal(want, seen[:, None].expand_as(want))
        n_sparse += int(bool(rules.prefill_rows(rows, total - t, total).all()) and dropped)
    assert n_sparse >= 2  # query blocks whose choice dropped a block the rows see
    monkeypatch.setattr(prefill, "ESTIMATE_ELEMENTS", 1)
    again = prefill.block_lists(q.to(DEV), kc.to(DEV), mask.to(DEV).int(), total, window, 0.0, setting)
    assert torch.equal(again[0], lists) and torch.equal(again[1], counts)
