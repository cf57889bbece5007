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
from server.generation import ChoiceDelta, ChoiceState, GenerationRun, LogprobEntry
from server.generation_endpoint import GenerationEndpoint, serve_generation
from server.prompt_logprobs import echo_logprobs, joined, prompt_logprobs_json
from server.prompts import Prompt, completion_prompts, truncate_prompt
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
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


def _echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the reply is the prompt (and its logprobs) alone."""
    return req.echo and req.max_tokens == 0


def _echoes_logprobs(req: CompletionRequest) -> bool:
    """``echo`` with ``logprobs``: the logprobs cover the prompt's tokens first."""
    return req.echo and req.logprobs is not None


def _prompt_logprobs(req: CompletionRequest, choice: int) -> int | None:
    """What choice ``choice`` of a prompt asks of the engine: the alternatives echoed
    logprobs or ``prompt_logprobs`` want. Every choice of an echo needs its own (a stream
    sends each with the choice's first tokens); ``prompt_logprobs`` alone is computed once a
    prompt, by its first choice, and the others read it from the cache."""
    wanted = [req.prompt_logprobs] if choice == 0 else []
    if req.echo:
        wanted.append(req.logprobs)
    return max((w for w in wanted if w is not None), default=None)


def _prepare(
    req: CompletionRequest, ctx: ServingContext
) -> tuple[list[Prompt], list[SamplingParams]]:
    prompts = [
        truncate_prompt(p, req.truncate_prompt_tokens, ctx.limits.max_model_len)
        for p in completion_prompts(req.prompt, ctx.client.tokenizer, ctx.limits.vocab_size)
    ]
    # Echo alone still computes one token: its prefill is what yields the prompt's logprobs.
    requested = 1 if _echo_only(req) else req.max_tokens
    params = []
    for prompt in prompts:
        max_tokens = resolve_max_tokens(requested, len(prompt.token_ids), ctx.limits, "max_tokens")
        for i in range(req.n):
            params.append(
                choice_params(
                    req,
                    max_tokens=max_tokens,
                    logprobs=req.logprobs,
                    choice=i,
                    defaults=ctx.limits.sampling_defaults,
                    prompt_logprobs=_prompt_logprobs(req, i),
                )
            )
    return prompts, params


def _echoed_prompt_logprobs(
    req: CompletionRequest, ctx: ServingContext, choice: ChoiceState
) -> CompletionLogprobs:
    """The echoed prompt's part of a choice's logprobs."""
    assert req.logprobs is not None
    entries = choice.prompt_logprobs or [None] * len(choice.prompt.token_ids)
    return echo_logprobs(choice.prompt.token_ids, entries, ctx.token_texts, req.logprobs)


def _prompt_logprobs_field(
    req: CompletionRequest, ctx: ServingContext, run: GenerationRun, index: int
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of choice ``index``: its prompt's first choice computed it."""
    if req.prompt_logprobs is None:
        return None
    first = run.choices[index - index % req.n]
    if first.prompt_logprobs is None:
        return None
    return prompt_logprobs_json(first.prompt_logprobs, ctx.token_texts)


def _response(
    req: CompletionRequest, ctx: ServingContext, run: GenerationRun, request_id: str, created: int
) -> CompletionResponse:
    choices = []
    for c in run.choices:
        echo = _echo_text(c.prompt, ctx) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(c.logprobs, len(echo))
            if _echoes_logprobs(req):
                logprobs = joined(_echoed_prompt_logprobs(req, ctx, c), logprobs)
        choices.append(
            CompletionChoice(
                index=c.index,
                text=echo + c.text,
                logprobs=logprobs,
                finish_reason=finish_reason(c.finish_reason),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=c.prompt.token_ids if req.return_token_ids else None,
                prompt_logprobs=_prompt_logprobs_field(req, ctx, run, c.index),
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
    echoes: dict[int, str] = {}  # choice index -> its echoed prompt ("" without echo)
    echoed: set[int] = set()  # choices whose echo (with its logprobs) went out

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
            echo = echoes[c.index] = _echo_text(c.prompt, ctx) if req.echo else ""
            # An echo with logprobs waits for the choice's first tokens, which bring them.
            if echo and not _echoes_logprobs(req):
                frames.append(chunk([CompletionChoice(index=c.index, text=echo)]))
        return frames

    def delta_frames(d: ChoiceDelta) -> list[bytes]:
        frames = []
        if _echoes_logprobs(req) and d.index not in echoed:
            echoed.add(d.index)
            c = run.choices[d.index]
            prompt_part = _echoed_prompt_logprobs(req, ctx, c)
            text = echoes[d.index]
            frames.append(chunk([CompletionChoice(index=d.index, text=text, logprobs=prompt_part)]))
        if d.text or d.logprobs or (req.return_token_ids and d.token_ids):
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(d.logprobs, len(echoes[d.index]))
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
            end = CompletionChoice(
                index=d.index, text="", finish_reason=reason, stop_reason=d.stop_reason
            )
            frames.append(chunk([end]))
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
    drop_output=_echo_only,
)


async def create_completion(
    req: CompletionRequest, raw_request: Request, ctx: ServingContext
) -> Response | BaseModel:
    return await serve_generation(COMPLETIONS, req, raw_request, ctx)
