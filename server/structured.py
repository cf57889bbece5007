"""Structured output at the HTTP edge: which request field asks for a grammar, its checks, and
its compilation before the request is queued.

Accepted, in both /v1/completions and /v1/chat/completions (at most one per request):

=====================================================  =========================================
field                                                  grammar
=====================================================  =========================================
``response_format: {"type": "text"}``                  none
``response_format: {"type": "json_object"}``           any JSON object
``response_format: {"type": "json_schema",             the schema (``strict`` accepted: the
"json_schema": {"name", "schema", "strict"}}``         output always follows the schema)
``guided_json`` (vLLM; a schema object or its text)    the schema
``guided_regex``                                       the regular expression
``guided_choice``                                      exactly one of the strings
``guided_grammar``                                     an EBNF grammar (xgrammar's dialect)
``structured_outputs: {"json" | "regex" | "choice" |   the same, vLLM's newer spelling
"grammar" | "json_object": ...}``
=====================================================  =========================================

Tool calls with ``tool_choice`` ``required`` or a named function become a JSON schema too
(server/tools.py). Shapes are checked here (400 naming the field); the grammar itself is
compiled by the engine's ``GrammarCache`` in its own threads while the handler awaits it, so
an invalid schema, regex or grammar is a 400 with the compiler's reason before anything is
queued, and the engine later finds the grammar compiled. Grammars a request carries but its
output need not follow (each tool's ``parameters`` under ``tool_choice`` ``auto`` or ``none``)
are checked the same way without being compiled (``check_constraints``).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from scheduler.request import StructuredOutputParams
from server.errors import invalid, unsupported
from server.protocol import ChatCompletionRequest, CompletionRequest

# Grammars of a few hundred KB are already far past what a schema needs; the body limit
# bounds them anyway, this keeps one field from being most of it.
MAX_SPEC_CHARS = 256 * 1024
VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
ANY_JSON_OBJECT = '{"type":"object"}'
# Longer than any schema a client means to send takes (tens of milliseconds at most), short
# enough that a pathological one (a maxLength of 10^5 takes seconds) cannot hold a request
# open for long. The compilation itself goes on and is cached when it finishes.
COMPILE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's grammar and the request field it came from (the ``param`` of its 400)."""

    params: StructuredOutputParams
    param: str


def schema_spec(schema: Any, param: str) -> str:
    """A JSON schema as the grammar cache's key: compact text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise invalid(f"'{param}' is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict | bool):
        raise invalid(f"'{param}' must be a JSON schema (an object)", param)
    # Key order kept: the output lists properties in the order the schema gives them.
    return _bounded(json.dumps(schema, separators=(",", ":")), param)


def _bounded(spec: str, param: str) -> str:
    if len(spec) > MAX_SPEC_CHARS:
        raise invalid(f"'{param}' is longer than {MAX_SPEC_CHARS} characters", param)
    return spec


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"'{param}' must be a non-empty string", param)
    return _bounded(value, param)


def _choices(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value:
        raise invalid(f"'{param}' must be a non-empty list of strings", param)
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise invalid(f"'{param}[{i}]' must be a non-empty string", f"{param}[{i}]")
    return _bounded(json.dumps(value, ensure_ascii=False), param)


def response_format_constraint(value: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's ``response_format``."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutputParams("json", ANY_JSON_OBJECT), "response_format")
    if kind == "json_schema":
        inner = value.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(inner, dict):
            raise invalid(f"'{param}' is required for type 'json_schema'", param)
        name = inner.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(f"'{param}.name' must be a string", f"{param}.name")
        strict = inner.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"'{param}.strict' must be a boolean", f"{param}.strict")
        if "schema" not in inner:
            raise invalid(f"'{param}.schema' is required", f"{param}.schema")
        spec = schema_spec(inner["schema"], f"{param}.schema")
        return Constraint(StructuredOutputParams("json", spec), f"{param}.schema")
    raise invalid(
        f"'response_format.type' must be one of text, json_object, json_schema; got {kind!r}",
        "response_format.type",
    )


def _from_field(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        return Constraint(StructuredOutputParams("json", schema_spec(value, param)), param)
    if kind == "json_object":
        if value is not True:
            raise invalid(f"'{param}' must be true when given", param)
        return Constraint(StructuredOutputParams("json", ANY_JSON_OBJECT), param)
    if kind == "choice":
        return Constraint(StructuredOutputParams("choice", _choices(value, param)), param)
    return Constraint(StructuredOutputParams(kind, _text(value, param)), param)


def request_constraint(req: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The grammar a request asks for, or None; 400 when it asks in two ways at once or a
    field has the wrong shape."""
    found: list[Constraint] = []
    fmt = response_format_constraint(req.response_format)
    if fmt is not None:
        found.append(fmt)
    for name in VLLM_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append(_from_field(name.removeprefix("guided_"), value, name))
    if req.structured_outputs is not None:
        extra = sorted(set(req.structured_outputs) - set(STRUCTURED_OUTPUTS_KEYS))
        if extra:
            raise unsupported(
                [f"structured_outputs.{k}" for k in extra],
                f"is not supported (pagedserve accepts {', '.join(STRUCTURED_OUTPUTS_KEYS)})",
            )
        for key, value in req.structured_outputs.items():
            if value is not None:
                found.append(_from_field(key, value, f"structured_outputs.{key}"))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise invalid(f"only one structured output may be requested; got {names}", found[1].param)
    return found[0] if found else None


KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


async def compile_constraint(
    grammars: Any, constraint: Constraint, timeout_s: float = COMPILE_TIMEOUT_S
) -> float | None:
    """Compile ``constraint`` in the grammar cache's threads and wait for it without
    blocking the event loop.

    Returns:
        The compile time in seconds when this request compiled it, None when it was cached
        (or being compiled for another request).

    Raises:
        APIError: 400 naming the field when the compiler rejects it or takes longer than
            ``timeout_s``; 400 when the engine serves no structured output (no tokenizer).
    """
    if grammars is None:
        raise invalid(
            "structured output needs the model's tokenizer; this server has none",
            constraint.param,
        )
    future, started = grammars.compile(constraint.params)
    entry = await _grammar_result(future, constraint, timeout_s, "compile")
    return entry.compile_s if started else None


async def check_constraints(
    grammars: Any, constraints: list[Constraint], timeout_s: float = COMPILE_TIMEOUT_S
) -> None:
    """Check grammars a request carries but its output need not follow (each tool's
    ``parameters``): what compiling them would reject is a 400 naming the first such field,
    in the request's order. Nothing is compiled (``GrammarCache.check``), and a grammar that
    passed once is not checked again.

    An engine without a grammar cache (no tokenizer, so no chat template either) checks
    nothing: it constrains no output, and the grammars only reach a chat template.
    """
    if grammars is None or not constraints:
        return
    results = await asyncio.gather(
        *(_grammar_result(grammars.check(c.params), c, timeout_s, "check") for c in constraints),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _grammar_result(
    future: Future[Any], constraint: Constraint, timeout_s: float, verb: str
) -> Any:
    """``future``'s result, awaited off the event loop; the compiler's errors as 400s."""
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
    except asyncio.TimeoutError:
        raise invalid(
            f"'{constraint.param}' did not {verb} within {timeout_s:g} s; simplify it "
            "(large maxLength, minItems or repetition counts, or deep nesting, are the usual "
            "cause)",
            constraint.param,
            "grammar_too_complex",
        ) from None
    except ValueError as exc:  # GrammarError
        what = KIND_NAMES.get(constraint.params.kind, constraint.params.kind)
        raise invalid(
            f"Invalid {what} in '{constraint.param}': {exc}", constraint.param, "invalid_grammar"
        ) from None
