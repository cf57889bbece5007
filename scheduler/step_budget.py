"""StepBudget: what the step being planned may still compute.

Two limits, spent together as the scheduler plans a step: ``tokens``, every token of the step
(decodes, prompt chunks, padding rows; ``max_num_batched_tokens``), and, of those, ``prompt``,
the prompt tokens (chunks of prompts, or of a preempted request's recompute).

A third limit, ``scored``, bounds the prompt tokens of requests that asked for prompt
logprobs (``SamplingParams.prompt_logprobs``): each such token takes a row of logits, vocab x
4 bytes (twice while they are turned into logprobs), where a step otherwise takes one row
per request. ``MAX_SCORED_TOKENS`` rows of a 128k vocabulary are 0.5 GiB.

The prompt limit is the prefill-wave rule. When all the prefill work in sight (running
requests' remaining tokens, decodes included, plus the waiting requests the step could
admit) fits in ``tokens``, the step may compute all of it, so a burst of prompts is
prefilled together and then decodes together. Otherwise the step takes at most
``prefill_chunk_tokens`` prompt tokens: a deeper queue drains in shorter steps, so requests
start sooner and running decodes wait less between tokens (scheduler/config.py has the
measurements behind the defaults).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.request import Request

# Prompt tokens of prompt-logprobs requests one step computes (see above).
MAX_SCORED_TOKENS = 1024


def _remaining(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


@dataclass(slots=True)
class StepBudget:
    tokens: int
    prompt: int
    scored: int = MAX_SCORED_TOKENS

    @classmethod
    def for_step(
        cls,
        max_tokens: int,
        prefill_chunk_tokens: int,
        running: Iterable[Request],
        admissible: Iterable[Request],
    ) -> StepBudget:
        """Args:
        max_tokens: the step's token budget (``max_num_batched_tokens``).
        prefill_chunk_tokens: the prompt tokens a step takes when its work does not fit.
        running: the running requests.
        admissible: the waiting requests this step's admission could take (by the policy
            and ``max_num_seqs``; blocks and budget may take fewer).
        """
        demand = sum(map(_remaining, running)) + sum(map(_remaining, admissible))
        if demand <= max_tokens:
            return cls(max_tokens, max_tokens, MAX_SCORED_TOKENS)
        return cls(max_tokens, min(prefill_chunk_tokens, max_tokens), MAX_SCORED_TOKENS)

    def fit(self, remaining: int, *, scores: bool = False) -> int:
        """How many of a request's ``remaining`` tokens the step can take: a decode (one
        token) counts against ``tokens`` only, a prompt chunk against both limits, and one
        of a request that ``scores`` its prompt (prompt logprobs) against ``scored`` too."""
        if remaining > 1:
            if scores:
                return min(remaining, self.tokens, self.prompt, self.scored)
            return min(remaining, self.tokens, self.prompt)
        return min(remaining, self.tokens)

    def spend(self, num_tokens: int, *, prompt: bool, scored: int = 0) -> None:
        self.tokens -= num_tokens
        self.scored -= scored
        if prompt:
            self.prompt -= num_tokens
