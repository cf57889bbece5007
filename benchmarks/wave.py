"""A wave: every prompt submitted to the offline engine at once, stepped until all finish.

The engine-level benchmarks that time whole waves (benchmarks/prefix_caching.py,
benchmarks/speculative.py, benchmarks/moe.py) run this one loop: ``LLMEngine.add_request``
for each prompt, then ``step()`` while requests remain, which is what ``LLM.generate`` does,
with the times recorded that TTFT, TPOT and throughput are computed from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput, StepStats
from scheduler.request import SamplingParams


@dataclass(slots=True)
class Wave:
    """What one wave produced and when; times are ``time.perf_counter()`` readings."""

    tokens: list[list[int]]  # per prompt, in order: its output token ids
    # Per prompt: the time after each step that gave it tokens (a speculative step may give
    # several), so [0] is its first token's and [-1] its last's.
    token_times: list[list[float]]
    step_stats: list[StepStats]  # of each step that ran (``LLMEngine.last_step_stats``)
    start: float  # before the first request was added
    seconds: float  # from ``start`` to the end of the last step

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def first_token_s(self) -> list[float]:
        """Per prompt: seconds from the wave's start to its first token (its TTFT)."""
        return [times[0] - self.start for times in self.token_times]

    def total(self, stat: str) -> int:
        """A ``StepStats`` count summed over the wave's steps."""
        return sum(getattr(stats, stat) for stats in self.step_stats)


def run_wave(
    engine: Any,  # an LLMEngine
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    tag: str = "wave",
    on_step: Callable[[list[RequestOutput]], None] | None = None,
) -> Wave:
    """Add every prompt (request ids ``<tag>-<n>``, which must be new to the engine), then step
    until none remains; ``on_step`` sees each step's outputs, after its time is taken."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {request_id: i for i, request_id in enumerate(ids)}
    tokens: list[list[int]] = [[] for _ in prompts]
    token_times: list[list[float]] = [[] for _ in prompts]
    step_stats: list[StepStats] = []
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        previous = engine.last_step_stats
        outputs = engine.step()
        now = time.perf_counter()
        stats = engine.last_step_stats
        if stats is not None and stats is not previous:  # a step with nothing to run has none
            step_stats.append(stats)
        for out in outputs:
            if out.new_token_ids:
                i = index[out.request_id]
                tokens[i].extend(out.new_token_ids)
                token_times[i].append(now)
        if on_step is not None:
            on_step(outputs)
    return Wave(tokens, token_times, step_stats, start, time.perf_counter() - start)
