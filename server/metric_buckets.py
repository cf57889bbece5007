"""Histogram bucket boundaries of the server's Prometheus metrics (``server/metrics.py``).

Latencies resolve small models: a 135M model decodes a token in ~1 ms on an H100, so the
inter-token buckets start at 1 ms (vLLM's start at 10 ms) and the request-phase ones at 1 ms
(vLLM's at 300 ms). The tails reach hours, as vLLM's do since vllm#15202.
"""

from __future__ import annotations

# fmt: off
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0,
                 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# fmt: on
STEP_TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1-2-5 buckets up to ``max_len`` (vLLM's request-length buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10
