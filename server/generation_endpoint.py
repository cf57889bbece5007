"""The request path shared by POST /v1/completions and POST /v1/chat/completions.

Every generation request goes through ``serve_generation``, in this order::

    check values (400) ──> grammar fields (400; tools' schemas checked off the event loop) ──>
    deadline ──> hold room (503, before any tokenizing) ──> prompts (tokenize / chat
    template) ──> SamplingParams per choice ──> compile the grammar, if any, off the event
    loop (400 if the compiler rejects it) ──>
    submit ──>
    start (400/503/504 while the status line can still say so; with --max-queue-time, until
    the first token) ──> SSE stream or JSON

An endpoint supplies only what differs (``GenerationEndpoint``): its value checks, how its
prompts and per-choice parameters are built, and its response shapes, JSON and SSE
(server/completions.py, server/chat.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request, Response
from pydantic import BaseModel

from scheduler.request import SamplingParams
from server.context import ServingContext, new_request_id
from server.generation import GenerationRun, TextOptions
from server.prompts import Prompt
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.streaming import run_to_end, sse_response
from server.structured import (
    Constraint,
    check_constraints,
    compile_constraint,
    request_constraint,
)
from server.validation import RequestLimits, request_deadline, stop_strings

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it

Req = TypeVar("Req", CompletionRequest, ChatCompletionRequest)


@dataclass(frozen=True, slots=True)
class GenerationEndpoint(Generic[Req]):
    """What one generation endpoint does differently from the others.

    Args:
        id_prefix: the response id's prefix (``cmpl``, ``chatcmpl``).
        check: the value checks that need no prompt (server/validation.py).
        num_sequences: the engine requests the request needs (prompts x ``n``), counted
            before anything is tokenized.
        prepare: its prompts, tokenized, and ``params[p * n + i]``, the SamplingParams of
            choice i of prompt p.
        response: the JSON body of a finished run: ``(req, ctx, run, request_id, created)``.
        stream: the SSE frames of a run: ``(req, raw_request, ctx, run, request_id, created)``.
        constraint: the grammar the request's output must follow, or None (server/structured.py;
            chat adds tool calls, server/tools.py).
        grammar_checks: grammars the request carries but its output need not follow (chat:
            each tool's ``parameters``), checked like ``constraint`` but not compiled.
        drop_output: whether the reply leaves out what is generated (completions' echo with
            ``max_tokens`` 0: ``TextOptions.drop_output``).
    """

    id_prefix: str
    check: Callable[[Req, RequestLimits], None]
    num_sequences: Callable[[Req], int]
    prepare: Callable[[Req, ServingContext], tuple[list[Prompt], list[SamplingParams]]]
    response: Callable[[Req, ServingContext, GenerationRun, str, int], BaseModel]
    stream: Callable[[Req, Request, ServingContext, GenerationRun, str, int], AsyncIterator[bytes]]
    constraint: Callable[[Req], Constraint | None] = request_constraint
    grammar_checks: Callable[[Req], list[Constraint]] = lambda _: []
    drop_output: Callable[[Req], bool] = lambda _: False


async def serve_generation(
    endpoint: GenerationEndpoint[Req], req: Req, raw_request: Request, ctx: ServingContext
) -> Response | BaseModel:
    """Run one generation request to its response: JSON, SSE, or a 499 when the client of a
    JSON request went away. Errors before the response starts are ``APIError``s (the app's
    handlers answer them); after an SSE stream starts they go in-band."""
    arrival_time = time.monotonic()
    endpoint.check(req, ctx.limits)
    constraint = endpoint.constraint(req)
    # Fields first: a schema the grammar library rejects is a 400 before the room, prompt
    # length or deadline are looked at. A check compiles nothing, and a passed one is cached.
    await check_constraints(ctx.client.grammars, endpoint.grammar_checks(req))
    server = ctx.config.server
    deadline = request_deadline(raw_request.headers, server.request_timeout_s, arrival_time)
    # Room is held before the prompts are tokenized or templated: a burst past the queue
    # costs the server almost nothing.
    with ctx.backpressure.hold(endpoint.num_sequences(req)):
        prompts, params = endpoint.prepare(req, ctx)
        if constraint is not None:
            compile_s = await compile_constraint(ctx.client.grammars, constraint)
            ctx.metrics.record_structured(constraint.params.kind, len(params), compile_s)
            params = [dataclasses.replace(p, structured=constraint.params) for p in params]
        ctx.metrics.record_accepted(constraint.params.kind if constraint else None, len(params))
        request_id = new_request_id(endpoint.id_prefix)
        run = GenerationRun(
            ctx.client,
            ctx.metrics,
            request_id=request_id,
            prompts=prompts,
            params=params,
            text_options=TextOptions(
                stop_strings(req.stop),
                stop_token_ids=frozenset(req.stop_token_ids or ()),
                include_stop_str=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                drop_output=endpoint.drop_output(req),
            ),
            n=req.n,
            arrival_time=arrival_time,
            token_texts=ctx.token_texts,
            deadline=deadline,
            max_queue_time_s=server.max_queue_time_s,
        )
        run.submit()  # counted by the engine client from here: the room is no longer held
    await run.start()  # a 400 / 503 / 504 here is still a proper HTTP error
    run.log_accepted(request_id, stream=req.stream, log_prompts=server.log_prompts)
    created = int(time.time())
    if req.stream:
        return sse_response(endpoint.stream(req, raw_request, ctx, run, request_id, created))
    if not await run_to_end(raw_request, run):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return endpoint.response(req, ctx, run, request_id, created)
