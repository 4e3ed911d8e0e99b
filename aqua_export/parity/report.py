"""parity.json in words: each figure, what it compares, whether it is a gate and whether it passed."""

from __future__ import annotations

from .gates import TOLERANCE
from .probe import NOISE_FACTOR


def _verdict(g: dict) -> str:
    return "PASS" if g.get("pass", True) else "FAIL"


def _bound_text(g: dict) -> str:
    if g.get("reference") != "float64":
        return f"<= {g['tolerance']:.1e}, float16's allowance"
    err = max(g["float32_error_prefill"], g["float32_error_decode"])
    return f"<= {g['tolerance']:.1e} = max({g['floor']:g}, {NOISE_FACTOR:g} x float32's own error {err:.1e})"


def _values_line(label: str, g: dict) -> str:
    against = "its float64 forward" if g.get("reference") == "float64" else "the float32 reference"
    ties = f", {g['top1_differing_near_ties']} argmax near-ties" if g.get("top1_differing_near_ties") else ""
    return (f"[gate] {label}, against {against}: max |dlogit| prefill {g['max_abs_logit_diff_prefill']:.2e}, decode "
            f"{g['max_abs_logit_diff_decode']:.2e} ({_bound_text(g)}), top-1 {g['top1_agreement']:.3f}{ties}: "
            f"{_verdict(g)}")


def _top1_line(what: str, c: dict, why: str) -> str:
    """A top-1 gate's line (gates.top1_gate): its agreement, and the logit differences reported with their cause."""
    return (f"[gate: top-1, one flip allowed] {what}: top-1 {c['top1_agreement']:.3f}; max |dlogit| prefill "
            f"{c['max_abs_logit_diff_prefill']:.2e}, decode {c['max_abs_logit_diff_decode']:.2e} (reported: {why}): "
            f"{_verdict(c)}")


def summary_lines(res: dict) -> list[str]:
    """parity.json in words: each figure, what it compares, whether it is a gate and whether it passed."""
    r = res["ort_vs_reference"]
    lines = [_values_line("ORT vs the PyTorch reference under ORT's selection", r)]
    if r.get("reference") == "float64":
        lines.append(f"[report] ORT vs the float32 reference: prefill {r['vs_float32_prefill']:.2e}, decode "
                     f"{r['vs_float32_decode']:.2e}")
    u, sel = res["ort_vs_reference_unforced"], res["selection"]
    if "rows" in sel or "eviction" in res or "pages" in res or "prefill_blocks" in res:  # ORT's choices replayed
        lines.append(f"[report] each side selecting on its own: max |dlogit| prefill {u['max_abs_logit_diff_prefill']:.2e}, "
                     f"decode {u['max_abs_logit_diff_decode']:.2e}, top-1 {u['top1_agreement']:.3f}")
    if "rows" in sel and sel.get("gated") is False:
        lines.append(f"[gate] selection (float16): {sel['rows_differing']} of {sel['rows']} query rows ranked coordinates "
                     f"differently from the float32 reference (float16 rounding of q^); top-1 agreement with each side "
                     f"selecting on its own {res['ort_vs_reference_unforced']['top1_agreement_beyond_ties']:.3f} "
                     f"(>= {TOLERANCE['float16']['top1']}): {_verdict(sel)}")
    elif "rows" in sel:
        lines.append(f"[gate] selection: {sel['rows_differing']} of {sel['rows']} query rows chose other coordinates "
                     f"on the reference's own; largest relative |q^| gap among them {sel['max_gap_of_differing']:.1e} "
                     f"(a near-tie: <= {sel['near_tie']:.1e}): {_verdict(sel)}")
    if "rows" in res.get("pages", {}):
        pg = res["pages"]
        bound = f" (a near-tie: <= {pg['near_tie']:.1e})" if "near_tie" in pg else " (float16: gated on top-1)"
        dropped = f"{pg['pages_dropped']} of {pg['pages_visible']} visible pages left out" if pg["pages_dropped"] else \
            f"selection not exercised: no decode step left out any of its {pg['pages_visible']} visible pages"
        lines.append(f"[gate] token pages replayed from ORT ({dropped}): the reference's own choice differs in "
                     f"{pg['rows_differing']} of {pg['rows']} decode rows, largest relative page-score gap "
                     f"{pg['max_gap_of_differing']:.1e}{bound}: {_verdict(pg)}")
    if "rows" in res.get("prefill_blocks", {}):
        pb = res["prefill_blocks"]
        bound = f" (a near-tie: <= {pb['near_tie']:.1e})" if "near_tie" in pb else " (float16: gated on top-1)"
        lines.append(f"[gate] sparse prefill's key blocks replayed from ORT: the reference's own choice differs in "
                     f"{pb['rows_differing']} of {pb['rows']} sparse prompt rows, largest mass gap to the threshold "
                     f"{pb['max_gap_of_differing']:.1e} of it{bound}: {_verdict(pb)}")
    if "eviction" in res:
        e = res["eviction"]
        bound = f" (a near-tie: <= {e['near_tie']:.1e})" if "near_tie" in e else ""
        lines.append(f"[gate] H2O eviction replayed from ORT: the reference's own choice differs in "
                     f"{e['decisions_differing']} of {e['decisions']} decisions, largest accumulator gap "
                     f"{e['max_gap_of_differing']:.1e}{bound}: {_verdict(e)}")
    if "native_vs_function_body" in res:
        lines.append(_top1_line("native kernel vs the graph's function body, each selecting on its own",
                                res["native_vs_function_body"],
                                "one near-tie row selected differently moves the logits after it by a whole q_i k_i term"))
    if "cache_rounding" in res:
        c = res["cache_rounding"]
        lines.append(_top1_line(f"the folder's {c['cache_dtype']} cache vs the same graph caching float32 (the gates "
                                f"above ran that one; top-1 >= {c['top1_bar']} beyond ties)", c,
                                "the cache's rounding"))
    if "activation_accuracy" in res:
        a = res["activation_accuracy"]
        lines.append(f"[report] the folder's int8 activations (its accuracy level) vs float32 ones: top-1 "
                     f"{a['top1_agreement']:.3f}; max |dlogit| prefill {a['max_abs_logit_diff_prefill']:.2e}, decode "
                     f"{a['max_abs_logit_diff_decode']:.2e}")
    if "vs_float_weights" in res:
        q = res["vs_float_weights"]
        lines.append(f"[report] the quantized folder vs the reference on the float weights (what quantization costs): "
                     f"max |dlogit| prefill {q['max_abs_logit_diff_prefill']:.2e}, decode "
                     f"{q['max_abs_logit_diff_decode']:.2e}, top-1 {q['top1_agreement']:.3f}")
    h = res["ort_k1_vs_hf"]
    if "pass" in h:
        what = "the folder's graph" if h["graph"] == "the folder's graph" else "this graph with k = r"
        lines.append(_values_line(f"ORT at k = r ({what}) vs HF transformers", h))
    lines.append("parity PASS" if res["pass"] else f"parity FAIL: {', '.join(res['failed'])}")
    return lines
