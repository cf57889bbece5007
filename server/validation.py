"""Request validation: every check an HTTP request passes before (and while) it becomes
engine requests, and the translation of its values into the engine's ``SamplingParams``.

In the order a request meets them. Steps 1 and 2 run before any handler; for a generation
request ``serve_generation`` (server/generation_endpoint.py) is the one entry point that runs
the rest (the renderer, server/router_api.py's ``render``, runs steps 3, 6 and 7 the same way
and generates nothing):

1. **Body size** (``BodySizeLimitMiddleware``, 413): plain ASGI, before anything is parsed.
2. **Types and shapes**: the strict pydantic schemas of server/protocol.py (422).
3. **Values** (``check_completion_request`` / ``check_chat_request``, 400): model name,
   unrecognised fields, ranges, unsupported parameters; nothing that needs the prompt.
4. **Structured output and tools** (400), owned by the modules that turn those fields into
   what the request runs with, and not repeated here: server/structured.py
   (``request_constraint``: ``response_format``, ``guided_*``, ``structured_outputs``) and,
   for chat, server/tools.py (``tool_plan``: ``tools``, ``tool_choice``), which
   server/chat.py's ``chat_constraint`` combines (a tool choice that forces a grammar
   excludes a grammar of the request's own). Then each tool's ``parameters`` schema is
   checked by the grammar library, without compiling (tools.py's ``parameter_checks``,
   structured.py's ``check_constraints``).
5. **Deadline** (``request_deadline``): ``--request-timeout`` and the ``X-Request-Timeout``
   header, 400 when the header is not a positive number.
6. **Prompts** (``check_chat_messages``, ``check_text``, ``check_token_ids``; an assistant
   message's ``tool_calls`` through server/tools.py's ``history_tool_calls``; ``tools`` for
   a chat template that never reads them), as server/prompts.py renders and tokenizes
   them, after backpressure has held room.
7. **Lengths** (``resolve_max_tokens``): the prompt against ``--max-prompt-tokens`` and the
   context, ``max_tokens`` against ``--max-output-tokens``.
8. **The grammar compiles** (server/structured.py's ``compile_constraint``): 400 with the
   compiler's reason when a schema, regex or grammar is invalid, before anything is queued.

Every check raises an OpenAI-shaped ``APIError`` naming the parameter (``param``), so a client
learns exactly what to change; nothing is silently clamped or ignored. How many requests the
server holds (503) is backpressure, not validation: server/backpressure.py.

Deadlines run from the request's arrival (so time spent waiting in the queue counts, as a
client measures it). The effective timeout is the smaller of the server's and the header's:
a client may ask for less time than the server allows, never more. When it passes,
``GenerationRun`` aborts the request's engine requests (their blocks are freed within one
step) and the client gets a 504 ``request_timeout`` error, or, on a stream that already
started, that error as an in-band event followed by ``[DONE]``. Partial output is not
returned as a normal completion: a ``length`` finish would read as "max_tokens reached".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.generation_config import SamplingDefaults
from scheduler.request import SamplingParams
from server.errors import (
    INVALID_REQUEST,
    APIError,
    error_body,
    invalid,
    model_not_found,
    unsupported,
)
from server.protocol import (
    IGNORED_OPENAI_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from server.router_fields import neutral_router_fields
from server.tools import history_tool_calls

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 64
# A seed is an int64 to the sampler's noise and the speculator's generators (OpenAI's range).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
CHAT_ROLES = ("system", "user", "assistant", "tool")
TIMEOUT_HEADER = "X-Request-Timeout"


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
    # The checkpoint's generation_config.json values for fields a request leaves unset
    # (--generation-config auto); empty: pagedserve's own defaults.
    sampling_defaults: SamplingDefaults = SamplingDefaults()


def check_model(requested: str | None, limits: RequestLimits) -> None:
    if requested is not None and requested != limits.served_model_name:
        raise model_not_found(requested)


def check_unknown_fields(body: BaseModel, limits: RequestLimits) -> list[str]:
    """Reject (or, under ``--unknown-fields ignore``, return) unrecognised top-level fields."""
    given = body.model_extra or {}
    extra = sorted(set(given) - IGNORED_OPENAI_FIELDS - neutral_router_fields(given))
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


# OpenAI's bound on ``logit_bias`` entries. The sampler lists every row's pairs on the host
# each step (engine/token_bias.py): unbounded, one request's could slow its whole batch.
MAX_LOGIT_BIAS_ENTRIES = 300


def _check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> None:
    """OpenAI's ``logit_bias``: token ids as JSON keys, biases in [-100, 100]."""
    if bias is not None and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(
            f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
            "logit_bias",
        )
    token_ids = set()
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(
                f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"'logit_bias' names token {token_id}, outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        _finite(value, "logit_bias")
        if not -100 <= value <= 100:
            raise invalid(
                f"'logit_bias' values must be in [-100, 100], got {value} for token {token_id}",
                "logit_bias",
            )
        if token_id in token_ids:  # "7" and "07"
            raise invalid(f"'logit_bias' names token {token_id} twice", "logit_bias")
        token_ids.add(token_id)


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
    if req.seed is not None and not MIN_SEED <= req.seed <= MAX_SEED:
        raise invalid(f"'seed' must be an int64, in [-2**63, 2**63 - 1], got {req.seed}", "seed")
    for token_id in req.stop_token_ids or []:
        if not 0 <= token_id < limits.vocab_size:
            raise invalid(
                f"'stop_token_ids' contains {token_id}, outside the vocabulary "
                f"[0, {limits.vocab_size})",
                "stop_token_ids",
            )
    stop_strings(req.stop)
    _check_logit_bias(req.logit_bias, limits.vocab_size)
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= limits.max_logprobs:
            raise invalid(
                f"'prompt_logprobs' must be in [0, {limits.max_logprobs}], "
                f"got {req.prompt_logprobs}",
                "prompt_logprobs",
            )
        if req.stream:
            raise invalid("'prompt_logprobs' is not available with 'stream'", "prompt_logprobs")
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


def check_chat_request(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    """All value checks of a chat request that do not need the prompt's length."""
    _common_checks(req, limits)
    active = []
    if req.functions:
        active.append("functions")
    if req.function_call not in (None, "none"):
        active.append("function_call")
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


NO_DEFAULTS = SamplingDefaults()  # pagedserve's own defaults for every field


def choice_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    defaults: SamplingDefaults = NO_DEFAULTS,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """``SamplingParams`` of one choice; a seeded request gives choice i the seed ``seed + i``
    (past int64's largest the sampler and the speculator wrap it, as they take any int),
    so the n completions differ from each other and each is reproducible. A field the
    request leaves unset takes ``defaults`` (the checkpoint's), else pagedserve's own."""

    def pick(value: Any, default: Any, own: float) -> Any:
        if value is not None:
            return value
        return own if default is None else default

    min_tokens = req.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise invalid(
            f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {req.min_tokens}",
            "min_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=pick(req.temperature, defaults.temperature, 1.0),
            top_p=pick(req.top_p, defaults.top_p, 1.0),
            top_k=pick(req.top_k, defaults.top_k, 0),
            min_p=pick(req.min_p, defaults.min_p, 0.0),
            seed=None if req.seed is None else req.seed + choice,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=tuple((int(k), v) for k, v in (req.logit_bias or {}).items()),
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


# ------------------------------------------------------------------------------------ chat messages


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as text; only text parts are supported."""
    param = f"messages[{index}].content"
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise invalid(f"'{param}' is required for role '{message.role}'", param)
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise unsupported(
                [f"{param}[{j}].type={kind!r}"],
                "is not supported: pagedserve serves text-only models",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{param}[{j}].text' must be a string", f"{param}[{j}].text")
        texts.append(text)
    return "".join(texts)


def check_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Validate chat messages and turn them into the dicts a chat template reads: ``role``
    and ``content`` strings, plus an assistant's ``tool_calls`` and a tool result's
    ``tool_call_id`` (server/tools.py renders calls as templates expect them)."""
    if not messages:
        raise invalid("'messages' must contain at least one message", "messages")
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role  # OpenAI's new name
        if role not in CHAT_ROLES:
            if role == "function":
                raise unsupported(
                    [f"messages[{i}].role={role!r}"],
                    "is not supported: use role 'tool' (OpenAI's current tool results)",
                )
            raise invalid(
                f"'messages[{i}].role' must be one of system, developer, user, "
                f"assistant, tool; got {message.role!r}",
                f"messages[{i}].role",
            )
        if message.tool_calls and role != "assistant":
            raise invalid(
                f"'messages[{i}].tool_calls' is only allowed on assistant messages",
                f"messages[{i}].tool_calls",
            )
        text = message_text(message, i)
        check_text(text, f"messages[{i}].content")
        item: dict[str, Any] = {"role": role, "content": text}
        if message.tool_calls:
            item["tool_calls"] = history_tool_calls(message.tool_calls, f"messages[{i}].tool_calls")
        if role == "tool":
            if not message.tool_call_id:
                raise invalid(
                    f"'messages[{i}].tool_call_id' is required for role 'tool'",
                    f"messages[{i}].tool_call_id",
                )
            item["tool_call_id"] = message.tool_call_id
            if message.name:
                item["name"] = message.name
        rendered.append(item)
    return rendered


# ------------------------------------------------------------------------------ prompt text and ids


def check_text(text: str, param: str) -> None:
    """400 unless ``text`` can be encoded (tokenizers raise on lone surrogates)."""
    # A JSON "\udc80" escape is valid JSON but not encodable text; tokenizers would raise.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            f"'{param}' is not valid Unicode: {exc.reason} at index {exc.start}", param
        ) from None


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 unless every id is in the vocabulary."""
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"'{param}' contains token id {token_id} at index {i}, outside the "
                f"vocabulary [0, {vocab_size})",
                param,
            )


# ---------------------------------------------------------------------------------------- deadlines


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.monotonic() when the request expires
    timeout_s: float  # the effective timeout, for the error message


def request_deadline(
    headers: Mapping[str, str], server_timeout_s: float | None, arrival_time: float
) -> Deadline | None:
    """The request's deadline, or None when neither the server nor the client sets one.

    Raises:
        APIError: 400 when the header is not a positive number of seconds.
    """
    raw = headers.get(TIMEOUT_HEADER.lower())
    timeout_s = server_timeout_s
    if raw is not None:
        try:
            requested = float(raw)
        except ValueError:
            requested = math.nan
        if not (requested > 0 and math.isfinite(requested)):
            raise invalid(
                f"The {TIMEOUT_HEADER} header must be a positive number of seconds, got {raw!r}.",
                TIMEOUT_HEADER,
                "invalid_timeout",
            )
        timeout_s = requested if timeout_s is None else min(timeout_s, requested)
    if timeout_s is None:
        return None
    return Deadline(arrival_time + timeout_s, timeout_s)


# ---------------------------------------------------------------------------------------- body size


class BodySizeLimitMiddleware:
    """The request-body size limit (``--max-body-size``), enforced before any parsing (413).

    Plain ASGI so it sees the body before FastAPI reads it: a ``Content-Length`` above the
    limit is answered 413 at once, and a chunked body is counted as it arrives and cut off
    with a 413 as soon as it passes the limit. Bodies under the limit are replayed to the app
    unchanged; later ``receive()`` calls (disconnect detection) go straight to the server.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._reject(send, declared)
            return
        # Read the whole body (bounded) before the app runs, then replay it.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: let the app see it
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self._reject(send, size)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replay_receive() -> Message:
            message = next(replay, None)
            return message if message is not None else await receive()

        await self.app(scope, replay_receive, send)

    async def _reject(self, send: Send, size: int) -> None:
        body = error_body(
            f"Request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes "
            "(--max-body-size).",
            type=INVALID_REQUEST,
            code="request_too_large",
        )
        payload = json.dumps(body).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
