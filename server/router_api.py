"""The endpoints data-parallel routers call on a worker, beside the OpenAI ones.

``vllm-router`` and ``sglang-router`` (PyPI; both grew from SGLang's Rust router) were run
against a worker that logs every request (deploy/README.md, "Routers"). What they call:

==============================  ==========================  ==================================
route                           who calls it                what it answers here
==============================  ==========================  ==================================
``GET /health``                 both: at start-up until     server/api.py: 200 while the engine
                                healthy, then every         loop iterates, else 503
                                ``--health-check-interval``
``GET /get_server_info``,       sglang-router when a        the serving configuration: model,
``GET /server_info``            worker registers (newer     context length, pool, batching,
                                versions use the short      parallel sizes
                                name); both proxy
                                ``/get_server_info``
``GET /get_model_info``,        the same                    the model: name, path, context
``GET /model_info``                                         length, vocabulary, generative
``GET /get_load``               sglang-router's load        sglang's shape: one entry per
                                monitor (``power_of_two``)  data-parallel rank with running +
                                and ``/get_loads``          waiting requests and KV tokens held
``GET /health_generate``        proxied from the router's   200 once one token was generated
                                ``/health_generate``        through the engine, else 503
``GET /v1/models``              proxied                     server/api.py
``POST /v1/.../render``         vllm-router, before every   the prompt's token ids and
(completions, chat/completions) request, on each worker     sampling parameters (vLLM's shape)
``POST /tokenize``              vllm-router, where render   server/api.py
                                answers 404
==============================  ==========================  ==================================

``vllm-router`` also posts every request to ``/v1/completions/render`` or
``/v1/chat/completions/render`` (vLLM's renderer endpoints) on each worker before routing it,
to route on token ids. Where that answers 404 (vLLM's own default: its renderer routes are
opt-in) it falls back to ``POST /tokenize``; both are served here, the render routes in
vLLM's shape (a list of ``GenerateRequest``: request id, prompt token ids, sampling
parameters, model), so a routed request costs no 404 and no second round trip.
``/flush_cache`` (a router admin call) is not served: the prefix cache here evicts on its own
and has no flush.

Both routers also add their own sampling fields to every body they forward (see
server/router_fields.py); at their neutral values those are accepted, not rejected as
unknown.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, fields
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from scheduler.request import SamplingParams
from server.chat import CHAT_COMPLETIONS
from server.completions import COMPLETIONS
from server.context import ServingContext, new_request_id
from server.engine_types import EngineRequest
from server.generation_endpoint import GenerationEndpoint, Req
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.validation import stop_strings

logger = logging.getLogger(__name__)

HEALTH_GENERATE_PROMPT = "ping"
HEALTH_GENERATE_TIMEOUT_S = 30.0


def add_router_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Serve the worker endpoints of the table above on ``app``."""
    config, client = ctx.config, ctx.client

    def server_info() -> dict[str, Any]:
        scheduler, kvpool = config.scheduler, config.kvpool
        snap = client.snapshot
        return {
            "served_model_name": ctx.model_name,
            "model_path": config.engine.model,
            "max_model_len": ctx.limits.max_model_len,
            "dtype": config.engine.dtype or "auto",
            # One replica is one data-parallel rank; routers spread over replicas.
            "dp_size": 1,
            "tp_size": int(getattr(config.engine, "tensor_parallel_size", 1)),
            "batching": scheduler.batching,
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "block_size": kvpool.block_size,
            "num_kv_blocks": snap.num_total_blocks,
            "enable_prefix_caching": kvpool.enable_prefix_caching,
            "max_waiting_requests": config.server.max_waiting_requests,
        }

    def model_info() -> dict[str, Any]:
        return {
            "served_model_name": ctx.model_name,
            "model_path": config.engine.model,
            "is_generation": True,
            "max_model_len": ctx.limits.max_model_len,
            "vocab_size": ctx.limits.vocab_size,
        }

    @app.get("/get_server_info", include_in_schema=False)
    @app.get("/server_info", include_in_schema=False)
    async def get_server_info() -> dict[str, Any]:
        return server_info()

    @app.get("/get_model_info", include_in_schema=False)
    @app.get("/model_info", include_in_schema=False)
    async def get_model_info() -> dict[str, Any]:
        return model_info()

    @app.get("/get_load", include_in_schema=False)
    async def get_load() -> list[dict[str, int]]:
        return [load(ctx)]

    @app.post("/v1/completions/render", include_in_schema=False)
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        return render(COMPLETIONS, body, ctx)

    @app.post("/v1/chat/completions/render", include_in_schema=False)
    async def render_chat(body: ChatCompletionRequest) -> list[dict[str, Any]]:
        return render(CHAT_COMPLETIONS, body, ctx)

    @app.get("/health_generate", include_in_schema=False)
    async def health_generate() -> JSONResponse:
        reason = await generate_one_token(ctx)
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


def render(
    endpoint: GenerationEndpoint[Req], req: Req, ctx: ServingContext
) -> list[dict[str, Any]]:
    """What the endpoint would submit, without submitting it: vLLM's renderer response.

    The same checks (400s) and the same prompt building (chat template, tokenizer) as the
    endpoint itself, so the token ids are exactly those the request will be prefilled with;
    one entry per prompt, with the sampling parameters of its first choice.
    """
    endpoint.check(req, ctx.limits)
    prompts, params = endpoint.prepare(req, ctx)
    stop = stop_strings(req.stop)
    return [
        {
            "request_id": new_request_id(endpoint.id_prefix),
            "token_ids": prompt.token_ids,
            "sampling_params": {**_given(params[index * req.n]), "stop": stop},
            "model": ctx.model_name,
            "stream": bool(req.stream),
        }
        for index, prompt in enumerate(prompts)
    ]


def _given(params: SamplingParams) -> dict[str, Any]:
    """The parameters a ``SamplingParams`` is made from (not those it derives)."""
    given = {f.name for f in fields(params) if f.init}
    return {name: value for name, value in asdict(params).items() if name in given}


def load(ctx: ServingContext) -> dict[str, int]:
    """sglang's per-rank load entry.

    ``num_reqs`` counts the engine requests the event loop has handed over and not yet seen
    finish (exact at this instant); ``num_waiting_reqs`` is the waiting queue of the last
    step, capped by it; ``num_tokens`` is the KV slots held (used blocks x block size).
    """
    client = ctx.client
    snap = client.snapshot
    stats = snap.last_step_stats
    num_reqs = client.num_unfinished
    waiting = min(stats.num_waiting, num_reqs) if stats is not None else 0
    return {
        "dp_rank": 0,
        "num_reqs": num_reqs,
        "num_waiting_reqs": waiting,
        "num_tokens": snap.num_used_blocks * ctx.config.kvpool.block_size,
    }


async def generate_one_token(ctx: ServingContext) -> str | None:
    """Run one greedy one-token request through the engine; None if a token came back,
    else why not.

    Unlike ``/health`` (the engine loop iterates), this proves a forward pass completes. It
    bypasses the request queue's admission limit, as a probe must, and records no request
    metrics; the engine counts its step like any other.
    """
    client = ctx.client
    health = client.health()
    if not health.healthy:
        return health.reason or "engine unhealthy"
    prompt = client.tokenizer.encode(HEALTH_GENERATE_PROMPT, add_special_tokens=True)
    request_id = new_request_id("health")
    request = EngineRequest(request_id, list(prompt), SamplingParams(max_tokens=1, temperature=0))

    async def run() -> str | None:
        stream = await client.add([request])
        while True:
            for output in await stream.get():
                if output.finished:
                    if output.finish_reason == "error":
                        return output.error or "the engine failed the request"
                    if output.num_output_tokens < 1:
                        return f"no token generated (finish reason {output.finish_reason})"
                    return None

    try:
        return await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        client.abort([request_id])
        return f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s"
    except Exception as exc:  # EngineUnavailableError, a refused request: report, not raise
        client.abort([request_id])
        logger.warning("health_generate failed: %s", exc)
        return str(exc) or type(exc).__name__
