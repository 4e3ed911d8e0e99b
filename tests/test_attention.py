import math
from types import SimpleNamespace

import pytest
import torch
from helpers import left_padded, tiny_projection

from aqua_export import models
from aqua_export.archs import ADAPTERS
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.ops.rules import h2o_keep
from aqua_export.reference.attention import LayerAqua, apply_aqua, aqua_attention

ARCHS = sorted(ADAPTERS)


# ---------------------------------------------------------------------------------------------
# A naive per-head loop of Algorithm 1, written independently of the vectorised reference
# ---------------------------------------------------------------------------------------------

def naive_algorithm1(q, k, v, P, kk, pad, scaling, selection="magnitude", key_rms=None):
    """q [B,H,T,d], k/v [B,Hkv,T,d], P [Hkv,d,d], pad [B,T] (True = padding). Causal. Returns [B,T,H,d]."""
    B, H, T, d = q.shape
    hkv = k.shape[1]
    g = H // hkv
    out = torch.zeros(B, T, H, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // g
            Pk = P[kv].double()
            for t in range(T):
                if pad[b, t]:
                    continue
                qh = q[b, h, t].double() @ Pk
                if selection == "static":
                    idx = list(range(kk))
                else:
                    w = [abs(float(qh[i])) * (float(key_rms[kv, i]) if selection == "weighted" else 1.0) for i in range(d)]
                    idx = sorted(range(d), key=lambda i: (-w[i], i))[:kk]
                logits, vals = [], []
                for j in range(t + 1):
                    if pad[b, j]:
                        continue
                    kh = k[b, kv, j].double() @ Pk
                    logits.append(scaling * sum(float(qh[i]) * float(kh[i]) for i in idx))
                    vals.append(v[b, kv, j].double())
                m = max(logits)
                ex = [math.exp(x - m) for x in logits]
                z = sum(ex)
                out[b, t, h] = sum(e / z * vv for e, vv in zip(ex, vals))
    return out


def _float_mask(pad, T):
    ok = torch.ones(T, T, dtype=torch.bool).tril()[None] & ~pad[:, None, :]
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("selection", ["magnitude", "static", "weighted"])
@pytest.mark.parametrize("kk", [1, 5, 16])
def test_reference_equals_naive_loop(selection, kk):
    g = torch.Generator().manual_seed(kk)
    B, H, hkv, T, d = 2, 4, 2, 7, 16
    q, k, v = (torch.randn(B, n, T, d, generator=g) for n in (H, hkv, hkv))
    P = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0].float()
    key_rms = torch.rand(hkv, d, generator=g) + 0.1
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :3] = True  # left padding
    st = LayerAqua(P_r=P, r=d, k=kk, d=d, selection=selection, key_rms=key_rms, h2o_ratio=1.0)
    module = SimpleNamespace(_aqua=st)
    out, _ = aqua_attention(module, q, k, v @ torch.eye(d), _float_mask(pad, T), scaling=0.25)
    ref = naive_algorithm1(q, k, v, P, kk, pad, 0.25, selection, key_rms)
    real = ~pad
    assert (out.double()[real] - ref[real]).abs().max() < 1e-5


def test_ties_break_to_lower_index():
    from aqua_export.ops.rules import select_indices

    qh = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0]).reshape(1, 1, 1, 5)
    assert select_indices(qh, 3, "magnitude").flatten().tolist() == [1, 2, 4]
    assert select_indices(qh, 2, "static").flatten().tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------
# k_ratio = 1 reproduces HF; the model is restored afterwards
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_dense_settings_reproduce_hf(arch, tmp_path):
    m = models.tiny_model(arch)
    proj = tiny_projection(m, tmp_path)
    ids, mask = left_padded(128, [20, 13, 9])
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask).logits
        ref_gen = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        state = {k: v.clone() for k, v in m.state_dict().items()}
        before = m.config._attn_implementation
        with apply_aqua(m, proj, AquaConfig()) as aqua:
            out = m(input_ids=ids, attention_mask=mask).logits
            gen = aqua.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
            gen_plain = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)
    real = mask.bool()
    assert (out - ref)[real].abs().max() <= 1e-4
    assert torch.equal(gen, ref_gen) and torch.equal(gen_plain, ref_gen)
    assert m.config._attn_implementation == before
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    arch_ = ADAPTERS[arch]
    assert not hasattr(arch_.attention(arch_.layers(m)[0]), "_aqua")


def _cache_vs_full(m, proj, cfg, ids, mask):
    """Logits of a full forward vs prefill + token-by-token decode through an AquaCache."""
    n_prefill = 6
    with torch.no_grad(), apply_aqua(m, proj, cfg) as aqua:
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        full = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        cache = aqua.new_cache()
        steps = [m(input_ids=ids[:, :n_prefill], attention_mask=mask[:, :n_prefill], position_ids=pos[:, :n_prefill],
                   past_key_values=cache).logits]
        for t in range(n_prefill, ids.shape[1]):
            steps.append(m(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                           past_key_values=cache).logits)
    return full, torch.cat(steps, dim=1), cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", [AquaConfig(k_ratio=0.5), AquaConfig(k_ratio=0.75, slice_ratio=0.25),
                                 AquaConfig(k_ratio=0.5, selection="weighted"),
                                 AquaConfig(k_ratio=0.75, h2o_ratio=0.5)], ids=["std", "memory", "weighted", "h2o"])
def test_cached_decode_equals_full_forward(arch, cfg, tmp_path):
    """Step-by-step decode (real cache, real eviction for H2O) == one forward over the same tokens."""
    m = models.tiny_model(arch)
    proj = tiny_projection(m, tmp_path)
    if cfg.evicts and ADAPTERS[arch].window(m.config, 0):
        with pytest.raises(ConfigError, match="sliding-window layers is not supported"):
            apply_aqua(m, proj, cfg).__enter__()
        return
    ids, mask = left_padded(128, [22, 15])
    full, stepped, cache = _cache_vs_full(m, proj, cfg, ids, mask)
    real = mask.bool()
    assert (full - stepped)[real].abs().max() <= 1e-4
    layer = cache.layers[0]
    r = cfg.retained_width(16)
    assert layer.keys.shape[-1] == r and layer.values.shape[-1] == r
    if cfg.evicts:
        # sequence 0 saw 22 real tokens: ceil(0.5 * 22) = 11 kept, physically
        assert layer.keys.shape[2] == 11
        hkv = models.attention_geometry(m)["kv_heads"]
        assert layer.valid.sum(-1).tolist() == [[11] * hkv, [8] * hkv]
    # and approximation is really on: logits differ from dense
    with torch.no_grad():
        dense = m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    assert (dense - full)[real].abs().max() > 1e-3


def test_memory_cache_is_narrower_in_generate(tmp_path, tiny_llama):
    m, proj = tiny_llama
    ids, mask = left_padded(128, [10, 6])
    with torch.no_grad(), apply_aqua(m, proj, AquaConfig(k_ratio=0.75, slice_ratio=0.25)) as aqua:
        cache = aqua.new_cache()
        out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         eos_token_id=None, past_key_values=cache)
    assert out.shape == (2, 18)
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (2, 2, 17, 12)
        assert tuple(layer.values.shape) == (2, 2, 17, 12)


def test_h2o_evicts_during_generate_and_needs_aqua_cache(tmp_path):
    m = models.tiny_model("qwen2")
    proj = tiny_projection(m, tmp_path)
    ids, mask = left_padded(128, [16, 16])
    with torch.no_grad(), apply_aqua(m, proj, AquaConfig(h2o_ratio=0.25)) as aqua:
        cache = aqua.new_cache()
        m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                   eos_token_id=None, past_key_values=cache)
        # 16 + 15 tokens went through the cache (the last generated token is never fed back)
        assert cache.layers[1].keys.shape[2] == math.ceil(0.25 * 31)
        assert cache.get_seq_length() == 31
        with pytest.raises(ConfigError, match="AQUA-H2O needs an AquaCache"):
            m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_h2o_keep_rule():
    vis = torch.tensor([[[True, True, True, True, True, False]]])
    acc = torch.tensor([[[5.0, 1.0, 5.0, 0.0, 0.0, 9.0]]])
    keep = h2o_keep(vis, acc, torch.tensor([4]))
    # 2 most recent visible (3, 4) + 2 heaviest others (0 and 2 tie at 5.0 -> both), never the invisible slot
    assert keep[0, 0].tolist() == [True, False, True, True, True, False]
    keep = h2o_keep(vis, acc, torch.tensor([3]))
    # budget 3: floor(3/2) = 1 recent (4), 2 heavy (0 and 2)
    assert keep[0, 0].tolist() == [True, False, True, False, True, False]
    keep = h2o_keep(vis, torch.tensor([[[1.0, 5.0, 5.0, 0.0, 0.0, 9.0]]]), torch.tensor([2]))
    assert keep[0, 0].tolist() == [False, True, False, False, True, False]  # tie 1 vs 2 -> lower index


def test_projection_from_another_model_is_refused(tmp_path):
    a, b = models.tiny_model("llama", seed=0), models.tiny_model("llama", seed=1)
    proj = tiny_projection(a, tmp_path)
    before = b.config._attn_implementation
    with pytest.raises(ConfigError, match="another model"):
        with apply_aqua(b, proj, AquaConfig(k_ratio=0.5)):
            pass
    assert b.config._attn_implementation == before


@pytest.mark.slow
def test_embedded_model_dense_parity_and_greedy(smollm, smollm_projection):
    """At k = r the reference is HF's model through an orthogonal P: both float32 forwards are compared with HF's
XX
    own float32 error there), as parity does. Greedy generation is identical (its smallest top-2 margin here,
    1.2e-2, is 200x the logits' float32 error)."""
    from aqua_export.reference.precision import computing_in

    model, tok = smollm
    enc = tok(["The capital of France is", "def fibonacci(n):\n    "], return_tensors="pt", padding=True,
              padding_side="left")
    real = enc["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**enc).logits
        ref_gen = model.generate(**enc, max_new_tokens=32, do_sample=False)
        with computing_in(model, torch.float64):
            exact = torch.cat([model(input_ids=ids[m][None]).logits[0] for ids, m in zip(enc["input_ids"], real)])
        with apply_aqua(model, smollm_projection, AquaConfig()) as aqua:
            out = model(**enc).logits
            gen = aqua.generate(**enc, max_new_tokens=32, do_sample=False)
    bound = max(1e-4, 5 * (ref[real] - exact).abs().max().item())
    assert (out[real] - exact).abs().max() <= bound
    assert torch.equal(gen, ref_gen)
