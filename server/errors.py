"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Status policy (documented in the README's error table):

=====  ==========================================================================
400    a well-formed request with an invalid value, an unsupported parameter, an
       unrecognised field (``--unknown-fields reject``), prompt + max_tokens
       beyond the context / the whole KV pool, a prompt above ``--max-prompt-tokens``,
       max_tokens above ``--max-output-tokens``, a bad ``X-Request-Timeout``
401    a missing or wrong API key (``--api-key``)
404    unknown model name or unknown route
405    wrong HTTP method on a known route
413    request body above ``--max-body-size``
415    a body sent without ``Content-Type: application/json``
422    malformed JSON, bad UTF-8, or a field of the wrong type / a missing field
500    the engine failed while computing the request, or the server failed while
       turning its tokens into text
503    + ``Retry-After``: the waiting queue is full (``--max-waiting-requests``), the
       server is draining for shutdown, or the engine loop is dead or stalled
504    the request's deadline passed (``--request-timeout`` / ``X-Request-Timeout``)
=====  ==========================================================================

Handlers are installed for ``APIError``, FastAPI's ``RequestValidationError`` and Starlette's
``HTTPException`` (404/405 from routing), and a last-resort handler turns any other exception
into a 500 in the same shape, so no response ever leaves in FastAPI's ``{"detail": ...}`` shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"
AUTHENTICATION = "authentication_error"
TIMEOUT = "timeout_error"
RETRY_AFTER_S = 1  # what 503s advise: a waiting slot frees up within a few steps


class APIError(Exception):
    """An error the API reports to the client; raise it anywhere below a route handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request is well-formed but a value is not acceptable."""
    return APIError(400, message, param=param, code=code)


def unsupported(params: Sequence[str], why: str = "is not supported by pagedserve") -> APIError:
    """A 400 naming the parameters pagedserve will not silently ignore."""
    names = ", ".join(f"'{p}'" for p in params)
    noun = "parameter" if len(params) == 1 else "parameters"
    return APIError(
        400, f"Unsupported {noun}: {names} {why}.", param=params[0], code="unsupported_parameter"
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        type=NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def engine_failed(detail: str) -> APIError:
    return APIError(
        500,
        f"The engine failed while processing the request: {detail}",
        type=SERVER_ERROR,
        code="engine_error",
    )


def engine_unavailable(reason: str) -> APIError:
    return APIError(
        503,
        f"The engine is not available: {reason}",
        type=UNAVAILABLE,
        code="engine_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def server_overloaded(num_in_flight: int, capacity: int) -> APIError:
    return APIError(
        503,
        f"The server is overloaded: {num_in_flight} requests are running or waiting, and it "
        f"holds at most {capacity} (max_num_seqs + --max-waiting-requests). Retry after "
        f"{RETRY_AFTER_S} s.",
        type=UNAVAILABLE,
        code="server_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def queue_too_long(wait_s: float | None, max_queue_time_s: float, *, waited: bool) -> APIError:
    """503 for a request that would wait (or did wait) past ``--max-queue-time``.

    Retry-After is when the queue should be back within the bound: the estimated wait less
    the bound (at least 1 s); the bound itself when no estimate is known.
    """
    if wait_s is None or not math.isfinite(wait_s):
        retry_after = math.ceil(max_queue_time_s)
    else:
        retry_after = max(1, math.ceil(wait_s - max_queue_time_s))
    what = (
        f"waited {max_queue_time_s:g} s for the engine without being served"
        if waited
        else f"would wait about {wait_s:.0f} s for the engine"
    )
    return APIError(
        503,
        f"The server is overloaded: this request {what}, longer than its bound of "
        f"{max_queue_time_s:g} s (--max-queue-time). Retry after {retry_after} s.",
        type=UNAVAILABLE,
        code="queue_timeout" if waited else "queue_too_long",
        headers={"Retry-After": str(retry_after)},
    )


def server_shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests.",
        type=UNAVAILABLE,
        code="server_shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
    )


def request_timed_out(timeout_s: float, num_tokens: int) -> APIError:
    return APIError(
        504,
        f"The request did not finish within its deadline of {timeout_s:g} s "
        f"(--request-timeout / X-Request-Timeout) and was aborted after {num_tokens} "
        "generated tokens.",
        type=TIMEOUT,
        code="request_timeout",
    )


def output_failed(detail: str) -> APIError:
    return APIError(
        500,
        f"The server failed while turning the generated tokens into text: {detail}",
        type=SERVER_ERROR,
        code="output_processing_error",
    )


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    # Pydantic names union branches in the location ("prompt", "list[int]", 1); drop them.
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))]
    param = ""
    for part in parts:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


_UNION_TAGS = {"str", "int", "float", "bool", "none", "function-after", "function-before"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        ctx = detail.get("ctx") or {}
        return (
            f"The request body is not valid JSON: {ctx.get('error', detail['msg'])}",
            None,
            "invalid_json",
        )
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(first.get("loc", ()))
    if first.get("type") == "missing":
        if param is None:  # the body itself: empty
            return "The request body is empty: send a JSON object.", None, "invalid_json"
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    where = f" for '{param}'" if param else ""
    more = f" ({len(errors) - 1} more errors)" if len(errors) > 1 else ""
    # Unions report one error per branch; the first branch's message is the useful one.
    return f"Invalid type{where}: {first.get('msg', 'invalid value')}{more}.", param, "invalid_type"


def _is_json(content_type: str | None) -> bool:
    """``application/json`` or a ``+json`` type, with or without parameters."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _body_not_an_object(exc: RequestValidationError) -> bool:
    """The whole body failed as a value (it was read, but not as JSON); a missing body is
    reported as missing."""
    return any(
        tuple(e.get("loc", ())) == ("body",) and e.get("type") != "missing" for e in exc.errors()
    )


_HTTP_CODES = {404: ("not_found", NOT_FOUND), 405: ("method_not_allowed", INVALID_REQUEST)}


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response of ``app`` OpenAI-shaped."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        if exc.status_code >= 500:
            # A 500 is a failure to look into; 503 (overloaded, draining, engine down) and 504
            # (deadline) are the server working as configured, and come in bursts.
            level = logging.ERROR if exc.status_code == 500 else logging.INFO
            logger.log(
                level,
                "%s %s -> %d: %s",
                request.method,
                request.url.path,
                exc.status_code,
                exc.message,
            )
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        content_type = request.headers.get("content-type")
        if not _is_json(content_type) and _body_not_an_object(exc):
            # FastAPI parses a body as JSON only when the request says it is JSON; anything
            # else arrives as raw bytes and fails as "not an object", which hides the cause.
            message = (
                f"Unsupported Content-Type {content_type or '(none)'!r}: send the body as JSON "
                "with 'Content-Type: application/json'."
            )
            return JSONResponse(
                error_body(message, type=INVALID_REQUEST, code="unsupported_media_type"),
                status_code=415,
            )
        message, param, code = _validation_message(exc)
        return JSONResponse(
            error_body(message, type=INVALID_REQUEST, param=param, code=code), status_code=422
        )

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        # FastAPI reports a body that is not UTF-8, or nested deeper than the JSON parser
        # recurses, as a generic 400 parse error; both are malformed JSON to the client (RFC
        # 8259 requires UTF-8), so they get the same 422 as bad JSON.
        cause = exc.__cause__
        message = None
        if isinstance(cause, UnicodeDecodeError):
            message = (
                f"The request body is not valid UTF-8 JSON: {cause.reason} at byte {cause.start}"
            )
        elif isinstance(cause, RecursionError):
            message = "The request body is not valid JSON: it is nested too deeply to parse"
        if message is not None:
            return JSONResponse(
                error_body(message, type=INVALID_REQUEST, code="invalid_json"), status_code=422
            )
        code, type_ = _HTTP_CODES.get(exc.status_code, (None, INVALID_REQUEST))
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(
            error_body(message, type=type_, code=code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(
                f"Internal server error: {type(exc).__name__}",
                type=SERVER_ERROR,
                code="internal_error",
            ),
            status_code=500,
        )

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
