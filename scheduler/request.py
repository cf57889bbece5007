"""A request's sampling parameters and its lifecycle, as the scheduler sees it.

Ownership (see scheduler/__init__.py): the scheduler alone writes ``status``,
``num_computed_tokens``, ``output_token_ids`` and ``finish_reason``. Everyone else reads.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """A grammar the output must follow (engine/structured.py compiles and enforces it).

    ``kind`` is one of ``json`` (``spec``: a JSON schema's text), ``regex``, ``choice``
    (``spec``: a JSON list of the allowed strings) or ``grammar`` (``spec``: EBNF). The pair
    is the grammar cache's key (the server writes schemas compactly, keys in the client's
    order, which is the order the output lists them in).
    """

    kind: str
    spec: str


# A temperature below this samples greedily. Dividing logits by a tiny temperature overflows
# float32 (1e-39 makes them inf and the probabilities NaN), and the distribution it asks for
# is the argmax's already: at 1e-5 a logit gap of 1e-3 is a factor of e^100 (vLLM's bound).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one sequence.

    Stop *strings* are not here: they are matched on detokenized text, which the server owns.
    """

    max_tokens: int = 16
    # No stop token (EOS, stop_token_ids) before this many output tokens (vLLM's min_tokens).
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N alternatives per generated token; 0 = chosen only
    # Top-N alternatives per prompt token (each token's log-probability given the tokens
    # before it; 0 = the prompt token's own only); None computes none. Such a request
    # computes its whole prompt: it reads nothing from the prefix cache (vLLM's rule too).
    prompt_logprobs: int | None = None
    structured: StructuredOutputParams | None = None  # None: unconstrained
    # (token id, bias) pairs added to the logits before anything else (OpenAI's logit_bias);
    # a mapping given here is stored as its sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Derived here once: the sampler asks it of every row of every step (a greedy batch's
    # fast path), and one attribute read costs less than the five conditions.
    argmax_only: bool = field(init=False, repr=False, compare=False)
    # The same once output token ``min_tokens`` is reached: only min_tokens kept it off.
    argmax_past_min_tokens: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        if any(t < 0 or not -100 <= b <= 100 for t, b in pairs):
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100]: {bias}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError(f"logit_bias names a token twice: {bias}")
        object.__setattr__(self, "logit_bias", pairs)  # frozen: normalised once, here
        # The token is the logits' argmax and nothing else is computed: greedy, no logprobs,
        # no penalties, no token bias (logit_bias, min_tokens).
        argmax_past_min = (
            self.logprobs is None and self.greedy and not self.needs_penalties and not pairs
        )
        object.__setattr__(self, "argmax_only", argmax_past_min and not self.min_tokens)
        object.__setattr__(self, "argmax_past_min_tokens", argmax_past_min)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )


# An output token sampled by a step still running on the device (asynchronous scheduling,
# engine/llm_engine.py): it holds the token's place in ``output_token_ids`` from the step's
# launch until the engine reads the token (``Scheduler.resolve_token``). At most one per
# request, always its last output token, and never part of a computed position: a decode
# row whose input is pending gets the token on the device from the step before
# (engine/model_runner.py). Never a real token id (those are >= 0).
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    """waiting -> running -> finished_*, and running -> preempted -> (front of) waiting."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token id
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context length
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class Request:
    """One sequence to generate.

    Token ranges of a request at any moment::

        |<------------- prompt ------------->|<---- output ---->|
        |<---- num_computed_tokens ---->|                       |
                                        |<-- still to compute ->|  = num_tokens - num_computed

    After preemption ``num_computed_tokens`` drops to 0 and the prompt *and* the output so far
    are recomputed; the output is kept, so the request resumes where it stopped.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    # Every further id the model ends a turn with (the checkpoint's; engine/generation_config.py).
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Set when the request first gets a step (queue time ends) and when it ends.
    first_scheduled_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt chunks take a row of logits per token (prompt logprobs)."""
        return self.sampling_params.prompt_logprobs is not None

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - n]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) across prompt and output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
