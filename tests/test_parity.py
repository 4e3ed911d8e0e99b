"""The parity harness itself, on a tiny model: shared selection, replayed H2O eviction, native vs function body."""

import numpy as np
import pytest
from conftest import CharTokenizer
from helpers import folder_cfg

from aqua_export.config import AquaConfig
from aqua_export.export.exporter import export_onnx
from aqua_export.parity.harness import run_parity
from aqua_export.runtime.lm import OrtLM
from aqua_export.runtime.session import make_session, native_library

KERNEL = "native" if native_library() is not None else "function"



@pytest.fixture(scope="module")
def h2o_export(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("parity")
    m, proj = tiny_llama
    cfg = AquaConfig(k_ratio=0.75, h2o_ratio=0.5)
    proto = export_onnx(m, proj, cfg, tmp / "h2o.onnx")
    return m, proj, cfg, proto, tmp / "h2o.onnx"


def test_h2o_parity_passes_under_replayed_eviction(h2o_export):
    m, proj, cfg, proto, path = h2o_export
    res = run_parity(path, folder_cfg(m, cfg), CharTokenizer(), proj, cfg, m, prompt_tokens=40, steps=6, kernel=KERNEL)
    assert res["pass"], res
    r = res["ort_vs_reference"]
    assert r["max_abs_logit_diff_prefill"] <= 1e-4 and r["max_abs_logit_diff_decode"] <= 1e-4 and r["greedy_identical"]
    # every real token of every layer and head was an eviction decision: 46 tokens x 2 layers x 2 heads
    assert res["eviction"]["decisions"] == 46 * 2 * 2 and res["eviction"]["pass"]
    assert res["selection"]["rows"] > 0
    if KERNEL == "native":
        assert res["native_vs_function_body"]["greedy_identical"]
        assert res["native_vs_function_body"]["eviction"]["decisions"] == 46 * 2 * 2
    # at k = r and no eviction the graph is HF's model
    assert res["ort_k1_vs_hf"]["pass"] and "AQUA-H2O off" in res["ort_k1_vs_hf"]["graph"]


def test_replaying_a_wrong_eviction_is_caught(h2o_export):
    """A replay log that keeps the wrong tokens must show up as differing decisions that are not near-ties."""
    from aqua_export.parity.harness import ort_trace, torch_trace
    from aqua_export.parity.probe import ReplayProbe, RuntimeRecorder
    from aqua_export.reference.attention import apply_aqua

    m, proj, cfg, proto, path = h2o_export
    rec = RuntimeRecorder(evictions=True)
    lm = OrtLM(make_session(path, kernel="function"), folder_cfg(m, cfg), probe=rec)
    ids = np.arange(3, 43)[None]
    _, toks = ort_trace(lm, ids, 4)
    log = rec.live
    assert len(log) == 44 and log[-1][0].shape == (1, 2, 44)  # per token, per layer: live tokens [B, Hkv, seen]
    wrong = []
    for entry in log:  # keep the oldest tokens instead: same budget, other tokens
        bad = []
        for live in entry:
            n = live.sum(-1, keepdims=True)
            bad.append(np.arange(live.shape[-1])[None, None, :] < n)
        wrong.append(bad)
    probe = ReplayProbe(eviction=wrong)
    with apply_aqua(m, proj, cfg, probe=probe) as aqua:
        torch_trace(m, ids, toks, aqua.new_cache(), probe)
    s = probe.eviction_summary(None, 1e-4)
    assert s["decisions_differing"] > 0 and not s["pass"]


def test_parity_of_a_shared_buffer_export(tmp_path, tiny_llama):
    """The shared-buffer graph (past and present one buffer) through the same harness, forced selection included."""
    m, proj = tiny_llama
    cfg = AquaConfig(k_ratio=0.5)
    path = tmp_path / "s.onnx"
    export_onnx(m, proj, cfg, path)
    assert OrtLM(make_session(path, kernel=KERNEL), folder_cfg(m, cfg)).shared
    res = run_parity(path, folder_cfg(m, cfg), CharTokenizer(), proj, cfg, m, prompt_tokens=40, steps=6, kernel=KERNEL)
    assert res["pass"], res
    assert res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-4 and res["selection"]["rows"] > 0


def test_cache_gate_bar_follows_what_the_rounding_moves():
    """The narrow-cache gate on two traces of 65 forwards, 4 of them with another argmax (as the int4 token folder's
    float16 cache measured): it passes under token selection (the rounding moves page choices at any width:
    settings/tokens.py's Probe.cache_top1) and fails a float16 cache without it (0.95), as it does 7 differing forwards at any bar;
    7 whose argmax moved by near-ties (margins within its logit tie) pass under token selection only."""
    from aqua_export.parity.gates import TOLERANCE, cache_gate
    from aqua_export.settings import tokens as token_selection

    moved = token_selection.MECHANISM.probe.cache_top1  # (bar, logit tie)
    CACHE_TIE_TOKENS = moved[1]

    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((1, 50)).astype(np.float32) for _ in range(65)]

    def flipped(n):
        out = [r.copy() for r in ref]
        for r in out[1:n + 1]:
            r[0, int(r[0].argmin())] = r[0].max() + 0.05
        return out

    near = [r.copy() for r in ref]  # 7 forwards whose runner-up trails the argmax by half the tie
    for r in near[1:8]:
        r[0, int(np.argsort(r[0])[-2])] = r[0].max() - CACHE_TIE_TOKENS / 2
    swapped = [r.copy() for r in near]  # ... and leads it by as much in the other trace
    for r in swapped[1:8]:
        r[0, int(np.argsort(r[0])[-2])] += CACHE_TIE_TOKENS
    for tokens in (False, True):
        c = cache_gate(swapped, near, TOLERANCE["float32"], "float16", moved if tokens else None)
        assert c["top1_differing"] == 7 and c["pass"] == tokens, c

    verdicts = {}
    for n in (4, 7):
        for tokens in (False, True):
            c = cache_gate(flipped(n), ref, TOLERANCE["float32"], "float16", moved if tokens else None)
            assert c["top1_differing"] == n and c["top1_bar"] == (0.9 if tokens else 0.95)
            verdicts[n, tokens] = c["pass"]
    assert verdicts == {(4, False): False, (4, True): True, (7, False): False, (7, True): False}
