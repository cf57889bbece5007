"""What the engine hands upward: per-step runner results and per-request outputs.

These are plain dataclasses so the server (and tests) can consume them without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How a step's forward pass ran: a decode graph's replay (engine/cuda_graphs.py), a whole
# or piecewise replay of a step with prefill tokens (engine/prefill_graphs.py), or launched
# from Python.
REPLAYS = ("decode_graph", "whole_graph", "graph_pieces", "eager")


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's log-probability and, if asked for, the top-N alternatives.

    Log-probabilities are ``log_softmax`` of the model's raw logits (before temperature,
    penalties or truncation), as OpenAI and vLLM report them.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    # 1 + the tokens more likely than this one; None where not computed (sampled tokens).
    rank: int | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's sampled tokens, aligned with the requests that sampled this step.

    A speculative row (engine/spec_decode/) emits a list of tokens, with a list of logprobs.
    """

    request_ids: list[str]
    token_ids: list[int | list[int]]
    logprobs: list[TokenLogprob | list[TokenLogprob] | None]
    # Wall seconds of the runner's phases ("prepare", "forward", "sample"): StepStats.phase_s.
    phase_s: dict[str, float] = field(default_factory=dict)
    # A mixture of experts' experts the step ran, summed over layers (engine/moe.py); None:
    # no mixture, or not known.
    experts_touched: int | None = None
    # How the forward pass ran (REPLAYS); "" where not known (a step re-run in parts).
    replay: str = ""
    # Prompt logprobs of the step's scored rows (engine/prompt_logprobs.py): request id ->
    # (the first scored position, one entry per row, scoring the prompt token after it).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutput:
    """The delta one step produced for one request.

    ``new_token_ids`` is usually one token, and empty for a prefill chunk that did not reach
    the end of the prompt (no output is emitted for those) or for an abort.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far, including new_token_ids
    stop_token_id: int | None = None  # the EOS / stop token that ended it, if any
    error: str | None = None
    # time.monotonic() of the request's first step (its queue time ends there), for metrics.
    first_scheduled_time: float | None = None
    # With its first token, where SamplingParams.prompt_logprobs asked: one entry per prompt
    # token, None for the first (nothing comes before it); ``rank`` is set.
    prompt_logprobs: list[TokenLogprob | None] | None = None


# Where a step's wall time goes, in order. "forward" is the model; everything else is the
# serving system's overhead around it: picking the batch ("schedule"), building its input
# tensors ("prepare"), choosing tokens ("sample"), advancing requests and emitting outputs
# ("update"), and the engine thread's work between two steps (taking new requests and aborts,
# handing outputs to the event loop, waiting for the GIL: "between_steps", filled in by the
# server's engine loop, absent offline).
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update", "between_steps")


@dataclass(frozen=True, slots=True)
class EngineOccupancy:
    """What the engine holds at one moment: the load gauges routers and dashboards read.

    A step's ``StepStats.occupancy`` is the state after it; the engine's ``occupancy()`` the
    state now, which the server reads when every request is gone without a step to report
    it (the last ones aborted, or the step that finished them reported by an earlier call).
    """

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_kv_blocks_cached: int
    num_kv_blocks_evictable: int
    kv_waste_fraction: float


@dataclass(slots=True)
class StepStats:
    """Figures of one engine step, emitted as data for the metrics layer."""

    step_time_s: float
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    # Bytes the step had to move and the work it did, analytic (engine/cost.py): the weights
    # it read (all layers; the LM head only if a row needed logits; embedding rows looked up),
    # the KV cache read and written, and the FLOPs of its matmuls and attention.
    weight_bytes: int = 0
    kv_bytes_read: int = 0
    kv_bytes_written: int = 0
    flops: int = 0
    # Static/dynamic batching with static_finished="compute": dummy rows of finished members.
    num_padding_tokens: int = 0
    # Prefix caching and KV occupancy, from kvpool.KVCacheStats (kvpool/stats.py).
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission, this step
    prefix_cache_hits: int = 0  # of those, tokens found cached (not prefilled), this step
    num_kv_blocks_cached: int = 0  # blocks holding a prefix hash, in use or evictable
    num_kv_blocks_evictable: int = 0  # cached blocks no request owns (reused or evicted later)
    num_kv_slots_allocated: int = 0  # token slots of used blocks
    num_kv_slots_live: int = 0  # of those, slots holding a computed token (shared ones once)
    # Speculative decoding (engine/spec_decode/): drafts verified this step, how many were
    # accepted, speculative rows (each also emits the target's own token), and the seconds
    # spent proposing and choosing the accepted drafts from the logits (inside "schedule" and
    # "sample" of phase_s; the forward pass that scores the drafts is the step's own).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_verifications: int = 0
    spec_draft_s: float = 0.0
    spec_accept_s: float = 0.0
    # Seconds per phase of STEP_PHASES; the phases of engine.step() add up to step_time_s
    # (with asynchronous scheduling a step's phases overlap the steps beside it, and
    # step_time_s is the interval between two reads: "update" is then what is left, or 0).
    phase_s: dict[str, float] = field(default_factory=dict)
    # How its forward pass ran (ModelRunnerOutput.replay: REPLAYS, or "").
    replay: str = ""
    # Latency targets (scheduler/latency_targets.py); None without targets.
    predicted_step_s: float | None = None  # the step-time model's figure, before the step ran
    target_budget_s: float | None = None  # iteration time its prompt tokens were sized for
    # Prompt tokens the targets let it compute; None for a step planned without decodes.
    target_prefill_cap: int | None = None
    # For steps with decodes: whether the gap before it plus its time kept the budget.
    target_met: bool | None = None
    target_ttft_boost: bool = False  # the TTFT target grew the prefill share
    target_conflict: bool = False  # the TTFT target is missed even at the largest share

    @property
    def kv_waste_fraction(self) -> float:
        """KV waste: (allocated - live) / allocated slots; 0.0 when nothing is allocated."""
        allocated = self.num_kv_slots_allocated
        return (allocated - self.num_kv_slots_live) / allocated if allocated else 0.0

    @property
    def occupancy(self) -> EngineOccupancy:
        """The load gauges after this step."""
        return EngineOccupancy(
            self.num_running,
            self.num_waiting,
            self.num_kv_blocks_used,
            self.num_kv_blocks_total,
            self.num_kv_blocks_cached,
            self.num_kv_blocks_evictable,
            self.kv_waste_fraction,
        )
