"""POST /v1/chat/completions: the tokenizer's chat template and the chat response shapes; the
path every generation request takes is server/generation_endpoint.py.

Streaming follows OpenAI's chunk sequence per choice: a first chunk with
``delta: {"role": "assistant", "content": ""}``, content chunks, then a chunk with an empty
``delta`` and the ``finish_reason``.

Tools (server/tools.py): with ``tools`` and a ``tool_choice`` other than ``none``, a choice's
text is parsed into ``message.tool_calls`` when it ends (finish reason ``tool_calls``). A
stream sends the content that surely is content as it comes, holds back from where a call
may start, and sends each call whole in one ``delta.tool_calls`` chunk at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request, Response
from pydantic import BaseModel

from scheduler.request import SamplingParams
from server.context import ServingContext
from server.errors import invalid
from server.generation import ChoiceDelta, GenerationRun, LogprobEntry
from server.generation_endpoint import GenerationEndpoint, serve_generation
from server.prompt_logprobs import prompt_logprobs_json
from server.prompts import Prompt, chat_prompt, truncate_prompt
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
    DeltaToolCall,
    FinishReason,
    TopLogprob,
    UsageInfo,
    finish_reason,
)
from server.streaming import sse_frame, stream_run, stream_usage
from server.structured import Constraint, request_constraint
from server.tools import ToolPlan, parameter_checks, parse_output, streamable_prefix, tool_plan
from server.validation import (
    chat_logprobs,
    chat_max_tokens,
    check_chat_request,
    choice_params,
    resolve_max_tokens,
)


def chat_logprobs_body(entries: list[LogprobEntry]) -> ChatLogprobs:
    """OpenAI's chat format: one object per token with its top-N alternatives."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token_bytes),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(raw))
                    for (t, lp), raw in zip(e.top, e.top_bytes, strict=True)
                ],
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
        req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
        allow_special_tokens_in_content=ctx.config.server.allow_special_tokens_in_content,
        tools=tool_plan(req).tools,
        chat_template=ctx.chat_template,
    )
    prompt = truncate_prompt(prompt, req.truncate_prompt_tokens, ctx.limits.max_model_len)
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
            # One prompt: the first choice computes its logprobs, the others read the cache.
            prompt_logprobs=req.prompt_logprobs if i == 0 else None,
        )
        for i in range(req.n)
    ]
    return [prompt], params


def chat_constraint(req: ChatCompletionRequest) -> Constraint | None:
    """The grammar of a chat request: its tool choice's, or what it asks for itself."""
    tool_constraint = tool_plan(req).constraint
    own = request_constraint(req)
    if tool_constraint is not None and own is not None:
        raise invalid(
            f"'{own.param}' cannot be combined with tool_choice "
            f"{req.tool_choice if isinstance(req.tool_choice, str) else 'naming a function'}",
            own.param,
        )
    return tool_constraint or own


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text where it is the assistant's, the role
    the reply is written in (an assistant prefill the reply continues)."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):  # text parts (checked: other parts are a 400)
        return "".join(str(part.get("text", "")) for part in content)
    return content or ""


def _finish(reason: str | None, has_calls: bool) -> FinishReason | None:
    if has_calls and reason == "stop":
        return "tool_calls"
    return finish_reason(reason)


def _response(
    req: ChatCompletionRequest,
    ctx: ServingContext,
    run: GenerationRun,
    request_id: str,
    created: int,
) -> ChatCompletionResponse:
    plan = tool_plan(req)
    parser = ctx.config.server.tool_call_parser
    echo = _echo_text(req)
    choices = []
    for c in run.choices:
        parsed = parse_output(c.text, plan, parser)
        content = echo + parsed.content if parsed.content is not None else None
        message = AssistantMessage(content=content, tool_calls=parsed.tool_calls or None)
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs_body(c.logprobs) if req.logprobs else None,
                finish_reason=_finish(c.finish_reason, bool(parsed.tool_calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=c.prompt.token_ids if req.return_token_ids else None,
            )
        )
    first = run.choices[0].prompt_logprobs
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=ctx.model_name,
        choices=choices,
        usage=run.usage(),
        prompt_logprobs=prompt_logprobs_json(first, ctx.token_texts)
        if req.prompt_logprobs is not None and first is not None
        else None,
    )


def _stream(
    req: ChatCompletionRequest,
    raw_request: Request,
    ctx: ServingContext,
    run: GenerationRun,
    request_id: str,
    created: int,
) -> AsyncIterator[bytes]:
    include_usage, continuous_usage = stream_usage(req.stream_options)
    plan = tool_plan(req)
    parser = ctx.config.server.tool_call_parser
    tool_text = ToolStreams(plan, parser)

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        if usage is None and continuous_usage:  # the chunk's choice's own usage so far
            usage = run.usage(choices[0].index) if choices else run.usage()
        body = ChatCompletionChunk(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
        )
        return sse_frame(body, usage_field=include_usage)

    echo = _echo_text(req)

    def opening() -> list[bytes]:
        role = ChatDelta(role="assistant", content="")
        frames = [chunk([ChatChunkChoice(index=c.index, delta=role)]) for c in run.choices]
        if echo:
            frames += [chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(content=echo))])
                       for c in run.choices]  # fmt: skip
        return frames

    def delta_frames(d: ChoiceDelta) -> list[bytes]:
        frames = []
        text, calls = tool_text.feed(d.index, d.text, finished=d.finish_reason is not None)
        if text or d.logprobs or (req.return_token_ids and d.token_ids):
            content = ChatChunkChoice(
                index=d.index,
                delta=ChatDelta(content=text),
                logprobs=chat_logprobs_body(d.logprobs) if req.logprobs else None,
                token_ids=d.token_ids if req.return_token_ids else None,
            )
            frames.append(chunk([content]))
        if calls:
            frames.append(
                chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(tool_calls=calls))])
            )
        if d.finish_reason is not None and d.finish_reason != "abort":
            reason = _finish(d.finish_reason, bool(calls))
            end = ChatChunkChoice(
                index=d.index, delta=ChatDelta(), finish_reason=reason, stop_reason=d.stop_reason
            )
            frames.append(chunk([end]))
        return frames

    usage_frame = (lambda: chunk([], run.usage())) if include_usage else None
    return stream_run(raw_request, run, opening, delta_frames, usage_frame)


class ToolStreams:
    """Per choice of a stream: the text so far, how much of it went out as content, and the
    tool calls parsed from the rest when the choice ends."""

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.parser = parser
        self._text: dict[int, str] = {}
        self._sent: dict[int, int] = {}

    def feed(self, index: int, new_text: str, *, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content to send now, and (once the choice ends) its tool calls."""
        if not self.plan.parses_calls:
            return new_text, []
        text = self._text[index] = self._text.get(index, "") + new_text
        sent = self._sent.get(index, 0)
        if not finished:
            ready = max(sent, streamable_prefix(text, self.plan, self.parser))
            self._sent[index] = ready
            return text[sent:ready], []
        parsed = parse_output(text, self.plan, self.parser)
        if not parsed.tool_calls:
            self._sent[index] = len(text)
            return text[sent:], []
        content = parsed.content or ""
        calls = [
            DeltaToolCall(index=i, id=call.id, function=call.function)
            for i, call in enumerate(parsed.tool_calls)
        ]
        self._sent[index] = len(text)
        return content[sent:] if len(content) > sent else "", calls


CHAT_COMPLETIONS: GenerationEndpoint[ChatCompletionRequest] = GenerationEndpoint(
    id_prefix="chatcmpl",
    check=check_chat_request,
    num_sequences=lambda req: req.n,
    prepare=_prepare,
    response=_response,
    stream=_stream,
    constraint=chat_constraint,
    grammar_checks=lambda req: parameter_checks(tool_plan(req).tools),
)


async def create_chat_completion(
    req: ChatCompletionRequest, raw_request: Request, ctx: ServingContext
) -> Response | BaseModel:
    return await serve_generation(CHAT_COMPLETIONS, req, raw_request, ctx)
