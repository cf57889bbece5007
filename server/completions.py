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
from server.errors import APIError
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
from server.streaming import (
    DONE_FRAME,
    abort_on_disconnect,
    sse_error_frame,
    sse_frame,
    sse_response,
)
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

    async with abort_on_disconnect(raw_request, run.abort, run.close):
        async for _ in run.deltas():
            pass
    if run.aborted:
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
    usage = UsageInfo(
        prompt_tokens=run.num_prompt_tokens,
        completion_tokens=run.num_completion_tokens,
        total_tokens=run.num_prompt_tokens + run.num_completion_tokens,
    )
    return CompletionResponse(
        id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
    )


async def _stream(
    req: CompletionRequest,
    raw_request: Request,
    ctx: ServingContext,
    run: GenerationRun,
    request_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def frame(choice: CompletionChoice) -> bytes:
        chunk = CompletionChunk(
            id=request_id, created=created, model=ctx.model_name, choices=[choice]
        )
        return sse_frame(chunk, usage_field=include_usage)

    def delta_frames(d: ChoiceDelta, echo_len: int) -> list[bytes]:
        frames = []
        if d.text or d.logprobs or (req.return_token_ids and d.token_ids):
            frames.append(
                frame(
                    CompletionChoice(
                        index=d.index,
                        text=d.text,
                        logprobs=completion_logprobs(d.logprobs, echo_len)
                        if req.logprobs is not None
                        else None,
                        token_ids=d.token_ids if req.return_token_ids else None,
                    )
                )
            )
        if d.finish_reason == "abort":
            return frames  # the client is gone; nobody reads a finish chunk
        if d.finish_reason is not None:  # OpenAI sends the finish reason in its own chunk
            frames.append(
                frame(
                    CompletionChoice(
                        index=d.index, text="", finish_reason=finish_reason(d.finish_reason)
                    )
                )
            )
        return frames

    async with abort_on_disconnect(raw_request, run.abort, run.close):
        try:
            echo_lens = {}
            for c in run.choices:
                echo = _echo_text(c.prompt, ctx) if req.echo else ""
                echo_lens[c.index] = len(echo)
                if echo:
                    yield frame(CompletionChoice(index=c.index, text=echo))
            async for batch in run.deltas():
                for d in batch:
                    for f in delta_frames(d, echo_lens[d.index]):
                        yield f
            if include_usage and not run.aborted:
                usage = UsageInfo(
                    prompt_tokens=run.num_prompt_tokens,
                    completion_tokens=run.num_completion_tokens,
                    total_tokens=run.num_prompt_tokens + run.num_completion_tokens,
                )
                yield sse_frame(
                    CompletionChunk(
                        id=request_id,
                        created=created,
                        model=ctx.model_name,
                        choices=[],
                        usage=usage,
                    )
                )
        except APIError as error:  # headers are sent: report in-band, then end the stream
            yield sse_error_frame(error)
    yield DONE_FRAME
