"""Request values -> engine ``SamplingParams``: range checks, unsupported parameters, limits.

Every check raises a 400 ``APIError`` naming the parameter (``param``), so a client learns
exactly what to change; nothing is silently clamped or ignored. Types were already enforced
by the strict pydantic schemas (422).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from pydantic import BaseModel

from scheduler.request import SamplingParams
from server.errors import APIError, invalid, model_not_found, unsupported
from server.protocol import (
    IGNORED_OPENAI_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 64
MAX_SEED = 2**63 - 1  # the sampler seeds torch generators, which take 64-bit seeds


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The server-wide settings the checks need (from ``ServerConfig`` and the engine)."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_logprobs: int = 20
    reject_unknown_fields: bool = True
    max_prompt_tokens: int | None = None  # None: only the context length bounds a prompt
    max_output_tokens: int | None = None  # None: only the context length bounds max_tokens


def check_model(requested: str | None, limits: RequestLimits) -> None:
    if requested is not None and requested != limits.served_model_name:
        raise model_not_found(requested)


def check_unknown_fields(body: BaseModel, limits: RequestLimits) -> list[str]:
    """Reject (or, under ``--unknown-fields ignore``, return) unrecognised top-level fields."""
    extra = sorted(set(body.model_extra or {}) - IGNORED_OPENAI_FIELDS)
    options = getattr(body, "stream_options", None)
    if isinstance(options, BaseModel):  # e.g. vLLM's continuous_usage_stats: not supported
        extra += [f"stream_options.{name}" for name in sorted(options.model_extra or {})]
    if extra and limits.reject_unknown_fields:
        raise APIError(
            400,
            f"Unrecognized request argument supplied: {', '.join(extra)}",
            param=extra[0],
            code="unrecognized_argument",
        )
    if extra:
        logger.warning("ignoring unrecognized request fields: %s", ", ".join(extra))
    return extra


def _finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise invalid(f"'{param}' must be a finite number, got {value}", param)


def _in_range(value: float, low: float, high: float, param: str) -> None:
    _finite(value, param)
    if not low <= value <= high:
        raise invalid(f"'{param}' must be in [{low}, {high}], got {value}", param)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(
            f"'stop' has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    for s in items:
        if not s:
            raise invalid("'stop' strings must be non-empty", "stop")
    return items


def _common_checks(req: CompletionRequest | ChatCompletionRequest, limits: RequestLimits) -> None:
    check_model(req.model, limits)
    check_unknown_fields(req, limits)
    if not 1 <= req.n <= limits.max_n:
        raise invalid(f"'n' must be in [1, {limits.max_n}], got {req.n}", "n")
    if req.temperature is not None:
        _finite(req.temperature, "temperature")
        if req.temperature < 0:
            raise invalid(f"'temperature' must be >= 0, got {req.temperature}", "temperature")
    if req.top_p is not None:
        _finite(req.top_p, "top_p")
        if not 0 < req.top_p <= 1:
            raise invalid(f"'top_p' must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (disabled) or positive, got {req.top_k}", "top_k")
    if req.min_p is not None:
        _in_range(req.min_p, 0.0, 1.0, "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            _in_range(value, -2.0, 2.0, name)
    if req.repetition_penalty is not None:
        _finite(req.repetition_penalty, "repetition_penalty")
        if req.repetition_penalty <= 0:
            raise invalid(
                f"'repetition_penalty' must be > 0, got {req.repetition_penalty}",
                "repetition_penalty",
            )
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED - req.n:
        raise invalid(f"'seed' must be in [0, 2**63 - 1 - n], got {req.seed}", "seed")
    for token_id in req.stop_token_ids or []:
        if not 0 <= token_id < limits.vocab_size:
            raise invalid(
                f"'stop_token_ids' contains {token_id}, outside the vocabulary "
                f"[0, {limits.vocab_size})",
                "stop_token_ids",
            )
    stop_strings(req.stop)
    if req.logit_bias:
        raise unsupported(["logit_bias"])
    if req.stream_options is not None and not req.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")


def check_completion_request(req: CompletionRequest, limits: RequestLimits) -> None:
    """All value checks of a completions request that do not need the prompt's length."""
    _common_checks(req, limits)
    if req.suffix:
        raise unsupported(["suffix"])
    if req.best_of is not None and req.best_of != req.n:
        if req.best_of < req.n:
            raise invalid(f"'best_of' ({req.best_of}) must be >= n ({req.n})", "best_of")
        raise unsupported(
            ["best_of"],
            "> n is not supported by pagedserve (it returns every sampled sequence; use n)",
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= limits.max_logprobs:
        raise invalid(
            f"'logprobs' must be in [0, {limits.max_logprobs}], got {req.logprobs}", "logprobs"
        )
    if req.echo and req.logprobs is not None:
        raise unsupported(
            ["echo", "logprobs"],
            "together are not supported: pagedserve does not compute prompt logprobs",
        )


def check_chat_request(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    """All value checks of a chat request that do not need the prompt's length."""
    _common_checks(req, limits)
    active = []
    if req.tools:
        active.append("tools")
    if req.tool_choice not in (None, "none"):
        active.append("tool_choice")
    if req.functions:
        active.append("functions")
    if req.function_call not in (None, "none"):
        active.append("function_call")
    if req.response_format is not None and req.response_format.get("type") != "text":
        active.append("response_format")
    if req.modalities not in (None, ["text"]):
        active.append("modalities")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if getattr(req, name) is not None:
            active.append(name)
    if active:
        raise unsupported(active)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= limits.max_logprobs:
            raise invalid(
                f"'top_logprobs' must be in [0, {limits.max_logprobs}], got {req.top_logprobs}",
                "top_logprobs",
            )


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    limits: RequestLimits,
    param: str,
    prompt_param: str = "prompt",
) -> int:
    """The output budget of one prompt; ``None`` means "up to the context length", capped
    by ``--max-output-tokens``. A prompt above ``--max-prompt-tokens`` or an explicit
    ``max_tokens`` above ``--max-output-tokens`` is a 400, never silently shortened."""
    if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
        raise invalid(
            f"The prompt has {num_prompt_tokens} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens).",
            prompt_param,
            "prompt_too_long",
        )
    room = limits.max_model_len - num_prompt_tokens
    if requested is not None and requested < 1:
        raise invalid(f"'{param}' must be at least 1, got {requested}", param)
    cap = limits.max_output_tokens
    if requested is not None and cap is not None and requested > cap:
        raise invalid(
            f"'{param}' is {requested}; this server generates at most {cap} tokens per "
            "request (--max-output-tokens).",
            param,
            "max_tokens_exceeded",
        )
    if room < 1 or (requested is not None and requested > room):
        wanted = num_prompt_tokens + (requested if requested is not None else 1)
        raise invalid(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {wanted} tokens ({num_prompt_tokens} in the prompt, "
            f"{requested if requested is not None else 1} for the completion). Please reduce "
            "the length of the prompt or completion.",
            param if requested is not None and room >= 1 else prompt_param,
            "context_length_exceeded",
        )
    if requested is not None:
        return requested
    return room if cap is None else min(room, cap)


def choice_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
) -> SamplingParams:
    """``SamplingParams`` of one choice; a seeded request gives choice i the seed ``seed + i``,
    so the n completions differ from each other and each is reproducible."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=None if req.seed is None else req.seed + choice,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logprobs=logprobs,
        )
    except ValueError as exc:  # SamplingParams' own checks; ours above should catch first
        raise invalid(str(exc)) from None


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"
