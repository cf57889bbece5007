"""The FastAPI app: routes only. Handlers live in completions.py, chat.py and below.

Routes::

    POST /v1/completions        completions.create_completion
    POST /v1/chat/completions   chat.create_chat_completion
    GET  /v1/models             the one served model
    GET  /v1/models/{id}        that model's card; 404 model_not_found for any other id
    GET  /health                200 while the engine loop is alive and iterating and the
                                server is not draining, else 503; the body carries the KV
                                pool figures (blocks used/free/total), the step of the last
                                idle integrity check, and requests in flight vs capacity
    GET  /metrics               Prometheus exposition (server/metrics.py; deploy/README.md)
    GET  /version
    GET  /get_server_info, /get_model_info, /get_load, /health_generate (and the short
         names /server_info, /model_info): what data-parallel routers poll on a worker
         (server/router_api.py)
    POST /tokenize, /detokenize

Middleware, outermost first: CORS (only with --cors-origins), drain (SIGTERM: 503 for new
requests; server/shutdown.py), API keys (only with --api-key; server/auth.py), body size
(413; server/validation.py). Each answers before the body is parsed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvpool.storage import KVCapacity
from server.auth import APIKeyMiddleware, add_cors
from server.chat import create_chat_completion
from server.completions import create_completion
from server.config import ServingConfig
from server.context import ServingContext
from server.engine_client import AsyncEngineClient
from server.errors import install_error_handlers, invalid
from server.metrics import HTTPMetricsMiddleware, ServerMetrics, config_info
from server.prompts import chat_prompt, encode
from server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from server.router_api import add_router_routes
from server.shutdown import DrainMiddleware, DrainState
from server.structured import check_constraints
from server.tools import check_tools, parameter_checks
from server.validation import (
    BodySizeLimitMiddleware,
    check_model,
    check_token_ids,
    check_unknown_fields,
)


def _version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 422, 500, 503, 504)
}
# With "stream": true the 200 is an SSE stream of chunks (server/streaming.py), not JSON:
# the schema is one event's (OpenAPI 3.2's reading of text/event-stream), each `data` a
# chunk's JSON or `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_GENERATION: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}},
}


def create_app(
    config: ServingConfig, client: AsyncEngineClient, metrics: ServerMetrics | None = None
) -> FastAPI:
    """Build the app around a (not yet started) engine client.

    The app's lifespan starts the client's engine thread and stops it on shutdown; tests
    that drive the app without a lifespan call ``client.start()`` themselves.
    """
    if metrics is None:  # no engine facts here (tests, fakes): no peaks, no MBU
        metrics = ServerMetrics(
            config.server.served_model_name or client.model_id,
            info=config_info(config),
            max_model_len=client.max_model_len,
            num_kv_blocks=client.snapshot.num_total_blocks,
            log_interval_s=config.server.stats_log_interval_s,
            vllm_names=config.server.vllm_metric_names,
        )
    ctx = ServingContext.build(config, client, metrics)
    client.on_step = metrics.record_step
    client.on_idle = metrics.record_occupancy

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # anyio imports its asyncio backend on first use, which is a streamed response's
        # task group: without this, the first request after /health turns 200 pays the
        # import (milliseconds) inside its time to first token.
        await anyio.sleep(0)
        client.start()
        yield
        await client.shutdown()

    app = FastAPI(title="pagedserve", version=_version(), lifespan=lifespan)
    app.state.ctx = ctx
    drain = DrainState()
    app.state.drain = drain  # the SIGTERM handler of server/shutdown.py sets it
    install_error_handlers(app)
    # add_middleware wraps what was added before: the last one added runs first.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.server.max_body_bytes)
    if config.server.api_keys:
        app.add_middleware(
            APIKeyMiddleware,
            api_keys=config.server.api_keys,
            public_paths=config.server.public_paths,
        )
    app.add_middleware(DrainMiddleware, state=drain)
    add_cors(app, config.server.cors_origins)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_GENERATION)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_GENERATION)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(body, request, ctx)

    def model_card() -> ModelCard:
        return ModelCard(
            id=ctx.model_name,
            created=ctx.started_at,
            root=config.engine.model,
            max_model_len=ctx.limits.max_model_len,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    # ``:path``: a served name may hold slashes (``org/model``), as hub-style names do.
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model_id: str) -> ModelCard:
        check_model(model_id, ctx.limits)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        state = client.health()
        snap = state.snapshot
        status = "ok" if state.healthy else "unhealthy"
        reason = state.reason
        if state.healthy and drain.draining:
            status, reason = "draining", "the server is shutting down"
        body = {
            "status": status,
            "reason": reason,
            "engine": {
                "heartbeat_age_s": round(state.heartbeat_age_s, 3),
                "num_steps": snap.num_steps,
                "num_requests": snap.num_requests,
                "kv_blocks_total": snap.num_total_blocks,
                "kv_blocks_free": snap.num_free_blocks,
                "kv_blocks_used": snap.num_used_blocks,
                # check_idle() passed when the engine was last idle, after this step.
                "integrity_checked_at_step": snap.integrity_checked_at_step,
            },
            "kv_cache": _kv_cache_body(snap.kv_capacity),
            "requests": {
                "in_flight": ctx.backpressure.num_in_flight,
                "capacity": ctx.backpressure.capacity,
            },
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        body, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    add_router_routes(app, ctx)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model, ctx.limits)
        check_unknown_fields(body, ctx.limits)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is None:
            for name in ("tools", "continue_final_message", "chat_template_kwargs"):
                if getattr(body, name):
                    raise invalid(f"'{name}' goes with 'messages'", name)
        if body.messages is not None:
            tools = check_tools(body.tools) if body.tools else None
            await check_constraints(client.grammars, parameter_checks(tools))
            ids = chat_prompt(
                body.messages,
                client.tokenizer,
                body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                allow_special_tokens_in_content=config.server.allow_special_tokens_in_content,
                tools=tools,
                chat_template=ctx.chat_template,
            )
            tokens = ids.token_ids
        else:
            assert body.prompt is not None
            tokens = encode(
                client.tokenizer,
                body.prompt,
                add_special_tokens=body.add_special_tokens,
                param="prompt",
            )
        return TokenizeResponse(
            tokens=tokens,
            count=len(tokens),
            max_model_len=ctx.limits.max_model_len,
            token_strs=client.tokenizer.convert_ids_to_tokens(tokens)
            if body.return_token_strs
            else None,
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model, ctx.limits)
        check_unknown_fields(body, ctx.limits)
        check_token_ids(body.tokens, ctx.limits.vocab_size, "tokens")
        text = client.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)

    # Outermost (added last): counts the other middleware's answers (413, 401, 503) too.
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app


def _kv_cache_body(capacity: KVCapacity | None) -> dict[str, object] | None:
    """The pool's size for /health: its dtype ("auto" = the model's), tokens and bytes."""
    if capacity is None:
        return None
    return {
        "dtype": capacity.cache_dtype,
        "num_tokens": capacity.num_tokens,
        "bytes_per_token": capacity.bytes_per_token,
        "total_bytes": capacity.total_bytes,
    }
