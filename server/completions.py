"""POST /v1/completions: its prompts and response shapes; the path every generation request
takes is server/generation_endpoint.py.

Choices are ordered prompt-major (choice ``p * n + i`` is sample i of prompt p) as OpenAI and
vLLM order them; ``usage.prompt_tokens`` counts each prompt once however large ``n`` is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request, Response
from pydantic import BaseModel

from scheduler.request import SamplingParams
from server.backpressure import count_prompts
from server.context import ServingContext
from server.generation import ChoiceDelta, GenerationRun, LogprobEntry
from server.generation_endpoint import GenerationEndpoint, serve_generation
from server.prompts import Prompt, completion_prompts, truncate_prompt
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    finish_reason,
)
from server.streaming import sse_frame, stream_run, stream_usage
from server.validation import check_completion_request, choice_params, resolve_max_tokens


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


def _prepare(
    req: CompletionRequest, ctx: ServingContext
) -> tuple[list[Prompt], list[SamplingParams]]:
    prompts = [
        truncate_prompt(p, req.truncate_prompt_tokens, ctx.limits.max_model_len)
        for p in completion_prompts(req.prompt, ctx.client.tokenizer, ctx.limits.vocab_size)
    ]
    params = []
    for prompt in prompts:
        max_tokens = resolve_max_tokens(
            req.max_tokens, len(prompt.token_ids), ctx.limits, "max_tokens"
        )
        for i in range(req.n):
            params.append(
                choice_params(
                    req,
                    max_tokens=max_tokens,
                    logprobs=req.logprobs,
                    choice=i,
                    defaults=ctx.limits.sampling_defaults,
                )
            )
    return prompts, params


def _response(
    req: CompletionRequest, ctx: ServingContext, run: GenerationRun, request_id: str, created: int
) -> CompletionResponse:
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
    include_usage, continuous_usage = stream_usage(req.stream_options)
    echo_lens: dict[int, int] = {}  # choice index -> characters of echoed prompt before it

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        if usage is None and continuous_usage:  # the chunk's choice's own usage so far
            usage = run.usage(choices[0].index) if choices else run.usage()
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


COMPLETIONS: GenerationEndpoint[CompletionRequest] = GenerationEndpoint(
    id_prefix="cmpl",
    check=check_completion_request,
    num_sequences=lambda req: count_prompts(req.prompt) * req.n,
    prepare=_prepare,
    response=_response,
    stream=_stream,
)


async def create_completion(
    req: CompletionRequest, raw_request: Request, ctx: ServingContext
) -> Response | BaseModel:
    return await serve_generation(COMPLETIONS, req, raw_request, ctx)
