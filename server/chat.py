"""POST /v1/chat/completions: the tokenizer's chat template and the chat response shapes; the
path every generation request takes is server/generation_endpoint.py.

Streaming follows OpenAI's chunk sequence per choice: a first chunk with
``delta: {"role": "assistant", "content": ""}``, content chunks, then a chunk with an empty
``delta`` and the ``finish_reason``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request, Response
from pydantic import BaseModel

from scheduler.request import SamplingParams
from server.context import ServingContext
from server.generation import ChoiceDelta, GenerationRun, LogprobEntry
from server.generation_endpoint import GenerationEndpoint, serve_generation
from server.prompts import Prompt, chat_prompt
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    finish_reason,
)
from server.streaming import sse_frame, stream_run
from server.validation import (
    chat_logprobs,
    chat_max_tokens,
    check_chat_request,
    choice_params,
    resolve_max_tokens,
)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs_body(entries: list[LogprobEntry]) -> ChatLogprobs:
    """OpenAI's chat format: one object per token with its top-N alternatives."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=_bytes(e.token),
                top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=_bytes(t)) for t, lp in e.top],
            )
            for e in entries
        ]
    )


def _prepare(
    req: ChatCompletionRequest, ctx: ServingContext
) -> tuple[list[Prompt], list[SamplingParams]]:
    prompt = chat_prompt(
        req.messages,
        ctx.client.tokenizer,
        allow_special_tokens_in_content=ctx.config.server.allow_special_tokens_in_content,
    )
    requested, param = chat_max_tokens(req)
    max_tokens = resolve_max_tokens(
        requested, len(prompt.token_ids), ctx.limits, param, prompt_param="messages"
    )
    logprobs = chat_logprobs(req)
    params = [
        choice_params(
            req,
            max_tokens=max_tokens,
            logprobs=logprobs,
            choice=i,
            defaults=ctx.limits.sampling_defaults,
        )
        for i in range(req.n)
    ]
    return [prompt], params


def _response(
    req: ChatCompletionRequest,
    ctx: ServingContext,
    run: GenerationRun,
    request_id: str,
    created: int,
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=chat_logprobs_body(c.logprobs) if req.logprobs else None,
            finish_reason=finish_reason(c.finish_reason),
            token_ids=c.token_ids if req.return_token_ids else None,
            prompt_token_ids=c.prompt.token_ids if req.return_token_ids else None,
        )
        for c in run.choices
    ]
    return ChatCompletionResponse(
        id=request_id, created=created, model=ctx.model_name, choices=choices, usage=run.usage()
    )


def _stream(
    req: ChatCompletionRequest,
    raw_request: Request,
    ctx: ServingContext,
    run: GenerationRun,
    request_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        body = ChatCompletionChunk(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return sse_frame(body, usage_field=include_usage)

    def opening() -> list[bytes]:
        role = ChatDelta(role="assistant", content="")
        return [chunk([ChatChunkChoice(index=c.index, delta=role)]) for c in run.choices]

    def delta_frames(d: ChoiceDelta) -> list[bytes]:
        frames = []
        if d.text or d.logprobs or (req.return_token_ids and d.token_ids):
            content = ChatChunkChoice(
                index=d.index,
                delta=ChatDelta(content=d.text),
                logprobs=chat_logprobs_body(d.logprobs) if req.logprobs else None,
                token_ids=d.token_ids if req.return_token_ids else None,
            )
            frames.append(chunk([content]))
        if d.finish_reason is not None and d.finish_reason != "abort":
            reason = finish_reason(d.finish_reason)
            frames.append(
                chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(), finish_reason=reason)])
            )
        return frames

    usage_frame = (lambda: chunk([], run.usage())) if include_usage else None
    return stream_run(raw_request, run, opening, delta_frames, usage_frame)


CHAT_COMPLETIONS: GenerationEndpoint[ChatCompletionRequest] = GenerationEndpoint(
    id_prefix="chatcmpl",
    check=check_chat_request,
    num_sequences=lambda req: req.n,
    prepare=_prepare,
    response=_response,
    stream=_stream,
)


async def create_chat_completion(
    req: ChatCompletionRequest, raw_request: Request, ctx: ServingContext
) -> Response | BaseModel:
    return await serve_generation(CHAT_COMPLETIONS, req, raw_request, ctx)
