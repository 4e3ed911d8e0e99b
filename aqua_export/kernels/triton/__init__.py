"""The Triton kernels of the custom nodes, each with a PyTorch host function; ``HOSTS`` calls them as the op
catalogue's references are called (the op's inputs in port order, then P when projected, then its attributes),
so one test drives every implementation alike.

    select           the selection rank rule as one jit helper, the interpreter switch, binding a kernel to a mode
    pool             each token's cut of the pooled selection (a node with head_prices)
    topk_gather_dot  TopKGatherDot (also compiled ahead of time into the TensorRT plugin)
    aqua_attention   AquaAttention, flash-decoding splits merged by a kernel (a decode step)
    prompt           AquaAttention over a prompt: flash attention's tiles over each query block's key blocks
    prefill          those blocks: every visible one, or those sparse prefill's estimate keeps
    tokens           token selection at a decode step: pages scored and chosen on the device
    h2o_attention    H2OAttention over slot buffers updated in place
"""

from __future__ import annotations

from ...settings.prefill import K_RATIO, STRIDE
from .aqua_attention import aqua_attention
from .prefill import Prefill
from .tokens import Tokens
from .h2o_attention import h2o_attention
from .topk_gather_dot import topk_gather_dot


def _refuse(**asks) -> None:
    """The capability table's triton column (capabilities.REFUSALS): its line, raised, for what a call asks that the
    kernels do not run; they never compute another answer silently."""
    from ...capabilities import Features, refusal

    line = refusal(Features(**asks), "triton")
    if line:
        raise ValueError(line)


def _scores(query_hat, key_cache, total_length, *, k, rule=0, interpret=None, **plugin):
    _refuse(int8_cache=key_cache.dtype.itemsize == 1)
    return (topk_gather_dot(query_hat, key_cache[..., :int(total_length)], k, interpret, rule),)


def _attention(query_hat, key_cache, value_cache, total_length, attention_mask, projection=None, *, k, rule=0,
               softcap=0.0, sliding_window=0, interpret=None, token_ratio=1.0, token_budget=0, token_sink=0,
               token_window=0, head_prices=None, prefill_threshold=1.0, prefill_stride=STRIDE.default,
               prefill_k_ratio=K_RATIO.default, **plugin):
    _refuse(int8_cache=key_cache.dtype.itemsize == 1, shared_k=head_prices is not None)
    tokens = Tokens(token_ratio, token_budget, token_sink, token_window)
    return (aqua_attention(query_hat, key_cache, value_cache, int(total_length), attention_mask, k, rule, softcap,
                           projection, interpret, tokens=tokens, prices=head_prices, window=sliding_window,
                           prefill=Prefill(prefill_threshold, prefill_stride, prefill_k_ratio)),)


def _h2o(*inputs, k, rule=0, softcap=0.0, ratio=0.5, interpret=None, **plugin):
    projection = inputs[8] if len(inputs) > 8 else None
    return h2o_attention(*inputs[:8], k=k, rule=rule, softcap=softcap, ratio=ratio, interpret=interpret,
                         projection=projection)


HOSTS = {"TopKGatherDot": _scores, "AquaAttention": _attention, "H2OAttention": _h2o}  # op name -> host call
