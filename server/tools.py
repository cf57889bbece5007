"""Tool calling in chat completions: the ``tools`` / ``tool_choice`` checks, the grammar that
enforces ``required`` and named choices, and the parsers that turn output into ``tool_calls``.

``tools`` reach the model through the chat template's ``tools=`` argument; a template that
never reads ``tools`` (SmolLM2's, the default model's) gets a 400, since the model would never
learn of them. ``tool_choice``:

- ``none``: tools are rendered, the output is plain content;
- ``auto`` (the default with tools): free output, parsed by the server's
  ``--tool-call-parser`` (``hermes``, alias ``qwen``: ``<tool_call>{"name", "arguments"}
  </tool_call>`` blocks, Qwen 2.5/3 and Hermes write them; ``llama3_json``, alias
  ``llama3-json``: a bare ``{"name", "parameters"}`` object, or several joined by ``;``,
  optionally after ``<|python_tag|>``; server/config.py resolves the aliases). Only
  functions in ``tools`` are called: a block or object naming another one leaves the whole
  output as content, and so does a llama3_json object without ``parameters`` or
  ``arguments`` (a JSON answer that merely has a ``"name"``). With
  ``parallel_tool_calls: false`` only the first call is returned;
- ``required``: the output is constrained to a JSON array of one or more
  ``{"name", "arguments"}`` objects, each ``arguments`` following its function's
  ``parameters`` schema (one at most with ``parallel_tool_calls: false``). A ``parameters``
  schema with local refs (``#/$defs/...``, ``#/definitions/...``, ``#/properties/...``)
  is moved under the array schema's ``$defs`` and its refs rewritten to point there
  (``_required_schema``). When ``max_tokens`` cuts the array, the calls completed before
  the cut are still returned (finish reason ``length``);
- a named function: the output is constrained to that function's arguments object.

So ``required`` and named choices always parse and their arguments always validate; they do
not depend on the parser. The finish reason of a choice that made calls is ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.request import StructuredOutputParams
from server.errors import invalid
from server.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from server.structured import Constraint, schema_spec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request does with its tools.

    Args:
        tools: the tools as the chat template reads them (OpenAI's shape), or None.
        choice: ``none``, ``auto``, ``required``, or the forced function's name.
        constraint: the grammar of ``required`` / named choices, else None.
        parallel: False where ``parallel_tool_calls`` is false: at most one call is returned.
    """

    tools: list[dict[str, Any]] | None
    choice: str
    constraint: Constraint | None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.choice != "none"


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """400 naming the first malformed tool; the tools with ``parameters`` filled in."""
    checked = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"'{param}.type' must be 'function'", f"{param}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"'{param}.function' must be an object", f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid(
                f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'; got {name!r}",
                f"{param}.function.name",
            )
        if name in names:
            raise invalid(f"'{param}.function.name' repeats {name!r}", f"{param}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(
                f"'{param}.function.description' must be a string",
                f"{param}.function.description",
            )
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise invalid(
                f"'{param}.function.parameters' must be a JSON schema object",
                f"{param}.function.parameters",
            )
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
    return checked


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` (400s) and decide what the request does."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return ToolPlan(None, "none", None)
    tools = check_tools(req.tools)
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid(
                "'tool_choice' must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in by_name:
            raise invalid(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        spec = schema_spec(by_name[name]["parameters"], "tools")
        constraint = Constraint(StructuredOutputParams("json", spec), _tool_param(tools, name))
        return ToolPlan(tools, name, constraint, parallel)
    if choice in ("none", "auto"):
        return ToolPlan(tools, choice, None, parallel)
    if choice == "required":
        schema = _required_schema(by_name, parallel)
        constraint = Constraint(
            StructuredOutputParams("json", schema_spec(schema, "tools")), "tools"
        )
        return ToolPlan(tools, "required", constraint, parallel)
    raise invalid(
        f"'tool_choice' must be none, auto, required or a named function; got {choice!r}",
        "tool_choice",
    )


def _required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """``required``'s schema: an array of one or more ``{"name", "arguments"}`` objects.

    A function's ``parameters`` that hold local refs (root-relative JSON pointers:
    ``#/$defs/X``, ``#/definitions/X``, ``#/properties/...``, ``#`` itself) would resolve
    against the array schema once embedded in it, where they point at nothing. Such a schema
    goes whole under the array schema's ``$defs``, keyed by its function's name (unique, and
    JSON-pointer safe: letters, digits, ``_`` and ``-``), and each of its refs ``#/...``
    becomes ``#/$defs/<name>/...``: every ref resolves where it did, and two functions may
    define the same name differently. Parameters without refs stay inline.
    """
    defs: dict[str, Any] = {}
    variants = []
    for name, function in functions.items():
        parameters = function["parameters"]
        rebased = _rebase_refs(parameters, f"#/$defs/{name}")
        if rebased != parameters:  # it held local refs
            defs[name] = rebased
            arguments: dict[str, Any] = {"$ref": f"#/$defs/{name}"}
        else:
            arguments = parameters
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        **({} if parallel else {"maxItems": 1}),
        "items": {"anyOf": variants},
    }
    if defs:
        schema["$defs"] = defs
    return schema


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas; every
# other keyword's value (const, enum, default, examples, ...) is data, where a "$ref" key is
# not a reference and is left alone.
_SUBSCHEMA = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "unevaluatedItems",
        "unevaluatedProperties",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
_SUBSCHEMA_LISTS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def _map_schema(schema: Any, ref: Callable[[str], str]) -> Any:
    """``schema`` with each of its ``$ref`` strings replaced by ``ref(value)``."""
    if not isinstance(schema, dict):
        return schema
    mapped: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            mapped[key] = ref(value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            mapped[key] = [_map_schema(v, ref) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            mapped[key] = {k: _map_schema(v, ref) for k, v in value.items()}
        elif key in _SUBSCHEMA:
            mapped[key] = _map_schema(value, ref)
        else:
            mapped[key] = value
    return mapped


def _is_local(ref: str) -> bool:
    return ref == "#" or ref.startswith("#/")


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` moved to JSON pointer ``base``: its refs ``#`` and ``#/...`` made to point
    under ``base`` (other refs, e.g. to a URL or an anchor, are left as they are)."""
    return _map_schema(schema, lambda ref: base + ref[1:] if _is_local(ref) else ref)


def parameter_checks(tools: list[dict[str, Any]] | None) -> list[Constraint]:
    """Each of ``check_tools``' tools' ``parameters`` as a JSON-schema grammar to check before
    the request goes on (server/structured.py ``check_constraints``), whatever
    ``tool_choice`` is: a schema the grammar library rejects is a 400 naming
    ``tools[i].function.parameters``, not a schema the model is shown and may try to follow."""
    checks = []
    for i, tool in enumerate(tools or []):
        param = f"tools[{i}].function.parameters"
        spec = schema_spec(tool["function"]["parameters"], param)
        checks.append(Constraint(StructuredOutputParams("json", spec), param))
    return checks


def _tool_param(tools: list[dict[str, Any]], name: str) -> str:
    index = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
    return f"tools[{index}].function.parameters"


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template reads ``tools`` at all (a template that never mentions them
    would drop them silently)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


# ---------------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def parse_output(text: str, plan: ToolPlan, parser: str) -> ParsedOutput:
    """Split a finished choice's text into content and tool calls, as ``plan`` says; at most
    one call where ``parallel_tool_calls`` is false."""
    parsed = _parse_output(text, plan, parser)
    if not plan.parallel and len(parsed.tool_calls) > 1:
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])
    return parsed


def _parse_output(text: str, plan: ToolPlan, parser: str) -> ParsedOutput:
    if not plan.parses_calls or plan.tools is None:
        return ParsedOutput(text, [])
    if plan.choice == "required":
        items = _complete_items(text)
        if not items:  # cut by max_tokens before the first call was complete
            return ParsedOutput(text, [])
        return ParsedOutput(None, [_call(item["name"], item["arguments"]) for item in items])
    if plan.choice != "auto":  # a named function: the text is its arguments
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        return ParsedOutput(None, [_call(plan.choice, text)])
    names = {t["function"]["name"] for t in plan.tools}
    if parser == "llama3_json":
        return _parse_llama3_json(text, names)
    return _parse_hermes(text, names)


def _complete_items(text: str) -> list[Any]:
    """The complete elements of a JSON array, which may be cut anywhere after them."""
    decoder = json.JSONDecoder()
    position = text.find("[") + 1
    if position == 0:
        return []
    items: list[Any] = []
    while True:
        while position < len(text) and text[position] in " \t\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return items
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items
        items.append(item)


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_START = "<tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"


def _call_from_object(
    obj: Any, names: set[str], *, needs_arguments: bool = False
) -> ToolCall | None:
    """The call ``obj`` makes: None unless it is ``{"name", "arguments" | "parameters"}``
    naming one of ``names``. ``needs_arguments``: an object without ``arguments`` or
    ``parameters`` is no call (llama3_json, whose calls are bare JSON: an answer in JSON
    with a ``"name"`` is not one); else (a hermes ``<tool_call>`` block, a call for sure)
    it calls the function without arguments."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    if "arguments" in obj:
        arguments = obj["arguments"]
    elif "parameters" in obj:
        arguments = obj["parameters"]
    elif needs_arguments:
        return None
    else:
        arguments = {}
    if not isinstance(arguments, dict | str):
        return None
    return _call(obj["name"], arguments)


def _parse_hermes(text: str, names: set[str]) -> ParsedOutput:
    start = text.find(HERMES_START)
    if start < 0:
        return ParsedOutput(text, [])
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            call = _call_from_object(json.loads(match.group(1)), names)
        except json.JSONDecodeError:
            call = None
        if call is None:  # a malformed block, or an unknown function: all stays content
            return ParsedOutput(text, [])
        calls.append(call)
    # Only trailing space goes: a stream has already sent the content up to the call as is.
    content = text[:start].rstrip()
    return ParsedOutput(content if content.strip() else None, calls)


def _parse_llama3_json(text: str, names: set[str]) -> ParsedOutput:
    body = text.strip().removeprefix(LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedOutput(text, [])
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        call = _call_from_object(obj, names, needs_arguments=True)
        if call is None:  # not a call (e.g. a JSON answer): the whole output is content
            return ParsedOutput(text, [])
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\n;":
            position += 1
    return ParsedOutput(None, calls)


def streamable_prefix(text: str, plan: ToolPlan, parser: str) -> int:
    """How many leading characters of a choice's text so far are content for sure, so a
    stream may send them before the choice ends (the rest may be, or start, a tool call)."""
    if not plan.parses_calls:
        return len(text)
    if plan.choice != "auto":
        return 0  # the whole output is the call
    if parser == "llama3_json":
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or LLAMA_PYTHON_TAG.startswith(stripped[:14]):
            return 0
        return len(text)
    start = text.find(HERMES_START)
    if start >= 0:
        return start
    # Hold back a tail that could be the start of "<tool_call>".
    for keep in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


# ------------------------------------------------------------------------- history messages


def history_tool_calls(tool_calls: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: ``arguments`` as
    an object (templates write it with ``tojson``), parsed from OpenAI's JSON text."""
    rendered = []
    for j, call in enumerate(tool_calls):
        where = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"'{where}.function.name' is required", f"{where}.function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise invalid(
                    f"'{where}.function.arguments' is not valid JSON", f"{where}.function.arguments"
                ) from None
        rendered.append(
            {
                "id": call.get("id") or new_call_id(),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return rendered
