"""LLMEngine: one step = schedule -> execute -> update.

Not thread-safe: exactly one thread calls it (the server's engine thread, or the offline
``LLM``). The engine returns token ids; detokenizing and stop strings belong to the server.

Asynchronous scheduling (``EngineConfig.async_scheduling``) overlaps the host's work with
the device's: step k is scheduled and launched while step k-1 still runs, and step k-1's
tokens are read after step k is queued behind it::

    step() call k:  schedule k | launch k | wait for k-1, emit its tokens | update k
    device:         ... step k-1 ............ | step k .................................

Step k's decodes take step k-1's picks as inputs on the device (``PENDING_TOKEN`` holds
their place in the plan and in ``output_token_ids``). Step k's picks are queued after step
k-1 is read, while step k's forward pass runs, so penalties and grammars see every token
before them. Step k is updated with pending tokens: counts advance and length limits apply
at launch, EOS and stop tokens once a token is read (``Scheduler.resolve_token``). So each
``step()`` returns the tokens of the step launched before it, and a request that meets EOS
has computed one row more than it keeps. Speculative decoding runs synchronously (its
drafts follow the last token). By default it is on for one CUDA device with continuous
batching (``EngineConfig.async_scheduling_for``).

Where pending tokens go: the runner writes step k's decode inputs from step k-1's picks with
one device-side ``index_copy_`` before the forward pass reads them. A block is hashed only
once every token in it is known (``ScheduledRequest.known_end``), so the prefix cache never
holds a pending value. Under tensor parallelism rank 0 broadcasts each step's picks over the
device group once they are queued, and the workers feed their pending inputs from them
(``StepPlan.shares_picks``, ``PlanRow.pick_row``). A step's figures (``StepStats``, the
latency targets' observation, the step trace) are recorded when it is read, timed from the
read before it while steps are pipelined; its counts (rows, preemptions, prefix-cache
lookups and hits) come from its plan, since the scheduler and the pool have moved on to the
next step by then.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from engine.builder import ServedModel, build_engine_parts
from engine.config import EngineConfig
from engine.faults import EngineFatalError, describe, execute_isolating
from engine.model_runner import LaunchedStep
from engine.outputs import EngineOccupancy, ModelRunnerOutput, RequestOutput, StepStats
from engine.prompt_logprobs import PromptLogprobs
from engine.stats import StepStatsRecorder
from engine.step_predictor import StepShape
from engine.step_trace import StepTrace
from engine.structured import GrammarCache, GrammarError, StructuredDecoder
from engine.tp_launch import launch
from kvpool.config import KVPoolConfig
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.request import PENDING_TOKEN, Request, RequestStatus, SamplingParams
from scheduler.scheduler import SchedulerUpdate

logger = logging.getLogger(__name__)


class LLMEngine:
    """The step loop and the request API over the parts ``engine/builder.py`` assembles:
    ``served`` (what is served, read-only) and the components the step drives.

    ``runner`` is a public attribute: anything with ``execute(plan) -> ModelRunnerOutput``
    may replace it after construction (tests wrap it to inject faults).
    """

    # What is served, read from ``served`` (``ServedModel``, its one owner): read-only.
    config = property(attrgetter("served.config"))
    device = property(attrgetter("served.device"))
    dtype = property(attrgetter("served.dtype"))
    model_id = property(attrgetter("served.model_id"))
    model_config = property(attrgetter("served.model_config"))
    max_model_len = property(attrgetter("served.max_model_len"))
    tokenizer = property(attrgetter("served.tokenizer"))
    eos_token_id = property(attrgetter("served.eos_token_id"))
    eos_token_ids = property(attrgetter("served.eos_token_ids"))
    sampling_defaults = property(attrgetter("served.sampling_defaults"))
    attention_backend = property(attrgetter("served.attention_backend"))
    matmul_weights = property(attrgetter("served.matmul_weights"))
    memory = property(attrgetter("served.memory"))

    def __init__(
        self,
        config: EngineConfig | None = None,
        kv_config: KVPoolConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        *,
        exit_on_tp_failure: bool = False,
    ) -> None:
        """``exit_on_tp_failure``: a broken tensor-parallel group exits the process with
        status 1 (the server); otherwise the next step raises ``EngineFatalError``."""
        config = config or EngineConfig()
        kv_config = kv_config or KVPoolConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        if config.async_scheduling and scheduler_config.batching != "continuous":
            # Static and dynamic batches keep finished members as padding rows, which a
            # step scheduled before the finish is known would have to take back.
            raise ValueError("--async-scheduling needs --batching continuous")
        tp = None
        if config.tensor_parallel_size > 1:  # rank 0: start the other ranks, join them
            tp = launch(config, kv_config, scheduler_config, exit_on_failure=exit_on_tp_failure)
        parts = build_engine_parts(config, kv_config, scheduler_config, tp=tp)
        # What is served: fixed at build, read through the properties above.
        self.served: ServedModel = parts.served
        # The components the step loop drives, the engine's from here; ``speculator``
        # (engine/spec_decode/) is None when speculative decoding is off.
        self.model = parts.model
        self.storage = parts.storage
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.runner: Any = parts.runner
        self.speculator = parts.speculator
        self.cost_model = parts.cost_model
        self.kv_capacity = parts.kv_capacity
        self.tp = parts.tp  # the tensor-parallel group, or None
        # With latency targets: the model the scheduler sizes prefill with, calibrated here.
        self.step_predictor = parts.step_predictor
        self._stats = StepStatsRecorder(parts.cost_model, parts.kv_capacity)
        # Structured output (engine/structured.py): the grammar cache is shared with the
        # server, which compiles a request's grammar before queueing it; the decoder and the
        # requests parked until their grammar is compiled are this thread's.
        self.grammars: GrammarCache | None = None
        self.structured: StructuredDecoder | None = None
        self._awaiting_grammar: dict[str, Request] = {}
        # The prompt logprobs of requests still prefilling (engine/prompt_logprobs.py).
        self.prompt_logprobs = PromptLogprobs()
        if self.tokenizer is not None and self.eos_token_id is not None:
            # A completed grammar ends at any id a request stops at (Llama 3's <|eot_id|>
            # as well as <|end_of_text|>), not only the first EOS.
            self.grammars = GrammarCache(
                self.tokenizer,
                self.model_config.vocab_size,
                list(self.eos_token_ids) or [self.eos_token_id],
            )
            # On CUDA the host fills masks while the GPU runs the forward pass; on the CPU
            # the forward pass has used every core, so picks are checked and only refused
            # rows masked (engine/structured.py).
            self.structured = StructuredDecoder(
                self.grammars, check_first=self.device.type == "cpu"
            )
            self.sampler.constraint = self.structured
        self.last_step_stats: StepStats | None = None
        # Asynchronous scheduling (module docstring): the step launched and not yet read.
        self.async_scheduling = parts.async_scheduling
        if self.async_scheduling and self.device.type == "cpu":
            # The forward pass runs on the calling thread: there is no device to overlap,
            # and each token is read one forward pass later.
            logger.warning(
                "--async-scheduling on the CPU hides no host work and delays each token by "
                "one step; it is meant for GPUs"
            )
        elif self.async_scheduling:
            logger.info(
                "asynchronous scheduling%s: each step is scheduled and launched while the one "
                "before runs (--async-scheduling false: one step at a time)",
                "" if config.async_scheduling else " (the CUDA default)",
            )
        self._in_flight: _InFlight | None = None
        # perf_counter() when the last launched step was read: the next one's figures are
        # timed from there while the steps are pipelined.
        self._last_read_end: float | None = None
        # perf_counter() at the end of the last step while requests remained (the engine
        # loop's gap before the next step counts in its decodes' inter-token latency).
        self._busy_end: float | None = None
        # A JSON line per step when $PAGEDSERVE_STEP_TRACE names a file (engine/step_trace.py).
        self.step_trace = StepTrace.from_env(
            parts.cost_model,
            parts.kv_capacity.bytes_per_token,
            {"model": config.model, "scheduler": dataclasses.asdict(scheduler_config)},
        )
        if self.device.type == "cuda":
            self.warm_up(self.scheduler.config.max_num_batched_tokens)

    def warm_up(self, max_step_tokens: int) -> float:
        """Serve a few synthetic requests before any real one: prompts of lengths that meet
        the kernels' specialisations (1, around a block, around 16, a long chunk), decoded
        together, so Triton compiles everything a first real request would wait for. Their
        blocks are freed and dropped from the prefix cache, whose counters start again: what
        ``/metrics`` shows (cached and evictable blocks among them) is the served requests'
        alone. Returns seconds."""
        start = time.perf_counter()
        vocab = self.model_config.vocab_size
        longest = max(1, min(max_step_tokens, self.max_model_len - 8))
        lengths = sorted({n for n in (1, 7, 15, 16, 17, 33, 100, 513, longest) if n <= longest})
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        # Each alone (prefill-only steps of one sequence, then decodes), then all together
        # (mixed steps of many sequences, chunked), with new tokens each round so the
        # prefix cache answers none of them.
        groups = [[i] for i in range(len(lengths))] + [list(range(len(lengths)))]
        for g, group in enumerate(groups):
            for i in group:
                ids = [(1000 * g + 31 * i + 7 * j + 3) % vocab for j in range(lengths[i])]
                self.add_request(f"warmup-{g}-{i}", ids, params)
            while self.has_unfinished_requests():
                self.step()
        # Split counts follow the batch size and context width, which the prompts above
        # cover only in part.
        variants = self.model.attention.compile_variants(
            self.storage.key_caches[0],
            self.storage.value_caches[0],
            self.model_config.num_heads,
            self.dtype,
        )
        self.kv_manager.reset_prefix_cache()
        self.last_step_stats = None
        elapsed = time.perf_counter() - start
        logger.info(
            "warm-up: %d prompts, alone and together, and %d attention variants, in %.1f s",
            len(lengths), variants, elapsed,
        )  # fmt: skip
        return elapsed

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request.

        Raises:
            ValueError: with a message fit for the user, if the request is malformed or can
                never run (too long for the model or for the whole KV pool).
        """
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if request_id in self._awaiting_grammar or self._finished_unread(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        # Bias ids, and stop ids while min_tokens bans them, index the logits on the device
        # (engine/token_bias.py), where an id past the vocabulary is a device-side assert
        # that ends the whole CUDA context. (Other stop ids are only compared on the host.)
        named = [t for t, _ in params.logit_bias]
        if params.min_tokens:
            named += params.stop_token_ids
        bad = [t for t in named if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"logit_bias (and stop_token_ids with min_tokens) must name ids in "
                f"[0, {vocab}); got {bad[:5]}"
            )
        if params.structured is not None:
            params = self._constrain(request_id, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            eos_token_ids=self.eos_token_ids,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if params.prompt_logprobs is not None:
            self.prompt_logprobs.expect(request_id)
        if params.structured is not None:
            # Parked here, not in the scheduler's queue, until the next step finds its grammar
            # compiled: the batch runs on while it compiles, and a grammar that fails always
            # fails the same way (an "error" output), however fast the compiler was.
            self._awaiting_grammar[request_id] = request
        else:
            self.scheduler.add_request(request)

    def _constrain(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """Start a constrained request's grammar; an EOS id ends it once the grammar is
        complete, even under ``ignore_eos`` (the mask then allows nothing else)."""
        if self.structured is None or self.eos_token_id is None:
            raise ValueError("structured output needs the model's tokenizer and EOS token")
        assert params.structured is not None
        self.structured.add(request_id, params.structured)
        ends = [
            t for t in self.eos_token_ids or (self.eos_token_id,) if t not in params.stop_token_ids
        ]
        if params.ignore_eos and ends:
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *ends))
        return params

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand parked requests whose grammar is compiled to the scheduler; fail those whose
        grammar did not compile (the server checks first, so only offline use gets here)."""
        assert self.structured is not None
        outputs = []
        for request_id, request in list(self._awaiting_grammar.items()):
            try:
                if not self.structured.ready(request_id):
                    continue
            except GrammarError as exc:
                outputs.append(_parked_output(request, "error", str(exc)))
                self.prompt_logprobs.forget(request_id)
            else:
                self.scheduler.add_request(request)
            del self._awaiting_grammar[request_id]
        return outputs

    def _finished_unread(self, request_id: str) -> bool:
        """Whether the request finished at the launch of the step in flight: its final
        output comes once that step is read (an abort meanwhile finds nothing to abort)."""
        in_flight = self._in_flight
        return in_flight is not None and any(
            r.request_id == request_id for r in in_flight.update.finished
        )

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        request_ids = list(request_ids)
        parked = [self._awaiting_grammar.pop(r) for r in request_ids if r in self._awaiting_grammar]
        aborted = self.scheduler.abort_requests(request_ids)
        for request in aborted + parked:
            self._forget(request.request_id)
        return [_output(request, [], None) for request in aborted] + [
            _parked_output(request, "abort") for request in parked
        ]

    def shutdown(self) -> None:
        """Close the step trace and stop the tensor-parallel workers, if any (the workers are
        also stopped at interpreter exit)."""
        if self.step_trace is not None:
            self.step_trace.close()
        if self.tp is not None:
            self.tp.shutdown()

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can never step again (its tensor-parallel group failed), or None.
        Set from another thread; the engine loop polls it while idle."""
        return self.tp.failed if self.tp is not None else None

    def has_unfinished_requests(self) -> bool:
        """Whether a request waits or runs, or a launched step's tokens are still unread."""
        return (
            self.scheduler.has_unfinished()
            or bool(self._awaiting_grammar)
            or self._in_flight is not None
        )

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished + len(self._awaiting_grammar)

    @property
    def decode_step_weight_bytes(self) -> int:
        """Weight bytes a one-token decode step reads (GGUF blocks where they serve it)."""
        return self.cost_model.step([(0, 1)], 1).weight_bytes

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's config as built: the device's defaults (the prefill chunk) filled in."""
        return self.scheduler.config

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv_manager.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_manager.num_blocks

    def check_integrity(self) -> None:
        """Raise AssertionError unless the scheduler, the KV pool (every block) and the
        per-request state of sampling, speculation and structured output agree. Tests run
        it after every step; the server under ``--check-integrity``."""
        self.scheduler.check_integrity()
        self._check_request_state()

    def occupancy(self) -> EngineOccupancy:
        """The load gauges now: queues and KV pool (O(requests): the live slots)."""
        kv = self.kv_manager.stats()
        return EngineOccupancy(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks,
            num_kv_blocks_cached=kv.num_cached_blocks,
            num_kv_blocks_evictable=kv.num_evictable_blocks,
            kv_waste_fraction=kv.kv_waste_fraction,
        )

    def check_idle(self) -> None:
        """What must hold once no request is left: nothing queued or tracked, every KV block
        back in the pool, no per-request state left. Constant time in the pool's size, which
        on a GPU holds tens of thousands of blocks: the server runs it each time the engine
        goes idle, when the next request may already be waiting."""
        self.scheduler.check_idle()
        self._check_request_state()

    def _check_request_state(self) -> None:
        live = {r.request_id for r in (*self.scheduler.running, *self.scheduler.waiting)}
        if self._in_flight is not None:  # finished at launch: forgotten once read
            live.update(r.request_id for r, _ in self._in_flight.update.new_tokens)
        self.sampler.penalties.check_integrity(live)
        if self.speculator is not None:
            self.speculator.check_integrity(live)
        if self.structured is not None:
            self.structured.check_integrity(live | set(self._awaiting_grammar))

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output per request that got a token or finished
        (with asynchronous scheduling, in the step launched before: module docstring).

        If the forward pass or the sampler raises, only the requests whose rows raise on
        their own fail (``finish_reason="error"``, blocks freed); the others get their token
        (engine/faults.py). An exception from the scheduler itself propagates.
        """
        if self.async_scheduling and self._overlaps():
            return self._step_async()
        outputs = self._drain() if self._in_flight is not None else []
        return outputs + self._step_sync()

    def _overlaps(self) -> bool:
        """Whether this step may be scheduled before the one in flight is read."""
        # A test's wrapper of the runner may offer ``execute`` only.
        return self.speculator is None and callable(getattr(self.runner, "launch", None))

    def _step_sync(self) -> list[RequestOutput]:
        start = time.perf_counter()
        gap_s = start - self._busy_end if self._busy_end is not None else None
        self._busy_end = None
        parked_outputs = self._admit_compiled() if self._awaiting_grammar else []
        speculator = self.speculator
        drafts = speculator.propose(self.scheduler) if speculator is not None else None
        if drafts and self.structured is not None and self.structured.num_constrained:
            # Constrained requests decode one token a step: a draft would have to be checked
            # against the grammar and the matcher rolled back past rejected tokens.
            drafts = {r: d for r, d in drafts.items() if not self.structured.constrains(r)}
        plan = (
            self.scheduler.schedule(draft_token_ids=drafts) if drafts else self.scheduler.schedule()
        )
        if plan.is_empty:
            if speculator is not None:
                speculator.end_step(plan)
            if self.structured is not None and not parked_outputs:
                self.structured.wait_any(0.05)  # nothing runs: wait for a grammar, not spin
            return parked_outputs
        step = _StepTiming(start, time.perf_counter(), gap_s)
        self._predict(step, plan)
        try:
            result = self.runner.execute(plan)
            failed: dict[str, str] = {}
        except EngineFatalError:
            raise
        except Exception as exc:
            result, failed = self._isolate(plan, exc)
        return parked_outputs + self._complete(plan, result, failed, step)

    def _isolate(
        self, plan: SchedulerOutput, exc: Exception
    ) -> tuple[ModelRunnerOutput, dict[str, str]]:
        logger.error(
            "a step of %d requests failed (%s); re-running it in parts to isolate the "
            "failing requests",
            len(plan.scheduled),
            describe(exc),
            exc_info=True,
        )
        return execute_isolating(self.runner, plan, exc)

    def _predict(self, step: _StepTiming, plan: SchedulerOutput) -> None:
        predictor = self.step_predictor
        if predictor is not None:
            step.features = predictor.plan_features(plan)
            step.predicted_s = predictor.predict_features(step.features)

    def _complete(
        self,
        plan: SchedulerOutput,
        result: ModelRunnerOutput,
        failed: dict[str, str],
        step: _StepTiming,
    ) -> list[RequestOutput]:
        """A synchronous step's end: failures, the update, outputs and the step's figures."""
        # Failed requests leave the scheduler before the update, which then skips them.
        error_outputs = self._fail_requests(failed)
        if self.structured is not None:
            self.structured.accept(result.request_ids, result.token_ids)
        update = self.scheduler.update_from_output(
            plan, dict(zip(result.request_ids, result.token_ids, strict=True))
        )
        outputs = error_outputs + self._make_outputs(update, result)
        speculator = self.speculator
        spec_stats = speculator.end_step(plan) if speculator is not None else None
        self._end_step(plan, step, result)
        if spec_stats is not None and self.last_step_stats is not None:
            stats = self.last_step_stats
            stats.num_draft_tokens = spec_stats.num_draft_tokens
            stats.num_accepted_tokens = spec_stats.num_accepted_tokens
            stats.num_spec_verifications = spec_stats.num_verified_rows
            stats.spec_draft_s = spec_stats.draft_s
            stats.spec_accept_s = spec_stats.accept_s
        return outputs

    def _end_step(
        self,
        plan: SchedulerOutput,
        step: _StepTiming,
        result: ModelRunnerOutput,
        *,
        read: tuple[float, float, float | None] | None = None,
    ) -> None:
        """Record the step's figures (stats, latency targets, trace), timed from its start
        to now; or, for a step read after a later one was launched (asynchronous
        scheduling), ``read``: (from, to, gap) as ``_drain`` measured it."""
        if read is None:
            start, end, gap_s = step.start, time.perf_counter(), step.gap_s
        else:
            start, end, gap_s = read
        phase_s = dict(result.phase_s)
        phase_s["schedule"] = step.scheduled - step.start
        # What the runner did not time (a failed step's re-runs, the update) is "update".
        phase_s["update"] = max(0.0, (end - start) - sum(phase_s.values()))
        self._record_stats(plan, end - start, phase_s, result.experts_touched, result.replay)
        predictor = self.step_predictor
        if predictor is not None and step.features is not None:
            had_decodes = any(s.num_tokens == 1 and not s.padding for s in plan.scheduled)
            predictor.observe(step.features, end - start)
            self.scheduler.observe_step(end - start, gap_s, had_decodes)
            self._record_target(plan, end - start, gap_s, step.predicted_s, had_decodes)
        if self.step_trace is not None:
            self.step_trace.record(
                StepShape.of_plan(plan),
                end - start,
                gap_s,
                step.predicted_s,
                phase_s.get("forward"),
                result.replay,
            )
        if read is None and (self.scheduler.has_unfinished() or self._in_flight is not None):
            self._busy_end = end

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch a step, read the one before it, then sample this one (module
        docstring)."""
        start = time.perf_counter()
        gap_s = start - self._busy_end if self._busy_end is not None else None
        self._busy_end = None
        parked_outputs = self._admit_compiled() if self._awaiting_grammar else []
        plan = self.scheduler.schedule()
        if plan.is_empty:  # nothing to launch: finish the step in flight
            was_idle = self._in_flight is None
            outputs = parked_outputs + self._drain()
            if was_idle and self.structured is not None and not parked_outputs:
                self.structured.wait_any(0.05)  # nothing runs: wait for a grammar, not spin
            if self.scheduler.has_unfinished():
                self._busy_end = time.perf_counter()
            return outputs
        step = _StepTiming(start, time.perf_counter(), gap_s)
        self._predict(step, plan)
        previous = self._in_flight
        try:
            launched = self.runner.launch(plan, previous.launched if previous is not None else None)
        except EngineFatalError:
            raise
        except Exception as exc:
            # Read the step before, then re-run this one as a synchronous step does.
            return self._rerun_isolating(plan, exc, step, parked_outputs + self._drain())
        # The step before is read while this one's forward pass runs; its tokens are then
        # in place for this step's picks (penalties and grammars read them on the host).
        outputs = parked_outputs + self._drain()
        try:
            self.runner.sample(launched, copy_out=True)
        except EngineFatalError:
            raise
        except Exception as exc:
            return self._rerun_isolating(plan, exc, step, outputs)
        self._forget_ended(outputs)
        update = self.scheduler.update_from_output(
            plan, dict.fromkeys(launched.request_ids, PENDING_TOKEN)
        )
        # Its figures are recorded when it is read (``_drain``).
        self._in_flight = _InFlight(launched, update, plan, step)
        self._busy_end = time.perf_counter()
        return outputs

    def _rerun_isolating(
        self,
        plan: SchedulerOutput,
        exc: Exception,
        step: _StepTiming,
        outputs: list[RequestOutput],
    ) -> list[RequestOutput]:
        """A launched step whose launch or sampling raised, the step before it read: give its
        decodes their inputs on the host and isolate the failing requests as a synchronous
        step does. Returns ``outputs`` and this step's."""
        _fill_pending(plan)
        outputs += self._complete(plan, *self._isolate(plan, exc), step)
        self._forget_ended(outputs)
        return outputs

    def _forget_ended(self, outputs: list[RequestOutput]) -> None:
        """Forget again the requests this step's outputs finish: those the read of the step
        before ended (EOS, a stop token) still had a row in this step, and whatever state
        that row's work made for them again must go with them (forgetting is idempotent)."""
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)

    def _drain(self) -> list[RequestOutput]:
        """Wait for the step in flight, put its tokens in place and emit them."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        try:
            result = in_flight.launched.result()
            read_end = time.perf_counter()
        except Exception:
            # Its requests hold pending tokens: they can never finish normally. The
            # caller (the server's engine loop) fails every request in flight; those that
            # finished at launch are out of the scheduler, so no abort reaches them.
            logger.error("reading a launched step's tokens failed", exc_info=True)
            for request, _ in in_flight.update.new_tokens:
                if request.status.finished:
                    self._forget(request.request_id)
            raise
        tokens = dict(zip(result.request_ids, result.token_ids, strict=True))
        logprobs = dict(zip(result.request_ids, result.logprobs, strict=True))
        prompt_logprobs = self._add_prompt_logprobs(result)
        aborted = RequestStatus.FINISHED_ABORTED
        if self.structured is not None and self.structured.num_constrained:
            # Only the tokens kept: not those of rows whose request finished before the
            # step was updated, nor of requests aborted since. Their ids may already name
            # new requests, whose grammars such a token must not advance.
            ids = [r.request_id for r, _ in in_flight.update.new_tokens if r.status is not aborted]
            self.structured.accept(ids, [tokens[r] for r in ids])
        outputs = []
        for request, _ in in_flight.update.new_tokens:
            token = tokens[request.request_id]
            assert isinstance(token, int)  # no speculative rows in an asynchronous step
            self.scheduler.resolve_token(request, token)
            if request.status is aborted:
                continue  # its final output went out with the abort
            lp = logprobs[request.request_id]
            output = _output(request, [token], [lp] if lp is not None else None)
            if prompt_logprobs:
                self._attach_prompt_logprobs(output)
            outputs.append(output)
            if request.status.finished:
                self._forget(request.request_id)
        # The step's time: from the read of the step before it, when the device went on to
        # this one (steps pipelined: the interval between reads, what each token waits), or
        # from its own start after an idle spell. Its shape and this time are what the
        # latency targets learn from, as a synchronous step's.
        timing, last_read = in_flight.timing, self._last_read_end
        self._last_read_end = read_end
        if last_read is not None and last_read > timing.start:  # pipelined
            read: tuple[float, float, float | None] = (last_read, read_end, 0.0)
        else:
            read = (timing.start, read_end, timing.gap_s)
        self._end_step(in_flight.plan, timing, result, read=read)
        return outputs

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Finish requests whose rows raised: abort them (blocks freed) as ``"error"``."""
        if not errors:
            return []
        outputs = []
        for request in self.scheduler.abort_requests(errors):
            self._forget(request.request_id)
            output = _output(request, [], None)
            output.finish_reason = "error"
            output.error = errors[request.request_id]
            outputs.append(output)
        logger.error("failed %d request(s) whose computation raised: %s", len(outputs), errors)
        return outputs

    def _make_outputs(
        self, update: SchedulerUpdate, result: ModelRunnerOutput
    ) -> list[RequestOutput]:
        logprobs = (
            dict(zip(result.request_ids, result.logprobs, strict=False))
            if any(lp is not None for lp in result.logprobs)
            else None
        )
        prompt_logprobs = self._add_prompt_logprobs(result)
        # A speculative row emits several tokens: one output per request, all its tokens.
        # NOTE: a request's tokens are consecutive in ``new_tokens`` (the update appends
        # them row by row, each request in one row), so each run of one request is grouped.
        outputs = []
        tokens = update.new_tokens
        i, n = 0, len(tokens)
        while i < n:
            request, token_id = tokens[i]
            token_ids = [token_id]
            i += 1
            while i < n and tokens[i][0] is request:
                token_ids.append(tokens[i][1])
                i += 1
            lp = logprobs.get(request.request_id) if logprobs is not None else None
            lps = lp[: len(token_ids)] if isinstance(lp, list) else [lp] if lp is not None else None
            output = _output(request, token_ids, lps)
            if prompt_logprobs:
                self._attach_prompt_logprobs(output)
            outputs.append(output)
        for request in update.finished:
            self._forget(request.request_id)
        return outputs

    def _add_prompt_logprobs(self, result: ModelRunnerOutput) -> bool:
        """Gather the step's prompt logprobs; whether any request still awaits its list."""
        if result.prompt_logprobs:
            self.prompt_logprobs.add(result.prompt_logprobs)
        return bool(self.prompt_logprobs)

    def _attach_prompt_logprobs(self, output: RequestOutput) -> None:
        """Hand a request's prompt logprobs out with its first token."""
        if output.new_token_ids and output.request_id in self.prompt_logprobs:
            output.prompt_logprobs = self.prompt_logprobs.take(
                output.request_id, output.num_prompt_tokens
            )

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's penalty counts, speculation, grammar state and prompt
        logprobs (a seeded row's noise keeps none: it is a function of its seed and
        position)."""
        self.prompt_logprobs.forget(request_id)
        self.sampler.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        if self.structured is not None:
            self.structured.remove(request_id)

    def _record_stats(
        self,
        plan: SchedulerOutput,
        step_time: float,
        phase_s: dict[str, float],
        experts_touched: int | None = None,
        replay: str = "",
    ) -> None:
        self.last_step_stats = self._stats.record(
            plan, self.scheduler, self.kv_manager, step_time, phase_s, experts_touched, replay
        )

    def _record_target(
        self,
        plan: SchedulerOutput,
        step_s: float,
        gap_s: float | None,
        predicted_s: float | None,
        had_decodes: bool,
    ) -> None:
        stats = self.last_step_stats
        decision = plan.target
        if stats is None or decision is None:
            return
        stats.predicted_step_s = predicted_s
        stats.target_budget_s = decision.budget_s
        # The cap the targets chose, only where they chose it: a step planned without
        # decodes takes the whole prompt budget, which says nothing about the targets.
        stats.target_prefill_cap = decision.prefill_cap if decision.sized else None
        stats.target_ttft_boost = decision.ttft_boost
        stats.target_conflict = decision.conflict
        if had_decodes and decision.sized:
            stats.target_met = step_s + (gap_s or 0.0) <= decision.budget_s


@dataclasses.dataclass(slots=True)
class _StepTiming:
    """When a step started and was scheduled, and what the latency targets predicted."""

    start: float
    scheduled: float
    gap_s: float | None
    features: Any = None
    predicted_s: float | None = None


@dataclasses.dataclass(slots=True)
class _InFlight:
    """The step launched and not yet read, and its update (applied with pending tokens)."""

    launched: LaunchedStep
    update: SchedulerUpdate
    plan: SchedulerOutput
    timing: _StepTiming


def _fill_pending(plan: SchedulerOutput) -> None:
    """Put the now-known tokens in place of a plan's pending inputs (for a re-run)."""
    for item in plan.scheduled:
        if item.input_pending:
            item.token_ids[0] = item.request.token_id_at(item.start)


_RUNNING = RequestStatus.RUNNING


def _output(request: Request, new_token_ids: list[int], logprobs: Any) -> RequestOutput:
    status = request.status
    finished, finish_reason, stop_token = False, None, None
    if status is not _RUNNING:  # most outputs of a step are running: no finish to describe
        finished, finish_reason = status.finished, request.finish_reason
        if status == RequestStatus.FINISHED_STOPPED and request.output_token_ids:
            stop_token = request.output_token_ids[-1]
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens and request.output_token_ids[-1] == PENDING_TOKEN:
        num_output_tokens -= 1  # aborted with a token on the device: never emitted
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs,
        finished=finished,
        finish_reason=finish_reason,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=num_output_tokens,
        stop_token_id=stop_token,
        first_scheduled_time=request.first_scheduled_time,
    )


def _parked_output(request: Request, reason: str, error: str | None = None) -> RequestOutput:
    """The final output of a request that ended while parked for its grammar."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_logprobs=None,
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=0,
        error=error,
    )
