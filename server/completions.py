"""POST /v1/completions: validate, tokenize, run, and answer as JSON or SSE.

Choices are ordered prompt-major (choice ``p * n + i`` is sample i of prompt p) as OpenAI and
vLLM order them; ``usage.prompt_tokens`` counts each prompt once however large ``n`` is.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request, Response

from server.admission import count_prompts
from server.context import ServingContext, new_request_id
from server.generation import ChoiceDelta, GenerationRun, LogprobEntry
from server.prompts import Prompt, completion_prompts
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    finish_reason,
)
from server.sampling import (
    check_completion_request,
    choice_params,
    resolve_max_tokens,
    stop_strings,
)
from server.streaming import run_to_end, sse_frame, sse_response, stream_run
from server.timeouts import request_deadline

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def completion_logprobs(entries: list[LogprobEntry], base_offset: int) -> CompletionLogprobs:
    """OpenAI's completions format. ``top_logprobs`` holds the top-N plus the sampled token
    ("up to logprobs+1 elements"), keyed by token text."""
    top: list[dict[str, float] | None] = []
    for e in entries:
        alternatives = dict(e.top)
        alternatives.setdefault(e.token, e.logprob)
        top.append(alternatives)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=top,
        text_offset=[base_offset + e.text_offset for e in entries],
    )


def _echo_text(prompt: Prompt, ctx: ServingContext) -> str:
    if prompt.text is not None:
        return prompt.text
    return str(ctx.client.tokenizer.decode(prompt.token_ids, skip_special_tokens=False))


async def create_completion(
    req: CompletionRequest, raw_request: Request, ctx: ServingContext
) -> Response | CompletionResponse:
    arrival_time = time.monotonic()
    limits = ctx.limits
    check_completion_request(req, limits)
    server = ctx.config.server
    deadline = request_deadline(raw_request.headers, server.request_timeout_s, arrival_time)
    # Room is held before the prompts are tokenized: a burst past the queue costs nothing.
    with ctx.admission.admit(count_prompts(req.prompt) * req.n):
        prompts = completion_prompts(req.prompt, ctx.client.tokenizer, limits.vocab_size)
        params = []
        for prompt in prompts:
            max_tokens = resolve_max_tokens(
                req.max_tokens, len(prompt.token_ids), limits, "max_tokens"
            )
            for i in range(req.n):
                params.append(
                    choice_params(req, max_tokens=max_tokens, logprobs=req.logprobs, choice=i)
                )
        request_id = new_request_id("cmpl")
        run = GenerationRun(
            ctx.client,
            ctx.metrics,
            request_id,
            prompts,
            params,
            stop_strings(req.stop),
            req.n,
            arrival_time,
            ctx.token_texts,
            deadline,
        )
        run.submit()  # counted by the engine client from here: the room is no longer held
    await run.start()  # a 400 / 503 / 504 here is still a proper HTTP error
    run.log_accepted(request_id, stream=req.stream, log_prompts=server.log_prompts)
    created = int(time.time())
    if req.stream:
        return sse_response(_stream(req, raw_request, ctx, run, request_id, created))

    if not await run_to_end(raw_request, run):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = []
    for c in run.choices:
        echo = _echo_text(c.prompt, ctx) if req.echo else ""
        choices.append(
            CompletionChoice(
                index=c.index,
                text=echo + c.text,
                logprobs=completion_logprobs(c.logprobs, len(echo))
                if req.logprobs is not None
                else None,
                finish_reason=finish_reason(c.finish_reason),
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=c.prompt.token_ids if req.return_token_ids else None,
            )
        )
    return CompletionResponse(
        id=request_id, created=created, model=ctx.model_name, choices=choices, usage=run.usage()
    )


def _stream(
    req: CompletionRequest,
    raw_request: Request,
    ctx: ServingContext,
    run: GenerationRun,
    request_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo_lens: dict[int, int] = {}  # choice index -> characters of echoed prompt before it

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        body = CompletionChunk(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return sse_frame(body, usage_field=include_usage)

    def opening() -> list[bytes]:
        frames = []
        for c in run.choices:
            echo = _echo_text(c.prompt, ctx) if req.echo else ""
            echo_lens[c.index] = len(echo)
            if echo:
                frames.append(chunk([CompletionChoice(index=c.index, text=echo)]))
        return frames

    def delta_frames(d: ChoiceDelta) -> list[bytes]:
        frames = []
        if d.text or d.logprobs or (req.return_token_ids and d.token_ids):
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(d.logprobs, echo_lens[d.index])
            content = CompletionChoice(
                index=d.index,
                text=d.text,
                logprobs=logprobs,
                token_ids=d.token_ids if req.return_token_ids else None,
            )
            frames.append(chunk([content]))
        # OpenAI sends the finish reason in a chunk of its own; after an abort the client is
        # gone and nobody reads one.
        if d.finish_reason is not None and d.finish_reason != "abort":
            reason = finish_reason(d.finish_reason)
            frames.append(chunk([CompletionChoice(index=d.index, text="", finish_reason=reason)]))
        return frames

    usage_frame = (lambda: chunk([], run.usage())) if include_usage else None
    return stream_run(raw_request, run, opening, delta_frames, usage_frame)
