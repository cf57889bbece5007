"""One HTTP request's generation: its engine requests, their text, stop strings and logprobs.

``GenerationRun`` owns the choices of one completions/chat request (n samples × prompts, each
one engine request ``f"{request_id}-{choice}"``) and turns the engine's ``RequestOutput``s into
``ChoiceDelta``s that ``completions.py`` / ``chat.py`` format as JSON or SSE. It is the only
writer of a choice's text (the server owns streams and detokenizer state).

Stop handling per generated token, in order::

    token ──> (the EOS / stop token that ended the request? it adds no text)
          ──> IncrementalDetokenizer.add ──> StopStringMatcher.feed ──> emitted text
    a stop string found ──> the choice finishes "stop" here; the engine request is aborted
                            and any token the engine produced meanwhile is dropped

so a choice's ``token_ids``, ``logprobs`` and usage end at the token that completed the stop
string, and its text ends right before the stop string.

Failures end only this run, never the server: an engine error output becomes a 500 (or a
503 when the server is shutting down), an exception while turning tokens into text a 500
``output_processing_error``, and a passed deadline (server/validation.py) a 504. Each aborts
whatever of the run is still in the engine, so its blocks come back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput, TokenLogprob
from scheduler.request import SamplingParams
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher, TokenBytes
from server.engine_client import AsyncEngineClient
from server.engine_types import EngineRequest, EngineUnavailableError, Submission
from server.errors import (
    engine_failed,
    engine_unavailable,
    invalid,
    output_failed,
    queue_too_long,
    request_timed_out,
    server_shutting_down,
)
from server.metrics import ServerMetrics
from server.prompts import Prompt
from server.protocol import UsageInfo
from server.timings import RequestTimings
from server.validation import Deadline

logger = logging.getLogger(__name__)


class EngineFailure(Exception):
    """The engine finished a request with ``finish_reason="error"``."""


class TokenTexts:
    """``token id -> text`` of single tokens (for logprobs), and their raw bytes
    (``bytes_of``), cached: a vocabulary is finite."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._token_bytes = TokenBytes(tokenizer)
        self._bytes_cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            self._cache[token_id] = text
        return text

    def bytes_of(self, token_id: int) -> bytes:
        raw = self._bytes_cache.get(token_id)
        if raw is None:
            raw = self._bytes_cache[token_id] = self._token_bytes(token_id, self(token_id))
        return raw


@dataclass(slots=True)
class LogprobEntry:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[str, float]]  # (token text, logprob), best first
    text_offset: int  # where this token's text starts in the choice's generated text
    token_bytes: bytes  # its raw bytes (part of a character where its text is U+FFFD)
    top_bytes: list[bytes]  # the same for each of ``top``


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained from one batch of engine outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" once finished
    stop_reason: str | int | None = None  # with "stop": ChoiceState.stop_reason
    # With the choice's first tokens, where its request asked (SamplingParams.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How a request's tokens become its text (the same for each of its choices)."""

    stop: Sequence[str] = ()  # stop strings: the text ends before the first one found
    stop_token_ids: frozenset[int] = frozenset()  # the request's own (not the model's EOS)
    include_stop_str: bool = False  # vLLM: keep the stop string, or the stop token's text
    skip_special_tokens: bool = True  # drop special tokens' text (EOS, chat markers)
    # Completions' echo with max_tokens 0: the reply is the prompt alone. The engine computes
    # one token (its prefill is what the client wants: the prompt's logprobs) that is
    # dropped, and the choice ends as "length".
    drop_output: bool = False


class ChoiceState:
    """Text, tokens and logprobs of one choice (one engine request)."""

    def __init__(
        self,
        index: int,
        request_id: str,
        prompt: Prompt,
        tokenizer: Any,
        token_texts: TokenTexts,
        text_options: TextOptions,
        arrival_time: float,
        min_tokens: int = 0,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt = prompt
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt.token_ids, text_options.skip_special_tokens
        )
        self._stop = StopStringMatcher(text_options.stop)
        self._include_stop = text_options.include_stop_str
        self._stop_token_ids = text_options.stop_token_ids
        # A stop string ends the choice only in the text of an output token past this many
        # (vLLM's rule; the engine bans stop tokens before it).
        self._min_tokens = min_tokens
        self._token_texts = token_texts
        self._drop_output = text_options.drop_output
        self._decoded_len = 0  # characters the detokenizer produced (emitted + held back)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[LogprobEntry] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None  # stop | length | abort
        # vLLM's stop_reason: what made a "stop" finish, where the request named it: the stop
        # string matched, or the id of its stop_token_ids that ended it; None for the model's
        # EOS (or a complete grammar, which ends on it) and for every other finish.
        self.stop_reason: str | int | None = None
        self.timings = RequestTimings(arrival_time, num_prompt_tokens=len(prompt.token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        return self._stop.stopped

    def on_output(self, output: RequestOutput, now: float) -> ChoiceDelta | None:
        """Apply one engine output; ``None`` if the choice had already finished.

        Raises:
            EngineFailure: the engine failed this request.
        """
        if self.finished:
            return None  # e.g. tokens produced between our stop string and the abort
        if output.finish_reason == "error":
            raise EngineFailure(output.error or "unknown engine error")
        if self.timings.scheduled_time is None:
            self.timings.scheduled_time = output.first_scheduled_time
        delta = ChoiceDelta(self.index)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs = output.prompt_logprobs
        if self._drop_output:
            if output.finished or output.new_token_ids:
                self.finish_reason = "abort" if output.finish_reason == "abort" else "length"
                self.timings.on_finish(self.finish_reason, now)
                delta.finish_reason = self.finish_reason
            return delta
        lps: Sequence[TokenLogprob | None] = output.new_logprobs or [None] * len(
            output.new_token_ids
        )
        ending_token = output.stop_token_id if output.finished else None
        for i, (token_id, lp) in enumerate(zip(output.new_token_ids, lps, strict=True)):
            is_stop_token = i == len(output.new_token_ids) - 1 and token_id == ending_token
            offset = self._decoded_len
            # The EOS / stop token that ended the request adds no text (OpenAI and vLLM
            # leave it out) unless asked for; it still counts as a generated token.
            skip = is_stop_token and not self._include_stop
            piece = "" if skip else self._detokenizer.add([token_id])
            self._decoded_len += len(piece)
            can_stop = len(self.token_ids) + i >= self._min_tokens
            emitted, stopped = self._stop.feed(piece, can_stop)
            delta.text += emitted
            delta.token_ids.append(token_id)
            if lp is not None:
                delta.logprobs.append(self._logprob_entry(lp, offset))
            if stopped:
                if self._include_stop and self._stop.matched is not None:
                    delta.text += self._stop.matched
                self.finish_reason = "stop"
                self.stop_reason = self._stop.matched
                break
        self.timings.on_tokens(len(delta.token_ids), now)
        if not self.finished and output.finished:
            # Text held back for an incomplete character or a possible stop string is final.
            emitted, stopped = self._stop.feed(self._detokenizer.flush())
            delta.text += emitted + self._stop.flush()
            self.finish_reason = "stop" if stopped else output.finish_reason or "stop"
            if stopped:
                self.stop_reason = self._stop.matched
            elif ending_token in self._stop_token_ids:
                self.stop_reason = ending_token
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if self.finished:
            self.timings.on_finish(self.finish_reason or "stop", now)
            delta.finish_reason = self.finish_reason
            delta.stop_reason = self.stop_reason
        return delta

    def _logprob_entry(self, lp: TokenLogprob, offset: int) -> LogprobEntry:
        texts = self._token_texts
        top = [(texts(token_id), value) for token_id, value in lp.top]
        return LogprobEntry(
            lp.token_id,
            texts(lp.token_id),
            lp.logprob,
            top,
            offset,
            texts.bytes_of(lp.token_id),
            [texts.bytes_of(token_id) for token_id, _ in lp.top],
        )


class GenerationRun:
    """The engine requests of one HTTP request, and their choices' state.

    Use: ``await run.start()`` (400/503 before any response is sent), then iterate
    ``run.deltas()``; call ``run.abort()`` when the client goes away and ``run.close()``
    in a ``finally``.
    """

    def __init__(
        self,
        client: AsyncEngineClient,
        metrics: ServerMetrics,
        *,
        request_id: str,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        text_options: TextOptions,
        n: int,
        arrival_time: float,
        token_texts: TokenTexts,
        deadline: Deadline | None = None,
        max_queue_time_s: float | None = None,
    ) -> None:
        """``params[p * n + i]`` are the SamplingParams of choice i of prompt p.

        With ``max_queue_time_s``, ``start`` also waits for the run's first output: a run
        still without one that long after its arrival is aborted with a 503 (the engine
        has not served it; its prefill counts as part of the wait).
        """
        self._client = client
        self._metrics = metrics
        self.prompts = list(prompts)
        self.choices: list[ChoiceState] = []
        self._requests: list[EngineRequest] = []
        for p, prompt in enumerate(self.prompts):
            for i in range(n):
                index = p * n + i
                rid = f"{request_id}-{index}"
                self.choices.append(
                    ChoiceState(
                        index,
                        rid,
                        prompt,
                        client.tokenizer,
                        token_texts,
                        text_options,
                        arrival_time,
                        params[index].min_tokens,
                    )
                )
                self._requests.append(EngineRequest(rid, prompt.token_ids, params[index]))
        self._by_id = {c.request_id: c for c in self.choices}
        self._arrival_time = arrival_time
        self._deadline = deadline
        self._max_queue_time_s = max_queue_time_s
        self._first_outputs: list[RequestOutput] | None = None  # taken by start()
        self._submission: Submission | None = None
        self._stream: Any = None
        self.aborted = False  # the engine aborted a choice we did not finish (client gone)
        self._failed = False  # the engine failed a choice: unfinished ones end as "error"
        self._recorded: set[int] = set()  # choices handed to metrics.record_request

    async def _before_deadline(self, awaitable: Awaitable[Any]) -> Any:
        """Await within the request's deadline; past it, abort the run and raise a 504."""
        if self._deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, self._deadline.at - time.monotonic())
        except asyncio.TimeoutError:
            self.close()
            raise request_timed_out(self._deadline.timeout_s, self.num_completion_tokens) from None

    def submit(self) -> None:
        """Hand the engine requests to the engine client, synchronously: from here on the
        client counts them against the server's capacity (server/backpressure.py)."""
        try:
            self._submission = self._client.submit(self._requests, self._arrival_time)
        except EngineUnavailableError as exc:
            raise engine_unavailable(str(exc)) from None

    async def start(self) -> None:
        """Wait for the engine to take the requests (``submit`` first if not done yet)."""
        if self._submission is None:
            self.submit()
        assert self._submission is not None
        try:
            self._stream = await self._before_deadline(self._client.confirm(self._submission))
        except ValueError as exc:  # the engine says the request can never run
            raise invalid(str(exc), code="request_not_servable") from None
        except EngineUnavailableError as exc:
            raise engine_unavailable(str(exc)) from None
        if self._max_queue_time_s is not None:
            self._first_outputs = await self._until_served(self._max_queue_time_s)

    async def _until_served(self, max_queue_time_s: float) -> list[RequestOutput]:
        """The run's first outputs, awaited until ``max_queue_time_s`` after arrival; past
        that, the run is aborted and a 503 raised (the request deadline still applies)."""
        assert self._stream is not None
        queue_deadline = self._arrival_time + max_queue_time_s
        request_deadline = self._deadline.at if self._deadline is not None else float("inf")
        try:
            timeout = max(0.0, min(queue_deadline, request_deadline) - time.monotonic())
            return list(await asyncio.wait_for(self._stream.get(), timeout))
        except asyncio.TimeoutError:
            self.close()
            if self._deadline is not None and request_deadline <= queue_deadline:
                raise request_timed_out(self._deadline.timeout_s, 0) from None
            waiting = self._client.snapshot.last_step_stats
            wait_s = self._client.estimated_wait_s(waiting.num_waiting if waiting else 0)
            raise queue_too_long(wait_s, max_queue_time_s, waited=True) from None

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Batches of deltas until every choice finished; raises an ``APIError`` 500 on an
        engine failure."""
        assert self._stream is not None, "start() first"
        while not all(c.finished for c in self.choices):
            if self._first_outputs is not None:
                outputs, self._first_outputs = self._first_outputs, None
            else:
                outputs = await self._before_deadline(self._stream.get())
            if not outputs:
                break
            now = time.monotonic()
            batch: list[ChoiceDelta] = []
            for output in outputs:
                choice = self._by_id[output.request_id]
                try:
                    delta = choice.on_output(output, now)
                except EngineFailure as exc:
                    self._failed = True
                    self.close()
                    if self._client.is_stopping:
                        raise server_shutting_down() from None
                    raise engine_failed(str(exc)) from None
                except Exception as exc:
                    # Detokenizing or stop-string handling broke on this run's tokens: this
                    # run fails, the server and every other request go on.
                    logger.exception("output processing failed for %s", choice.request_id)
                    self._failed = True
                    self.close()
                    raise output_failed(type(exc).__name__) from None
                if delta is None:
                    continue
                self._metrics.record_tokens(choice.timings, len(delta.token_ids))
                batch.append(delta)
                if choice.finished:
                    if choice.finish_reason == "abort":
                        self.aborted = True
                    elif choice.stopped_by_string:
                        self._client.abort([choice.request_id])  # the engine would go on
                    self._record(choice)
            if batch:
                yield batch

    def abort(self) -> None:
        """Abort every unfinished choice in the engine (client disconnected)."""
        self.aborted = True
        self.close()

    def close(self) -> None:
        """Abort what is still running; safe to call more than once."""
        if self._stream is not None:
            self._client.abort(self._stream.unfinished_ids)
            # Choices that never finished still end here, for the metrics: as errors after
            # an engine or output-processing failure, else as aborts (the client left, or the
            # deadline passed: the server gave up on them).
            for choice in self.choices:
                if not choice.finished:
                    self._record(choice, "error" if self._failed else "abort")

    def _record(self, choice: ChoiceState, reason: str | None = None) -> None:
        """Hand a choice to the metrics once; ``reason`` ends one the engine did not end."""
        if choice.index in self._recorded:
            return
        self._recorded.add(choice.index)
        if reason is not None:
            choice.timings.on_finish(reason, time.monotonic())
        self._metrics.record_request(choice.timings)

    def log_accepted(self, request_id: str, *, stream: bool, log_prompts: bool) -> None:
        """One line per accepted request: sizes and limits, the prompt only if asked to."""
        if not logger.isEnabledFor(logging.INFO):
            return
        params = self._requests[0].params
        prompts = ""
        if log_prompts:
            texts = [p.text if p.text is not None else p.token_ids for p in self.prompts]
            prompts = f", prompts={texts!r}"
        logger.info(
            "%s: %d prompt(s), %d prompt tokens, %d choice(s), max_tokens=%d, "
            "temperature=%g, stream=%s, timeout=%s%s",
            request_id,
            len(self.prompts),
            self.num_prompt_tokens,
            len(self.choices),
            params.max_tokens,
            params.temperature,
            stream,
            f"{self._deadline.timeout_s:g}s" if self._deadline else "none",
            prompts,
        )

    def usage(self, index: int | None = None) -> UsageInfo:
        """The request's usage so far; with ``index``, that choice's alone (its prompt's
        tokens and its own output: vLLM's per-chunk ``continuous_usage_stats``)."""
        if index is None:
            prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        else:
            choice = self.choices[index]
            prompt, completion = len(choice.prompt.token_ids), len(choice.token_ids)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt, not once per choice (as OpenAI counts)."""
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)
