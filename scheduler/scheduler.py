"""Scheduler: decides, every step, which requests run and how many tokens each computes.

Ownership: the scheduler owns the ``waiting`` and ``running`` queues and, for every request,
``status``, ``num_computed_tokens`` and ``output_token_ids``. Block ids belong to kvpool; the
scheduler asks ``KVCacheManager`` for room and gives it back, nothing more.

One step (called by the engine)::

    out = scheduler.schedule()                      # who runs, how many tokens each
    res = runner.execute(out)                       # forward + sample
    upd = scheduler.update_from_output(out, ...)    # append tokens, stop checks, free blocks

Static and dynamic batches (``policy.runs_to_completion``) with ``static_finished="compute"``
keep their members that finish early as *padding* until the batch ends (scheduler/padding.py).
The batch ends when none of its members is running; the padding's blocks are then freed and
the next batch is admitted in the same ``schedule()`` call.

Helpers, each in its own module: admission decisions and intake size checks
(scheduler/admission.py), the step's token budgets (scheduler/step_budget.py) and stop
conditions (scheduler/stopping.py). They change no scheduler state; every queue and status
change happens here, and ``check_integrity()`` asserts the invariants listed on ``Scheduler``.

With latency targets (``SchedulerConfig.target_*_ms``) every step's prompt tokens are capped
so that the engine's predicted step time keeps them (scheduler/latency_targets.py); the
engine passes its ``StepTimePredictor`` in and reports each step's time (``observe_step``).
Without targets nothing of this runs, and the schedules are those of the plain budgets.

Dynamic batching holds waiting requests back until its window ends; the engine thread must
not spin on empty steps meanwhile: see ``next_admission_time()``.

With prefix caching (``KVCacheManager.enable_prefix_caching``) a request's leading full blocks
already in the cache count as computed on admission, and every step's newly full blocks are
registered in ``update_from_output`` (``KVCacheManager.commit_computed``), after the step
that computed them: a hash is never visible before its K/V exists.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvpool.manager import KVCacheManager
from kvpool.prefix_cache import TokenSource
from scheduler.admission import (
    Refusal,
    RequestTooLargeError,
    StepAdmission,
    check_request_fits,
    hashes_filled_by,
)
from scheduler.config import SchedulerConfig
from scheduler.latency_targets import (
    DecodeLoad,
    LatencyTargets,
    StepTimePredictor,
    TargetDecision,
)
from scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerUpdate
from scheduler.padding import BatchPadding
from scheduler.policy import BatchPolicy, make_policy
from scheduler.request import PENDING_TOKEN, Request, RequestStatus
from scheduler.step_budget import StepBudget
from scheduler.stopping import stop_status, stops_on

__all__ = ["RequestTooLargeError", "Scheduler", "SchedulerUpdate"]


class Scheduler:
    """Iteration-level scheduler with a pluggable batching policy.

    NOTE: invariants (``check_integrity``):
      - a request is in exactly one of ``waiting`` / ``running`` while unfinished;
      - running requests own blocks for at least ``num_computed_tokens`` tokens;
      - waiting requests own no blocks (preemption frees everything);
      - finished requests own no blocks, except ``padding`` members, which keep theirs;
      - ``padding`` is empty unless the batch still has a running member (static/dynamic
        with ``static_finished="compute"`` only), so padding never outlives its batch.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        step_time_predictor: StepTimePredictor | None = None,
    ) -> None:
        """Args:
        config: budgets and batching policy.
        kv_manager: the block tables this scheduler allocates through.
        max_model_len: most tokens (prompt + output) a request may reach.
        clock: the time source of admission windows and timestamps; requests'
            ``arrival_time`` must be on the same clock (tests inject a fake one).
        step_time_predictor: the engine's step-time model; required when ``config`` has
            latency targets, unused otherwise.
        Raises:
            ValueError: latency targets without a predictor.
        """
        self.config = config.for_device("cpu")
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.clock = clock
        self.policy: BatchPolicy = make_policy(config)
        self.keeps_padding = self.policy.runs_to_completion and config.static_finished == "compute"
        # Continuous batching lets a request wait for a prefix another one is computing now;
        # static/dynamic batches admit once per batch, so a wait would last the whole batch.
        self.defers_to_cache = (
            kv_manager.enable_prefix_caching and not self.policy.runs_to_completion
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished members of the running static/dynamic batch, still computed.
        self.padding = BatchPadding()
        self._requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.targets: LatencyTargets | None = None
        if config.has_latency_targets:
            if step_time_predictor is None:
                raise ValueError("latency targets need the engine's step-time predictor")
            self.targets = LatencyTargets(config, step_time_predictor)

    # ---- intake ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS).

        Raises:
            RequestTooLargeError: prompt + max_tokens exceeds ``max_model_len`` or needs more
                blocks than the whole pool holds, so it could never finish.
        """
        # A padding request is finished but still owns blocks under its id.
        if request.request_id in self._requests or self.kv.has_request(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_request_fits(request, self.max_model_len, self.kv)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish requests as aborted and free their blocks at once; unknown ids are ignored.

        Returns:
            The requests that were aborted.
        """
        aborted = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        self._end_batch_if_done()
        return aborted

    # ---- the step -------------------------------------------------------------------------

    def schedule(
        self, draft_token_ids: Mapping[str, Sequence[int]] | None = None
    ) -> SchedulerOutput:
        """Plan one step: running requests first (one decode token, or their next prefill
        chunk), then padding rows, then admissions the policy allows, all under
        ``max_num_batched_tokens``.

        Args:
            draft_token_ids: speculative decoding's proposals, request id -> tokens that
                may follow a running request's known ones. A decoding request with a
                proposal is scheduled as ``1 + k`` tokens when the budget and the pool
                allow it without preempting anyone; else as a plain decode.
        Returns:
            The scheduled requests in batch order and the ids preempted this step. Empty
            when nothing can run (e.g. dynamic batching waiting for its window).
        """
        out = SchedulerOutput()
        chunk = self.config.prefill_chunk_tokens
        assert chunk is not None  # resolved for a device in __init__
        step = StepBudget.for_step(
            self.config.max_num_batched_tokens,
            chunk,
            self.running,
            self._admissible(),
        )
        if self.targets is not None:
            out.target = self._cap_prefill(step)
        self._schedule_running(out, step, draft_token_ids or {})
        # Padding needs no check for an ended batch here: preemption releases all padding
        # before it takes a live request, so a batch emptied by preemption has none left.
        self._schedule_padding(out, step)
        # No admission in a step that had to preempt: memory is short already.
        if not out.preempted_ids:
            kv = self.kv
            queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
            self._admit(out, step)
            out.num_prefix_cache_queries = kv.prefix_cache_queries - queries
            out.num_prefix_cache_hits = kv.prefix_cache_hits - hits
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        return out

    def observe_step(self, step_s: float, gap_s: float | None, had_decodes: bool) -> None:
        """The engine reports a step's measured time (only used with latency targets).

        Args:
            step_s: the step's wall time.
            gap_s: the engine loop's time since the previous step ended, if it was busy
                all along; None after an idle spell.
            had_decodes: whether any request decoded in the step.
        """
        if self.targets is not None:
            self.targets.observe(step_s, gap_s, had_decodes)

    def next_admission_time(self) -> float | None:
        """The engine thread's sleep hint while dynamic batching holds requests back.

        ``schedule()`` returns an empty ``SchedulerOutput`` while waiting requests sit out dynamic
        batching's window, so an engine loop that steps whenever requests are unfinished
        would spin. The engine thread should instead, when this returns a time ``t``, wait
        for new requests (which can fill a batch early) with a timeout of
        ``t - clock()`` (clamped at 0), then step again.

        Returns:
            None when no timed wait is pending: a batch is running, nothing waits, or the
            next ``schedule()`` admits (step now, or sleep until a request arrives if
            nothing is unfinished). Otherwise the time, on this scheduler's clock
            (``time.monotonic`` by default), at which the waiting requests form a batch.
        """
        if self.running or not self.waiting:
            return None
        if self.policy.may_admit(self.running, self.waiting, self.clock()):
            return None
        return self.policy.admission_time(self.waiting)

    def _admissible(self) -> Iterable[Request]:
        """The waiting requests this step's admission could take, by the policy and
        ``max_num_seqs`` (blocks and the budget may take fewer)."""
        if not self.waiting or not self.policy.may_admit(self.running, self.waiting, self.clock()):
            return ()
        limit = self.policy.admission_limit(self.config.max_num_seqs, len(self.running))
        return itertools.islice(self.waiting, limit)

    def _cap_prefill(self, step: StepBudget) -> TargetDecision:
        """Cap the step's prompt tokens by the latency targets (``step.prompt`` only shrinks;
        decodes are never capped)."""
        assert self.targets is not None
        num_rows = len(self.padding)
        num_context = sum(r.num_computed_tokens for r in self.padding.requests)
        prefilling = []
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                num_rows += 1
                num_context += request.num_computed_tokens + 1
            else:
                prefilling.append(request)
        start = prefilling[0].num_computed_tokens if prefilling else 0
        decision = self.targets.decide(
            DecodeLoad(num_rows, num_context, start),
            step.prompt,
            prefilling,
            self.waiting,
            self.clock(),
        )
        step.prompt = min(step.prompt, decision.prefill_cap)
        return decision

    def _schedule_running(
        self, out: SchedulerOutput, step: StepBudget, drafts: Mapping[str, Sequence[int]]
    ) -> None:
        """Schedule running requests, oldest first, preempting the newest when blocks run
        out. Decodes cost one token each and admission order puts prefilling requests
        last, so decodes go before any prefill chunk and a long prompt cannot stall them.
        """
        index = 0
        while index < len(self.running) and step.tokens > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 1 and drafts and drafts.get(request.request_id):
                item = self._schedule_speculative(request, drafts[request.request_id], step)
                if item is not None:
                    out.scheduled.append(item)
                    step.spend(item.num_tokens, prompt=False)
                    index += 1
                    continue
            # A decode always fits: the loop runs while tokens are left.
            num_new = 1 if remaining == 1 else step.fit(remaining, scores=request.scores_prompt)
            if num_new == 0:
                index += 1
                continue
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request preempted itself: nothing newer is left to schedule
            item = self._scheduled(request, num_new)
            out.scheduled.append(item)
            step.spend(num_new, prompt=remaining > 1, scored=item.num_scored)
            index += 1

    def _schedule_speculative(
        self, request: Request, draft: Sequence[int], step: StepBudget
    ) -> ScheduledRequest | None:
        """A decoding request's row with its proposed tokens, if the step's budget and the
        pool hold them. Speculative slots never preempt anyone: without free blocks for
        them the request runs a plain decode.

        Returns:
            The row (blocks allocated), or None to schedule a plain decode instead.
        """
        # Never verify past what the request may still emit: the last draft position's
        # logits give one more token, so k drafts can yield k + 1 tokens.
        params = request.sampling_params
        room = min(
            params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )
        num_draft = min(len(draft), step.tokens - 1, room - 1)
        if num_draft < 1:
            return None
        request_id = request.request_id
        num_blocks_before = len(self.kv.block_ids(request_id))
        start = request.num_computed_tokens
        # Leave a block per running request, so the drafts' slots do not make a request
        # behind this one preempt for its plain decode.
        need = self.kv.num_new_blocks_needed(request_id, start + 1 + num_draft)
        if need > 0 and need + len(self.running) > self.kv.num_free_blocks:
            return None
        if self.kv.allocate_slots(request_id, start + 1 + num_draft) is None:
            return None
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        proposed = tuple(draft[:num_draft])
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=1 + num_draft,
            token_ids=request.token_ids(start, start + 1) + list(proposed),
            block_ids=self.kv.block_ids(request_id),
            samples=True,
            draft_token_ids=proposed,
            num_blocks_before=num_blocks_before,
        )

    def _schedule_padding(self, out: SchedulerOutput, step: StepBudget) -> None:
        """A dummy row per padding member. Padding takes the budget live requests left; a
        step whose budget a prefill chunk used up skips it (which happens only while a
        member's prompt is still being chunked).
        """
        rows = self.padding.rows(self.kv, step.tokens)
        out.scheduled.extend(rows)
        step.spend(len(rows), prompt=False)

    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, int | list[int]]
    ) -> SchedulerUpdate:
        """Advance every scheduled request, append sampled tokens, apply stop conditions.

        Args:
            out: what ``schedule()`` returned for this step.
            sampled: request id -> the token sampled for it (requests whose chunk reached
                their last token); for a speculative row, the list of tokens its
                verification emits (the accepted drafts, then the target's own token).
        Returns:
            Requests that got a token, and requests that finished (their blocks are free).
        """
        update = SchedulerUpdate()
        now = self.clock()
        running = RequestStatus.RUNNING  # one enum lookup, not one per row
        for item in out.scheduled:
            request = item.request
            if item.padding or request.status != running:
                continue  # padding, or aborted between schedule and update
            result = sampled.get(request.request_id)
            token_source: TokenSource = request.token_ids
            if item.draft_token_ids:
                token_source = self._advance_speculative(item, result)
            else:
                request.num_computed_tokens += item.num_tokens
            # Before any stop check frees the blocks: freed blocks keep their new hashes.
            self.kv.commit_computed(request.request_id, request.num_computed_tokens, token_source)
            if result is None:
                continue
            for token_id in [result] if isinstance(result, int) else result:
                request.output_token_ids.append(token_id)
                update.new_tokens.append((request, token_id))
                status = stop_status(request, token_id, self.max_model_len)
                if status is not None:
                    self.running.remove(request)
                    if self.keeps_padding:
                        self._finish(request, status, now, keep_blocks=True)
                        self.padding.add(request)
                    else:
                        self._finish(request, status, now)
                    update.finished.append(request)
                    break  # tokens verified after a stop are dropped
        self._end_batch_if_done()
        return update

    def resolve_token(self, request: Request, token_id: int) -> bool:
        """Put a pending token's value in place (asynchronous scheduling: the step that
        sampled it was updated with ``PENDING_TOKEN`` when it was launched) and apply the
        stop checks that need the value, EOS and stop token ids; the count checks ran then.

        The request may have moved on meanwhile: preempted (it waits, and recomputes the
        token with the rest once re-admitted), finished by length at this very token (EOS
        then outranks length, as in ``stop_status``) or aborted (nothing to do).

        Returns:
            True if the token finished the request now (its blocks are free).
        """
        outputs = request.output_token_ids
        if not outputs or outputs[-1] != PENDING_TOKEN:
            raise ValueError(f"{request.request_id!r} has no pending token")
        outputs[-1] = token_id
        if not stops_on(request, token_id):
            return False
        status = request.status
        if status == RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED
            return False
        if status.finished:
            return False
        if status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:  # preempted while its token was on the device
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        self._end_batch_if_done()
        return True

    def _advance_speculative(
        self, item: ScheduledRequest, emitted: int | list[int] | None
    ) -> TokenSource:
        """Count the computed tokens of a speculative row and give back the slots of its
        rejected drafts::

            | start | d1 .. da (accepted) | d(a+1) .. dk (rejected) |
            |<-- computed: 1 + a ------->|<-- slots rolled back --->|

        ``emitted`` is ``a`` accepted drafts plus the target's next token (not computed
        yet: it is next step's decode), so ``1 + a == len(emitted)``.
        """
        request = item.request
        if emitted is None or isinstance(emitted, int):
            num_emitted = 1 if emitted is not None else 0
        else:
            num_emitted = len(emitted)
        if not 1 <= num_emitted <= item.num_tokens:
            raise ValueError(
                f"{request.request_id!r}: a speculative row of {item.num_tokens} tokens "
                f"cannot emit {num_emitted}"
            )
        request.num_computed_tokens = item.start + num_emitted
        self.kv.rollback_slots(
            request.request_id, request.num_computed_tokens, min_blocks=item.num_blocks_before
        )
        # The accepted drafts are computed before they are appended to the output (below,
        # with the stop checks): hashes read them from the verified list.
        accepted = list(item.draft_token_ids[: num_emitted - 1])
        if not isinstance(emitted, int) and emitted is not None and emitted[:-1] != accepted:
            raise ValueError(f"{request.request_id!r}: emitted tokens differ from its drafts")

        def token_source(start: int, end: int) -> list[int]:
            # Known tokens, then the accepted drafts: only [start, end) of them is built.
            n = request.num_tokens
            head = request.token_ids(min(start, n), min(end, n))
            return head + accepted[max(start - n, 0) : max(end - n, 0)]

        return token_source

    # ---- helpers --------------------------------------------------------------------------

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """The row of ``num_new`` tokens from the request's computed ones."""
        start = request.num_computed_tokens
        end = start + num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        samples = end == request.num_tokens
        num_scored = 0
        if (num_new > 1 or not samples) and request.scores_prompt:
            num_scored = max(0, min(end, request.num_prompt_tokens - 1) - start)
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=num_new,
            token_ids=request.token_ids(start, end),
            block_ids=self.kv.block_ids(request.request_id),
            samples=samples,
            num_scored=num_scored,
        )

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Find blocks for ``num_new`` more tokens of a running request, preempting the most
        recently admitted running requests (by recompute) until they fit.

        Returns:
            False if ``request`` itself had to be preempted.
        """
        target = request.num_computed_tokens + num_new
        while self.kv.allocate_slots(request.request_id, target) is None:
            if self.padding:
                # A live request's progress is worth more than padding's wasted compute:
                # stop computing the most recently finished member before preempting.
                self.padding.release_newest(self.kv)
                continue
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free every block and send the request to the front of the queue; its output so
        far is kept and recomputed together with the prompt when it is re-admitted (minus
        the blocks the prefix cache still holds then)."""
        self.kv.free(request.request_id, forget=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _admit(self, out: SchedulerOutput, step: StepBudget) -> None:
        """Admit waiting requests FCFS while the policy, ``max_num_seqs``, the token budget
        and the pool allow (scheduler/admission.py decides and allocates); schedule the
        first chunk of each. A request deferred to a prefix another row computes this step
        is skipped without blocking the queue behind it.
        """
        if not self.policy.may_admit(self.running, self.waiting, self.clock()):
            return
        # New requests' first chunks are all prompt tokens.
        allowed = min(step.tokens, step.prompt)
        scored_before = step.scored
        admission = StepAdmission(
            self.config,
            self.kv,
            self.max_model_len,
            budget=allowed,
            scored=step.scored,
            limit=self.policy.admission_limit(self.config.max_num_seqs, len(self.running)),
            admits_without_budget=self.policy.admits_without_budget,
            filling=hashes_filled_by(self.kv, out.scheduled) if self.defers_to_cache else None,
        )
        index = 0
        while index < len(self.waiting) and admission.has_room:
            request = self.waiting[index]
            admitted = admission.try_admit(request)
            if admitted is Refusal.DEFER:
                index += 1
                continue
            if admitted is Refusal.STOP:
                break
            del self.waiting[index]
            request.num_computed_tokens = admitted.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if admitted.num_new > 0:
                item = self._scheduled(request, admitted.num_new)
                out.scheduled.append(item)
                admission.add_scheduled(item)
        step.spend(allowed - admission.budget, prompt=True, scored=scored_before - admission.scored)

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        now: float | None = None,
        *,
        keep_blocks: bool = False,
    ) -> None:
        """Mark ``request`` finished and stop tracking it; free its blocks unless it stays
        in the batch as padding (``keep_blocks``)."""
        if not keep_blocks:
            self.kv.free(request.request_id)
        request.status = status
        request.finished_time = now if now is not None else self.clock()
        del self._requests[request.request_id]

    def _end_batch_if_done(self) -> None:
        """Free the padding once no member of its batch is running: the batch has ended."""
        if not self.running:
            self.padding.release_all(self.kv)

    # ---- views ----------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running (padding is finished and not counted)."""
        return len(self.waiting) + len(self.running)

    @property
    def num_padding(self) -> int:
        """Finished members of the running batch still being computed as padding."""
        return len(self.padding)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs; padding exists only while one runs."""
        return bool(self.waiting or self.running)

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing is left: no request queued, running, tracked
        or kept as padding, and every KV block back in the pool (``KVCacheManager.
        check_idle``). Constant time in the pool's size: what the engine checks each time it
        goes idle, where ``check_integrity`` would walk every block."""
        assert not self.running and not self.waiting, "requests left"
        assert not self._requests, f"untracked requests: {sorted(self._requests)[:5]}"
        assert not self.padding, "padding outlived its batch"
        self.kv.check_idle()

    def check_integrity(self) -> None:
        """Raise AssertionError if the queues, statuses or block ownership disagree (the
        invariants listed on this class). Checks kvpool first; reads the queues and asks
        kvpool what each request holds; changes nothing. Tests call it after every step."""
        kv = self.kv
        kv.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is running twice"
        assert len(waiting_ids) == len(self.waiting), "a request is waiting twice"
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self._requests), "untracked request"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            held = len(kv.block_ids(request.request_id)) * kv.block_size
            assert held >= request.num_computed_tokens, f"{request.request_id} lost blocks"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not kv.has_request(request.request_id), (
                f"waiting {request.request_id} holds blocks"
            )
        assert not self.padding or (self.keeps_padding and self.running), (
            "padding outlived its batch"
        )
        self.padding.check_integrity(kv, running_ids | waiting_ids)
        for request in [*self.running, *self.padding.requests]:
            live = kv.num_live_tokens(request.request_id)
            assert live == request.num_computed_tokens, (
                f"{request.request_id}: kvpool counts {live} live tokens, "
                f"{request.num_computed_tokens} computed"
            )
