"""transformers' generate through the Triton kernels (aqua_export/kernels/triton/generate.py): on the GPU when
there is one, else in Triton's CPU interpreter. tools/bench_gpu_generate.py's checks are the parity gates: dense,
k = d and a token budget covering the context agree with transformers' own SDPA within float32 noise (measured
4e-7 relative); k = d/2 and a budget under the context must differ (the kernels' selection really ran)."""

import pytest
import torch

from tools.bench_gpu_generate import checks, model_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_generate_matches_sdpa_and_approximate_settings_differ():
    lines = checks(DEVICE, torch.float32, length=160, new=2)
    exact = [x for x in lines if not x.endswith("(approximate)")]
    assert len(exact) == 3 and all(x.endswith(" ok") for x in exact), lines
    approx = [float(x.split("relative error ")[1].split()[0]) for x in lines if x.endswith("(approximate)")]
    assert len(approx) == 2 and min(approx) > 1e-3, lines  # far above the 4e-7 noise: coordinates / pages dropped


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
