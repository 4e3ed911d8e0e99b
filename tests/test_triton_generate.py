"""transformers' generate through the Triton kernels (aqua_export/kernels/triton/generate.py): on the GPU when
there is one, else in Triton's CPU interpreter. tools/bench_gpu_generate.py's checks are the parity gates: dense,
k = d and a token budget covering the context agree with transformers' own SDPA within float32 noise (measured
4e-7 relative); k = d/2 and a budget under the context must differ (the kernels' selection really ran)."""

import pytest
import torch

from tools.bench_gpu_generate import checks, model_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_generate_matches_sdpa_and_approximate_settings_differ():
    lines = checks(DEVICE, torch.float32, length=160, new=3)
    exact = [x for x in lines if not x.endswith("(approximate)")]
    assert len(exact) == 6 and all(x.endswith(" ok") for x in exact), lines
    assert sum(", greedy " in x for x in exact) == 3, lines  # the device-length step (greedy's) checked too
    approx = [float(x.split("relative error ")[1].split()[0]) for x in lines if x.endswith("(approximate)")]
    assert len(approx) == 4 and min(approx) > 1e-3, lines  # far above the 4e-7 noise: coordinates / pages dropped


def test_a_prompt_past_the_cache_is_refused():
    from aqua_export.kernels.triton.generate import GpuSetting, attention_on

    model = model_of(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=100), torch.float32, DEVICE)
    ids = torch.randint(0, 100, (1, 40), device=DEVICE)
    with attention_on(model, GpuSetting("fused k=8", k=8), 1, 30) as cache, torch.no_grad():
        model(ids[:, :30], past_key_values=cache, use_cache=True)  # fills it exactly
        with pytest.raises(ValueError, match="31 positions do not fit the cache's 30"):
            model(ids[:, 30:31], past_key_values=cache, use_cache=True)
    assert model.config._attn_implementation == "sdpa"  # restored on exit


def _small(seed: int = 0):
    return model_of(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100), torch.float32, DEVICE, seed=seed)


def test_greedy_is_the_same_across_bucket_boundaries():
    """greedy's graphs are per bucket of positions: a step's answer must not depend on where its bucket ends (the
    kernels attend up to the bucket's end, the mask hiding the slots not written yet)."""
    from aqua_export.kernels.triton.generate import GpuSetting, attention_on, greedy
    from aqua_export.kernels.triton.tokens import Tokens

    model = _small()
    ids = torch.randint(0, 100, (2, 70), device=DEVICE)
    runs = []
    for setting in (GpuSetting("dense SDPA"), GpuSetting("tokens", k=4, tokens=Tokens(budget=32, sink=4, window=8))):
        for bucket in (4, 256):
            with attention_on(model, setting, 2, 80) as cache, torch.no_grad():
                model(ids[:, :-1], past_key_values=cache, use_cache=True)
                runs.append(greedy(model, cache, ids[:, -1:], 7, bucket=bucket, logits=True))
                assert cache.layers[0].slot.seen == 76  # the 69 prompt positions and the 7 written
    for a, b in (runs[:2], runs[2:]):
        assert torch.equal(a.tokens, b.tokens)
        assert ((a.logits - b.logits).norm() / b.logits.norm()).item() < 1e-5  # float32 noise: 4e-7 measured
    assert not torch.allclose(runs[0].logits, runs[2].logits, rtol=1e-3)  # token selection really chose pages


def test_greedy_past_the_cache_is_refused():
    from aqua_export.kernels.triton.generate import GpuSetting, attention_on, greedy

    model = _small()
    ids = torch.randint(0, 100, (1, 20), device=DEVICE)
    with attention_on(model, GpuSetting("fused k=8", k=8), 1, 24) as cache, torch.no_grad():
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="25 positions do not fit the cache's 24"):
            greedy(model, cache, ids[:, -1:], 6)


def test_a_taken_over_cache_decodes_as_its_own_prefill():
    """attention_on(prefilled=...) projects an earlier setting's keys (K^ = K P) instead of prefilling again: the
    decode from it must match the setting's own prefill within float32 noise (dense -> projected -> dense)."""
    from aqua_export.kernels.triton.generate import GpuSetting, attention_on, greedy

    model = _small(seed=1)
    ids = torch.randint(0, 100, (2, 40), device=DEVICE)
    dense, fused = GpuSetting("dense SDPA"), GpuSetting("fused k=16", k=16)  # k = d: exact
    got = {}
    with torch.no_grad():
        for name, chain in (("own", [fused]), ("taken", [dense, fused, dense])):
            cache = None
            for i, setting in enumerate(chain):
                with attention_on(model, setting, 2, 44, prefilled=cache) as cache:
                    if i == 0:
                        model(ids[:, :-1], past_key_values=cache, use_cache=True)
                    for layer in cache.layers:
                        layer.slot.seen = 39
                    got[name, setting.name] = greedy(model, cache, ids[:, -1:], 4, logits=True).logits
    ref = got["own", "fused k=16"]
    for key in (("taken", "fused k=16"), ("taken", "dense SDPA")):
        assert ((got[key] - ref).norm() / ref.norm()).item() < 1e-5, key


def test_a_sparse_prompt_keeps_every_block_near_1_and_drops_blocks_below():
    """A projected setting's sparse prefill: its prompt goes through aqua_attention's page lists. At a threshold a
    hair under 1 every block of the random model's diffuse attention is kept, so the prompt's logits are dense SDPA's
    within float32 noise (the plumbing: scale, P, the lists of each query block); at 0.5 blocks are dropped and the
    logits move far past that noise."""
    from aqua_export.kernels.triton.generate import GpuSetting, attention_on
    from aqua_export.kernels.triton.prefill import Prefill

    model = model_of(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=100), torch.float32, DEVICE)
    ids = torch.randint(0, 100, (1, 384), device=DEVICE)  # query blocks 0-3 sparse, 4-5 the dense tail
    logits = {}
    for setting in (GpuSetting("dense SDPA"), GpuSetting("near 1", k=16, prefill=Prefill(1 - 1e-7)),
                    GpuSetting("half", k=16, prefill=Prefill(0.5))):
        with attention_on(model, setting, 1, 384) as cache, torch.no_grad():
            logits[setting.name] = model(ids, past_key_values=cache, use_cache=True).logits
    ref = logits["dense SDPA"]
    assert ((logits["near 1"] - ref).norm() / ref.norm()).item() < 1e-5  # float32 noise
    assert ((logits["half"] - ref).norm() / ref.norm()).item() > 1e-3
    with pytest.raises(ValueError, match="give the setting a k"):
        GpuSetting("no P", prefill=Prefill(0.5))
