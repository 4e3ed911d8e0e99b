"""The server's Prometheus metrics (GET /metrics, text exposition format 0.0.4): counters and gauges read from the
Engine when scraped, and a histogram of time to first token.

    aqua_requests_total{finish}            requests finished, by finish reason (stop, length, cancelled, error)
    aqua_requests_rejected_total{reason}   refused before any work: queue_full (429), invalid (4xx)
    aqua_queue_depth / aqua_running_sequences / aqua_prefilling   requests waiting for a row / decoding / prefilling
    aqua_prompt_tokens_total / aqua_generated_tokens_total / aqua_decode_steps_total
    aqua_generated_tokens_per_second       over the last 10 s
    aqua_prefix_cache_hits_total / aqua_prefix_cache_reused_tokens_total / aqua_prefix_cache_bytes
    aqua_time_to_first_token_seconds       histogram: from submission to the first token
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WINDOW_S = 10.0


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.finished: Counter = Counter()
        self.rejected: Counter = Counter()
        self.prompt_tokens = 0
        self.ttft = [0] * (len(BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.recent: deque = deque()  # (time, generated total) samples for the rate

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft[bisect.bisect_left(BUCKETS, seconds)] += 1
            self.ttft_sum += seconds

    def done(self, reason: str, prompt_tokens: int) -> None:
        with self.lock:
            self.finished["error" if reason.startswith("error") else reason] += 1
            self.prompt_tokens += prompt_tokens

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] += 1

    def _rate(self, generated: int) -> float:
        now = time.monotonic()
        self.recent.append((now, generated))
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()
        t0, g0 = self.recent[0]
        return (generated - g0) / (now - t0) if now > t0 else 0.0

    def render(self, engine) -> str:
        """The exposition text of every metric, the engine's read now."""
        lines = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        with self.lock:
            metric("aqua_requests_total", "counter", "requests finished, by finish reason",
                   [(f'{{finish="{k}"}}', v) for k, v in sorted(self.finished.items())] or [("", 0)])
            metric("aqua_requests_rejected_total", "counter", "requests refused before any work",
                   [(f'{{reason="{k}"}}', v) for k, v in sorted(self.rejected.items())] or [("", 0)])
            metric("aqua_prompt_tokens_total", "counter", "prompt tokens of finished requests",
                   [("", self.prompt_tokens)])
            cum, samples = 0, []
            for le, n in zip([*map(str, BUCKETS), "+Inf"], self.ttft):
                cum += n
                samples.append((f'_bucket{{le="{le}"}}', cum))
            samples += [("_sum", round(self.ttft_sum, 6)), ("_count", cum)]
            metric("aqua_time_to_first_token_seconds", "histogram", "from submission to the first token", samples)
            rate = self._rate(engine.generated)
        p = engine.prefix
        for name, kind, help_, value in (
                ("aqua_queue_depth", "gauge", "requests waiting for a row", len(engine.waiting)),
                ("aqua_running_sequences", "gauge", "sequences decoding", len(engine.live)),
                ("aqua_prefilling", "gauge", "sequences prefilling", int(engine.filling is not None)),
                ("aqua_generated_tokens_total", "counter", "tokens generated", engine.generated),
                ("aqua_generated_tokens_per_second", "gauge", f"tokens generated per second over the last "
                                                              f"{WINDOW_S:.0f} s", round(rate, 3)),
                ("aqua_decode_steps_total", "counter", "batched decode steps", engine.steps),
                ("aqua_prefix_cache_hits_total", "counter", "prompts that reused cached rows", p.hits),
                ("aqua_prefix_cache_reused_tokens_total", "counter", "prompt tokens not prefilled again",
                 p.reused_tokens),
                ("aqua_prefix_cache_bytes", "gauge", "memory held by the prefix cache", p.used)):
            metric(name, kind, help_, [("", value)])
        return "\n".join(lines) + "\n"
