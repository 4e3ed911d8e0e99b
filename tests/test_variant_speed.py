"""Each instruction-set variant of the native kernels is at least as fast as the one below it on a prompt: the AVX2
build (x86-64-v3) of AquaAttention's prompt node not slower than the SSE4.2 one (v2), the AVX-512 one (v4) not slower
than AVX2, measured as a ratio of medians of interleaved runs inside this process (no absolute time). A vector type
wider than the target's registers, lowered to the stack, made 89f9307's AVX2 prompt kernel 1.6x slower than its SSE
one; this fails on those kernels (`AQUA_ORT_KERNEL=<89f9307's libaqua_ort.so>`), before users notice.

The margin: the ratio of two variants' fastest of 21 interleaved runs (one thread, 512 tokens) was 0.60 here (an AVX2
EPYC: v3 over v2) and 0.54 to 0.62 beside a two-thread matrix product hogging the cores, where medians swung from 0.41
to 0.84; a wider variant may take 1.15x the narrower one's time. Where this CPU runs fewer than two variants the test
says so and skips."""

import pytest

from aqua_export.runtime.session import native_library, variants_here
from tools.bench_prompt import attention_feed, prompt_session
from tools.harness import interleaved_medians

MARGIN = 1.15  # a wider variant may be at most this much slower than the one below before this fails
TOKENS, REPS = 512, 21


@pytest.mark.skipif(native_library() is None, reason="native kernels not built (run `make plugin`)")
def test_each_variant_is_not_slower_than_the_one_below_it_on_a_prompt():
    variants = variants_here()
    if len(variants) < 2:
        pytest.skip(f"this CPU runs {len(variants)} kernel variant(s) ({', '.join(variants)}): nothing to order")
    runs = {}
    for v in variants:
        session = prompt_session(v, threads=1)
        feed = attention_feed(session, TOKENS)
        runs[v] = (lambda s, f: lambda: s.run(None, f))(session, feed)
    sec = interleaved_medians(runs, REPS, stat=min)
    for lower, upper in zip(variants, variants[1:]):
        ratio = sec[upper] / sec[lower]
        assert ratio <= MARGIN, (f"the {upper} prompt kernel took {ratio:.2f}x the {lower} one's time "
                                 f"({sec[upper] * 1e3:.2f} against {sec[lower] * 1e3:.2f} ms, {TOKENS} tokens): a wider "
                                 f"variant slower than a narrower one (allowed: {MARGIN:.2f}x)")
