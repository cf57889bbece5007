"""Admission: whether a request may ever be queued, which waiting requests join the running
batch this step, and how far each runs.

``check_request_fits`` refuses at intake a request that could never run even alone.

The scheduler walks its queue head first and asks ``StepAdmission.try_admit`` about each
request; this module decides (budget, ``max_num_seqs``, prefix cache, reserve mode) and takes
the request's blocks from kvpool. A request's leading blocks found in the prefix cache are
shared and count as computed::

    tokens  |<-- cached (num_computed_tokens) -->|<-- first chunk: num_new -->| ...

Ownership: this module changes no scheduler state. The scheduler moves an admitted request
from ``waiting`` to ``running`` and sets its ``status`` and ``num_computed_tokens``; block ids
change only inside ``KVCacheManager.allocate_slots``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.manager import KVCacheManager
from kvpool.prefix_cache import BlockHash, CachedPrefix
from scheduler.config import SchedulerConfig
from scheduler.output import ScheduledRequest
from scheduler.request import Request


class RequestTooLargeError(ValueError):
    """The request can never run: it does not fit the model or the whole KV pool alone."""


def check_request_fits(request: Request, max_model_len: int, kv: KVCacheManager) -> None:
    """Refuse, before it is queued, a request that could never finish even alone: memory
    pressure alone never fails a request that passes this (preemption makes room).

    Args:
        request: a new request.
        max_model_len: most tokens (prompt + output) a request may reach.
        kv: the block tables (for the pool's size).
    Raises:
        RequestTooLargeError: prompt + max_tokens exceeds ``max_model_len`` or needs more
            blocks than the whole pool holds.
    """
    total = request.num_prompt_tokens + request.sampling_params.max_tokens
    if total > max_model_len:
        raise RequestTooLargeError(
            f"this request needs {request.num_prompt_tokens} prompt tokens + "
            f"{request.sampling_params.max_tokens} max_tokens = {total} tokens, more than "
            f"the model's context length of {max_model_len}"
        )
    if not kv.fits_in_empty_pool(total):
        raise RequestTooLargeError(
            f"this request needs {total} tokens of KV cache, more than the whole pool "
            f"({kv.num_blocks * kv.block_size} tokens); lower max_tokens or "
            "start the server with a larger KV cache"
        )


class Refusal(enum.Enum):
    """Why ``try_admit`` did not admit a request."""

    # Its first missing block is being filled in this very step by another request: skip it
    # (the queue behind it may still be admitted); next step that block is a hit.
    DEFER = "defer"
    # No token budget or no blocks left: FCFS, so nobody behind it jumps the queue.
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request's start: its blocks are allocated already.

    Args:
        num_computed_tokens: tokens the prefix cache supplies (the request starts there).
        num_new: tokens it computes this step (0 when admitted without budget).
    """

    num_computed_tokens: int
    num_new: int


def hashes_filled_by(kv: KVCacheManager, items: Iterable[ScheduledRequest]) -> set[BlockHash]:
    """Args:
        kv: the block tables (read only).
        items: rows of this step; padding rows compute nothing new and are skipped.
    Returns:
        Hashes of the blocks that the given rows make full in this step.
    """
    return {
        block_hash
        for item in items
        if not item.padding
        for block_hash in kv.new_block_hashes(
            item.request_id, item.start, item.known_end, item.request.token_ids
        )
    }


class StepAdmission:
    """The admission state of one ``schedule()`` call: token budget left, requests admitted,
    and (with ``defers_to_cache``) the block hashes this step already fills.

    With ``defers_to_cache``, a request whose first missing block is being filled in this
    step by another request waits one step (``Refusal.DEFER``): ``n > 1`` choices of one
    prompt, or a burst of requests with one system prompt, then compute the prefix once, not
    once each.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        *,
        budget: int,
        scored: int,
        limit: int,
        admits_without_budget: bool,
        filling: set[BlockHash] | None,
    ) -> None:
        """Args:
        config: its ``block_allocation`` (``optimistic`` or ``reserve``) is read.
        kv: the block tables admissions allocate through.
        max_model_len: most tokens a request may reach (caps a reservation).
        budget: tokens left in this step.
        scored: prompt tokens of prompt-logprobs requests left in this step
            (``StepBudget.scored``).
        limit: most requests this step may admit.
        admits_without_budget: admit a request even when no budget is left for its first
            chunk (the policy's ``admits_without_budget``).
        filling: hashes the step's rows so far make full, or None not to defer to them.
        """
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.budget = budget
        self.scored = scored
        self.limit = limit
        self.admits_without_budget = admits_without_budget
        self.filling = filling
        self.num_admitted = 0

    @property
    def has_room(self) -> bool:
        """Whether another request may still be admitted this step."""
        return self.num_admitted < self.limit

    def try_admit(self, request: Request) -> Admission | Refusal:
        """Look ``request`` up in the prefix cache and allocate its blocks if it may start.

        Args:
            request: a waiting request (it owns no blocks).
        Returns:
            Its ``Admission`` (blocks allocated, counted against the limit), or why not.
        """
        scores = request.scores_prompt
        if scores:
            # Every prompt token's logits are wanted: nothing is taken from the cache.
            cached = CachedPrefix((), request.num_tokens, 0, 0)
        else:
            cached = self.kv.get_cached_prefix(
                request.request_id, request.num_tokens, request.token_ids
            )
        if self.filling is not None and cached.next_block_hash in self.filling:
            return Refusal.DEFER
        num_new = min(request.num_tokens - cached.num_computed_tokens, self.budget)
        if scores and num_new > 1:
            num_new = min(num_new, self.scored)
        if num_new == 0 and not self.admits_without_budget:
            return Refusal.STOP
        reserve_to = cached.num_computed_tokens + num_new
        if self.config.block_allocation == "reserve":
            # Room for the whole prompt and every token it may generate, so it never
            # needs a block later and is never preempted.
            reserve_to = min(
                request.num_prompt_tokens + request.sampling_params.max_tokens,
                self.max_model_len,
            )
        if self.kv.allocate_slots(request.request_id, reserve_to, cached) is None:
            return Refusal.STOP
        self.num_admitted += 1
        return Admission(cached.num_computed_tokens, num_new)

    def add_scheduled(self, item: ScheduledRequest) -> None:
        """Charge an admitted request's first chunk to the budget.

        Args:
            item: the row the scheduler built for it.
        """
        self.budget -= item.num_tokens
        self.scored -= item.num_scored
        if self.filling is not None:
            self.filling.update(hashes_filled_by(self.kv, [item]))
