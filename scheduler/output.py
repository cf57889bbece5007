"""The scheduler's contracts: ``SchedulerOutput``, what one step computes, handed to the
model runner, and ``SchedulerUpdate``, what ``update_from_output`` changed, handed to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.latency_targets import TargetDecision
from scheduler.request import PENDING_TOKEN, Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The step computes positions ``[start, start + num_tokens)`` of the request::

        |<---- start (already in the KV cache) ---->|<-- num_tokens (this step) -->|

    ``request`` is passed for reading only (sampling params, token ids for penalties); the
    runner must not change it.

    A *padding* row (static/dynamic batching, ``static_finished="compute"``) belongs to a
    request that already finished but stays in its batch until the batch ends. It is one
    token, ``samples`` is False, and ``start`` is the request's last computed position:
    the runner computes it like a decode over the ``seq_len`` cached tokens but must write
    no K/V (slot -1: the cache already holds that position) and use no logits of it.

    A *speculative* row (speculative decoding, ``draft_token_ids`` not empty) is a decode
    followed by ``k`` proposed tokens that are not the request's yet::

        | start: the last known token | d1 | d2 | ... | dk |   num_tokens = 1 + k

    The runner computes it like a prefill chunk, takes logits at all ``1 + k`` positions
    and verifies the drafts (engine/spec_decode/); the scheduler then keeps the accepted
    prefix and gives back the slots of the rest (``KVCacheManager.rollback_slots``).

    A *scoring* chunk (``num_scored`` > 0, a request that asked for prompt logprobs) also
    takes logits at its first ``num_scored`` positions, each the distribution of the
    prompt token after it (engine/prompt_logprobs.py)::

        | start | start + 1 | ... (num_scored rows) | ... | last: samples, if it does |
                                                       ^ at most the prompt's last - 1
    """

    request: Request
    start: int
    num_tokens: int
    token_ids: list[int]  # the tokens at positions [start, start + num_tokens)
    block_ids: tuple[int, ...]  # the request's whole block table after allocation
    samples: bool  # the chunk reaches the request's last token: sample the next one
    padding: bool = False  # a finished request's dummy row (see above)
    draft_token_ids: tuple[int, ...] = ()  # proposed tokens after the known ones (see above)
    # Blocks the request held before this step's allocation: a rollback keeps at least these.
    num_blocks_before: int = 0
    # Positions from ``start`` whose next prompt token's logprob the step reports (see above).
    num_scored: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def input_pending(self) -> bool:
        """Whether the row's one input token is still on the device (asynchronous
        scheduling: ``PENDING_TOKEN``, a decode of the step before's pick)."""
        return self.token_ids[0] == PENDING_TOKEN

    @property
    def known_end(self) -> int:
        """End of the positions this step computes that hold known tokens (drafts excluded):
        only these can fill a block whose hash is certain. A decode of a pending token
        (asynchronous scheduling) computes no known one."""
        if self.input_pending:
            return self.start
        return self.start + self.num_tokens - len(self.draft_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens of context after this step (cached prefix + this chunk)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """Who runs this step, in batch order, and what changed in the queues.

    ``blocks_to_copy`` are copy-on-write copies (``(src_block_id, dst_block_id)``) that
    kvpool queued while admitting requests whose tokens were all cached: the runner must copy
    those K/V blocks (``KVCacheStorage.copy_blocks``) before this step's forward pass.

    ``target`` is what the latency targets decided for this step (None without targets).

    ``num_prefix_cache_queries`` / ``num_prefix_cache_hits``: the prompt tokens this step's
    admissions looked up in the prefix cache, and of those the ones found cached. They are
    the step's own, as ``preempted_ids`` are: with asynchronous scheduling a step's figures
    are recorded after the next step was scheduled, so kvpool's running totals then
    already include the next step's admissions.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    target: TargetDecision | None = None
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the step computes, padding rows included."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_padding_tokens(self) -> int:
        """Padding rows: computed, but nobody's output."""
        return sum(1 for s in self.scheduled if s.padding)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerUpdate:
    """What ``update_from_output`` changed: requests with a new token, and finished ones."""

    new_tokens: list[tuple[Request, int]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
