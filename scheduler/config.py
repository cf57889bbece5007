"""SchedulerConfig: budgets and the batching policy."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

BATCHING_MODES = ("continuous", "static", "dynamic")
BLOCK_ALLOCATION_MODES = ("optimistic", "reserve")

# The default step token budget, and the chunk size when the prefill work waiting does not
# fit in one step. A burst whose prompts all fit in the budget (16 of 128 tokens) is
# prefilled in one step and then decodes together, with no later prefill chunk landing
# between its tokens; with a flat 512 such a burst went in 4 prompts per step, each landing
# between the earlier ones' tokens, and its inter-token p99 was several times higher. A queue
# deeper than one step (64 such prompts) drains in 512-token chunks instead: each request
# starts as soon as its own chunk is done rather than a 2048-token step later, and running
# decodes wait one short step between tokens (figures: benchmarks/RESULTS.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PREFILL_CHUNK_TOKENS = 512
# On a GPU a step's time is set by reading the weights until its tokens number in the
# hundreds, so a 512-token chunk beside the decodes costs about what the decodes cost alone,
# and a deep queue drains fastest in steps as large as the budget: the chunk limit there is
# the whole budget (benchmarks/RESULTS.md, GPU section).
# With latency targets: the fewest prompt tokens a step computes while prefill work waits,
# however far over its target the step's decodes already are, so no prompt starves.
DEFAULT_MIN_PREFILL_CHUNK_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Args:
    max_num_seqs: most requests running at once (the batch size of static/dynamic).
    max_num_batched_tokens: most tokens (prefill chunks + decodes) in one step. A step
        whose whole prefill work (running prompts' remainders and the admissible queue)
        fits in it computes all of it at once.
    prefill_chunk_tokens: when that prefill work does not fit in one step, the most prompt
        tokens a step computes (capped by max_num_batched_tokens); long prompts and deep
        queues proceed in chunks of this size. None: the device's default
        (``for_device``), which a scheduler built without a device takes as the CPU one.
    batching: "continuous" (iteration-level), "static" or "dynamic" (run a batch to
        completion before taking the next).
    block_allocation: how many KV blocks a request gets when it is admitted. "optimistic":
        what its first chunk needs now, more as it grows, preempting by recompute when the
        pool runs out; "reserve": room for prompt + max_tokens up front, so it never
        preempts.
    batch_wait_ms: dynamic batching forms a batch when max_num_seqs requests wait or the
        oldest has waited this long.
    static_finished: in static/dynamic mode, whether finished sequences keep being computed
        as padding until the batch ends ("compute", as a fixed batch does) or not ("skip").
    target_itl_ms: inter-token latency target: each step's prompt tokens are sized so that
        the predicted step time (the step plus the engine loop's gap before it) stays
        under it while requests decode (scheduler/latency_targets.py). None: no target.
    target_itl_ratio: inter-token latency target relative to the decodes' own step: while
        requests decode, a step's prompt tokens are sized so that its predicted time (gap
        included) stays within this multiple (> 1) of the predicted time of the same
        decodes alone. It needs no figure in milliseconds, so one value serves any model,
        batch and device. With ``target_itl_ms`` too, the tighter of the two binds.
        None: no target.
    target_tpot_ms: time-per-output-token target, kept on average: a step may run over it
        by the time earlier steps ran under it (at most ``TPOT_CREDIT_STEPS`` steps'
        worth). None: no target.
    target_ttft_ms: time-to-first-token target: when queued prompts would miss it, a step
        may grow its prefill share up to the ITL target (or, without one, the token
        budget). Needs an ITL or TPOT target; None: no target.
    min_prefill_chunk_tokens: with a target, the fewest prompt tokens a step computes while
        prompts wait (no starvation under a target the decodes alone exceed).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    prefill_chunk_tokens: int | None = None
    batching: str = "continuous"
    block_allocation: str = "optimistic"
    batch_wait_ms: float = 50.0
    static_finished: str = "compute"
    target_itl_ms: float | None = None
    target_itl_ratio: float | None = None
    target_tpot_ms: float | None = None
    target_ttft_ms: float | None = None
    min_prefill_chunk_tokens: int = DEFAULT_MIN_PREFILL_CHUNK_TOKENS

    @property
    def has_latency_targets(self) -> bool:
        """Whether a step's prefill is sized by a latency target (ITL, relative ITL or TPOT)."""
        return (
            self.target_itl_ms is not None
            or self.target_itl_ratio is not None
            or self.target_tpot_ms is not None
        )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(
                f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}"
            )
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")
        if self.block_allocation not in BLOCK_ALLOCATION_MODES:
            raise ValueError(
                f"block_allocation must be one of {BLOCK_ALLOCATION_MODES}, "
                f"got {self.block_allocation!r}"
            )
        if self.static_finished not in ("compute", "skip"):
            raise ValueError(
                f"static_finished must be compute or skip, got {self.static_finished!r}"
            )
        for name in ("target_itl_ms", "target_tpot_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")
        ratio = self.target_itl_ratio
        if ratio is not None and not (ratio > 1 and math.isfinite(ratio)):
            raise ValueError(
                f"target_itl_ratio must be a number above 1 (a step's time over its decodes' "
                f"own), got {ratio}"
            )
        if self.target_ttft_ms is not None and not self.has_latency_targets:
            raise ValueError(
                "target_ttft_ms needs target_itl_ms, target_itl_ratio or target_tpot_ms: it "
                "grows the prefill share within those"
            )
        if self.min_prefill_chunk_tokens < 1:
            raise ValueError(
                f"min_prefill_chunk_tokens must be positive, got {self.min_prefill_chunk_tokens}"
            )

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with ``prefill_chunk_tokens`` resolved for a device: 512 on CPU, the
        whole step budget elsewhere."""
        if self.prefill_chunk_tokens is not None:
            return self
        chunk = (
            DEFAULT_PREFILL_CHUNK_TOKENS if device_type == "cpu" else self.max_num_batched_tokens
        )
        return replace(self, prefill_chunk_tokens=chunk)
