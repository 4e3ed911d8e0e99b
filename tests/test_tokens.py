"""Token selection (AquaConfig.token_ratio / token_budget): the page rule's golden table on every implementation
of AquaAttention, the export and parity of a tiny model (function body and native kernel), and the refusals."""

import dataclasses

import pytest
import torch
from conftest import CharTokenizer
from helpers import folder_cfg, tiny_projection
from implementations import IMPLEMENTATIONS

from aqua_export import models
from aqua_export.config import AquaConfig, ConfigError
from aqua_export.export.exporter import export_onnx
from aqua_export.ops import aqua_attention, rules
from aqua_export.ops.spec import PAGE
from aqua_export.parity.harness import run_parity
from aqua_export.runtime.session import native_library


# (each page's score, tokens L, first visible token, {token settings}) -> the pages a decode step attends
PAGE_GOLDEN = [
    ([0.1, 0.9, 0.5, 0.3], 64, 0, {"budget": 16}, [1]),
    ([0.5, 0.5, 0.5, 0.1], 64, 0, {"budget": 32}, [0, 1]),  # a three-way tie: the lower pages
    ([0.0, 0.0, 0.9, 0.1, 0.0], 80, 0, {"budget": 16, "sink": 1, "window": 1}, [0, 4]),  # forced pages fill the want
    ([0.0, 0.0, 0.9, 0.1, 0.0], 80, 0, {"budget": 48, "sink": 1, "window": 1}, [0, 2, 4]),
    ([0.2, 0.8, 0.1, 0.7, 0.3, 0.6, 0.4], 100, 0, {"ratio": 0.3}, [1, 3]),  # ceil(0.3 x 100) = 30 tokens: 2 pages
    # padding: pages count from the first visible token (slot 20), the sink's page is page 0
    ([0.9, 0.1, 0.5, 0.2], 64, 20, {"budget": 16, "sink": 1}, [0]),
    ([0.9, 0.1, 0.5, 0.2], 64, 20, {"budget": 1000}, [0, 1, 2]),  # more than visible: every visible page
    ([0.1, 0.2, 0.3], 40, 8, {"budget": 32}, [0, 1]),  # 32 visible tokens from slot 8: two whole pages, all attended
    ([0.9, 0.1, 0.5, 0.2, 0.3], 70, 0, {"budget": 16, "window": 8}, [3, 4]),  # a partial last page; window spans 2
]


def _golden_inputs(scores, length, first):
    """r = 2, k = 1: q^ = [1, 0.5] keeps coordinate 0, K^[0] = its page's score, K^[1] = 0, so a token's approximate
    and exact scores are its page's; V = the one-hot of the token's page: out[p] > 0 iff page p was attended. Pages
    count from the first visible slot (ops.rules.page_origin)."""
    pages = len(scores)
    page_of = (torch.arange(length) - first).clamp_min(0) // PAGE
    q = torch.tensor([1.0, 0.5]).reshape(1, 1, 1, 1, 2)
    kc = torch.zeros(1, 1, 2, length)
    kc[0, 0, 0] = torch.tensor(scores)[page_of]
    vc = torch.nn.functional.one_hot(page_of, pages).float()[None, None]
    attention_mask = (torch.arange(length) >= first).to(torch.int64)[None]  # the slots before `first` are padding
    return [q, kc, vc, torch.tensor([length]), attention_mask]


def _attrs(ratio=1.0, budget=0, sink=0, window=0):
    return {"k": 1, "token_ratio": ratio, "token_budget": budget, "token_sink": sink, "token_window": window}


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("scores,length,first,tok,want", PAGE_GOLDEN, ids=range(len(PAGE_GOLDEN)))
def test_page_golden(scores, length, first, tok, want, name):
    """The rule (ops.rules) and every implementation attend exactly the golden pages."""
    ins = _golden_inputs(scores, length, first)
    visible = rules.visible(ins[4], 1)[:, 0]  # [1, L]
    score = rules.page_scores(ins[1][0, :, :1], visible)  # the approximate scores [1, g = 1, L] -> [1, P]
    forced = rules.forced_pages(visible, tok.get("sink", 0), tok.get("window", 0))
    chosen = rules.select_pages(score, forced, rules.tokens_attended(visible, tok.get("ratio", 1.0),
                                                                     tok.get("budget", 0)))
    assert chosen[0].nonzero().flatten().tolist() == want
    impl = IMPLEMENTATIONS[name]
    reason = impl.unavailable()
    if reason:
        pytest.skip(reason)
    out = impl.run(aqua_attention.OP, ins, False, "float32", _attrs(**tok))[0]
    assert (out[0, 0, 0, 0] > 1e-6).nonzero().flatten().tolist() == want


KERNELS = ["function"] + (["native"] if native_library() is not None else [])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokens")
    m = models.tiny_model("llama")
    return m, tiny_projection(m, tmp), tmp


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tok", [{"token_ratio": 0.25}, {"token_budget": 40}], ids=["ratio", "budget"])
def test_token_selection_parity(tiny, tok, kernel):
    """A 128-token prompt and 6 decode steps: ORT's pages replayed into the reference, values within the float32
    gate, every page choice the reference makes on its own the same or a near-tie; native = function body."""
    m, proj, tmp = tiny
    cfg = AquaConfig(k_ratio=0.5, token_sink=4, token_window=8, **tok)
    path = tmp / f"{kernel}-{'-'.join(tok)}.onnx"
    export_onnx(m, proj, cfg, path)
    res = run_parity(path, folder_cfg(m, cfg), CharTokenizer(), proj, cfg, m, prompt_tokens=128, steps=6,
                     kernel=kernel)
    assert res["pass"], res
    assert res["pages"]["rows"] > 0 and res["pages"]["pass"]
    assert 0 < res["pages"]["pages_dropped"] < res["pages"]["pages_visible"]
    assert res["ort_vs_reference"]["max_abs_logit_diff_decode"] <= 1e-4
    if kernel == "native":
        assert res["native_vs_function_body"]["greedy_identical"]


def test_parity_lengthens_its_prompt_until_pages_are_left_out(tiny):
    """A budget of 40 tokens and a 16-token prompt read every page: parity makes its prompt longer (page by page, within
    the context) until its first decode step leaves one out, reports how many, and a run that leaves none out fails
    its gate with a line saying selection was not exercised."""
    from aqua_export.parity.harness import prompt_length
    from aqua_export.parity.report import summary_lines

    m, proj, tmp = tiny
    cfg = AquaConfig(k_ratio=0.5, token_sink=4, token_window=8, token_budget=40)
    assert prompt_length(cfg, 16, 2, 64) == 48 and prompt_length(AquaConfig(k_ratio=0.5), 16, 2, 64) == 16
    path = tmp / "short.onnx"
    export_onnx(m, proj, cfg, path)
    res = run_parity(path, folder_cfg(m, cfg), CharTokenizer(), proj, cfg, m, prompt_tokens=16, steps=2)
    assert res["prompt_tokens"] == 48 and res["pass"] and res["pages"]["pages_dropped"] > 0
    line = next(x for x in summary_lines(res) if "token pages" in x)
    assert f"{res['pages']['pages_dropped']} of {res['pages']['pages_visible']} visible pages left out" in line
    # the same folder in a context too short to leave a page out: the gate fails and says why
    res = run_parity(path, dataclasses.replace(folder_cfg(m, cfg), context_length=40), CharTokenizer(), proj, cfg, m,
                     prompt_tokens=16, steps=2)
    line = next(x for x in summary_lines(res) if "token pages" in x)
    assert not res["pass"] and "selection not exercised" in line and line.endswith("FAIL")


def test_pages_change_the_answer(tiny):
    """The chosen tokens get exact scores: with a window covering every token the decode rows are dense attention's
    (HF's), and with a few pages they differ from it (the test can fail)."""
    from aqua_export.reference.attention import apply_aqua

    m, proj, _ = tiny
    ids = torch.arange(3, 131)[None] % m.config.vocab_size

    def logits(**tok):
        with apply_aqua(m, proj, AquaConfig(k_ratio=0.5, **tok), token_rows_from=100):
            return m(ids).logits[0, 100:].double()

    dense = m(ids).logits[0, 100:].double()
    assert (logits(token_ratio=0.2, token_sink=4, token_window=8) - dense).abs().max() > 1e-3
    assert (logits(token_ratio=0.2, token_sink=0, token_window=4096) - dense).abs().max() < 1e-5


def test_token_selection_refusals(tiny, tmp_path):
    m, proj, _ = tiny
    with pytest.raises(ConfigError, match="token"):
        AquaConfig(token_ratio=0.5, h2o_ratio=0.5)
    with pytest.raises(ConfigError, match="give one"):
        AquaConfig(token_ratio=0.5, token_budget=64)
    with pytest.raises(ConfigError, match="fused AquaAttention"):
        export_onnx(m, proj, AquaConfig(token_ratio=0.5), tmp_path / "x.onnx", fused=False)
    assert not (tmp_path / "x.onnx").exists()
