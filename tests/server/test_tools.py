"""Tool calling and structured-output requests at the HTTP edge, on the fake engine: the 400s,
the tool-call parsers, and tool calls in responses and streams. The real model's constrained
outputs are tests/server/test_structured.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.structured import GrammarCache
from server.protocol import ChatCompletionRequest
from server.structured import Constraint
from server.tools import ToolPlan, parameter_checks, parse_output, streamable_prefix, tool_plan
from tests.server.server_fakes import FakeEngine, tiny_tokenizer
from tests.server.test_errors import assert_openai_error

TOOLS_TEMPLATE = str(Path(__file__).parent / "templates" / "chatml_tools.jinja")
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class GrammarFakeEngine(FakeEngine):
    """The fake engine with a real grammar cache: the server compiles what requests send."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tok = self.tokenizer
        self.grammars = GrammarCache(tok, len(tok), [tok.eos_token_id])


async def _streamed_choices(s: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body`` streamed to the chat route: each data frame's first choice, in order."""
    chunks = []
    async with s.http.stream("POST", CHAT, json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    return chunks


def _plan(**body: Any) -> ToolPlan:
    return tool_plan(ChatCompletionRequest(messages=MSG, **body))


@pytest.fixture(scope="module")
def follows() -> Any:
    """``follows(constraint, text)``: ``text`` is a whole sentence of the constraint's
    grammar, compiled as the server compiles it (the grammar cache, on the tiny tokenizer)."""
    import xgrammar as xgr

    tok = tiny_tokenizer()
    cache = GrammarCache(tok, len(tok), [tok.eos_token_id])

    def check(constraint: Constraint | None, text: str) -> bool:
        assert constraint is not None
        entry = cache.compile(constraint.params)[0].result(timeout=60)
        matcher = xgr.GrammarMatcher(entry.grammar)
        return bool(matcher.accept_string(text) and matcher.accept_token(tok.eos_token_id))

    yield check
    cache.shutdown()


# ------------------------------------------------------------------------------- parsers


def test_hermes_parser_splits_content_and_calls() -> None:
    plan = _plan(tools=[WEATHER])
    parsed = parse_output(f"Let me look.\n{HERMES_CALL}\n{HERMES_CALL}", plan, "hermes")
    assert parsed.content == "Let me look."
    assert [json.loads(c.function.arguments) for c in parsed.tool_calls] == [{"city": "Paris"}] * 2
    assert parse_output("just text", plan, "hermes").tool_calls == []
    broken = parse_output("<tool_call>{not json</tool_call>", plan, "hermes")
    assert broken.tool_calls == [] and broken.content == "<tool_call>{not json</tool_call>"


def test_llama3_json_parser() -> None:
    plan = _plan(tools=[WEATHER])
    call = '{"name": "get_weather", "parameters": {"city": "%s"}}'
    text = "<|python_tag|>" + call % "Oslo" + "; " + call % "Rome"
    parsed = parse_output(text, plan, "llama3_json")
    assert parsed.content is None
    assert [json.loads(c.function.arguments)["city"] for c in parsed.tool_calls] == ["Oslo", "Rome"]
    assert parse_output("The weather is fine.", plan, "llama3_json").tool_calls == []
    spelled = parse_output(
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}', plan, "llama3_json"
    )
    assert json.loads(spelled.tool_calls[0].function.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Bob", "age": 30}',  # a JSON answer with a "name": no parameters
        '{"name": "get_weather"}',  # a tool's name, but no parameters/arguments either
        '{"name": "get_time", "parameters": {}}',  # not among the request's tools
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "Bob", "age": 3}',
    ],
)
def test_llama3_json_keeps_objects_that_are_no_calls_as_content(text: str) -> None:
    parsed = parse_output(text, _plan(tools=[WEATHER]), "llama3_json")
    assert parsed.tool_calls == [] and parsed.content == text


def test_hermes_calls_only_the_requests_tools() -> None:
    now = {"type": "function", "function": {"name": "now"}}
    plan = _plan(tools=[WEATHER, now])
    unknown = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parsed = parse_output(f"Hi. {unknown}", plan, "hermes")
    assert parsed.tool_calls == [] and parsed.content == f"Hi. {unknown}"
    mixed = parse_output(f"{HERMES_CALL}{unknown}", plan, "hermes")
    assert mixed.tool_calls == [] and mixed.content == f"{HERMES_CALL}{unknown}"
    # A block is a call for sure: one without arguments calls the function with none.
    bare = parse_output('<tool_call>{"name": "now"}</tool_call>', plan, "hermes")
    assert [(c.function.name, c.function.arguments) for c in bare.tool_calls] == [("now", "{}")]


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto() -> None:
    plan = _plan(tools=[WEATHER], parallel_tool_calls=False)
    other = HERMES_CALL.replace("Paris", "Rome")
    parsed = parse_output(f"Sure.\n{HERMES_CALL}\n{other}", plan, "hermes")
    assert parsed.content == "Sure."
    assert [json.loads(c.function.arguments) for c in parsed.tool_calls] == [{"city": "Paris"}]
    call = '{"name": "get_weather", "parameters": {"city": "%s"}}'
    llama = parse_output(f"{call % 'Oslo'}; {call % 'Rome'}", plan, "llama3_json")
    assert [json.loads(c.function.arguments) for c in llama.tool_calls] == [{"city": "Oslo"}]
    both = parse_output(f"{HERMES_CALL}{other}", _plan(tools=[WEATHER]), "hermes")
    assert len(both.tool_calls) == 2  # parallel_tool_calls unset (or true): all of them


def test_required_and_named_outputs_parse_without_a_parser() -> None:
    required = parse_output(
        '[{"name": "get_weather", "arguments": {"city": "Lima"}}]',
        _plan(tools=[WEATHER], tool_choice="required"),
        "hermes",
    )
    assert required.tool_calls[0].function.name == "get_weather"
    named_plan = _plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    named = parse_output('{"city": "Lima"}', named_plan, "llama3_json")
    assert named.tool_calls[0].function.arguments == '{"city": "Lima"}'
    cut = parse_output('{"city": "Li', named_plan, "hermes")  # max_tokens mid-structure
    assert cut.tool_calls == [] and cut.content == '{"city": "Li'


def test_required_keeps_the_calls_completed_before_a_cut() -> None:
    plan = _plan(tools=[WEATHER], tool_choice="required")
    one = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    assert len(parse_output(f"[{one}, {one[:20]}", plan, "hermes").tool_calls) == 1
    assert parse_output(f"[{one[:20]}", plan, "hermes").tool_calls == []
    serial = _plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert serial.constraint is not None
    assert json.loads(serial.constraint.params.spec)["maxItems"] == 1


def test_tool_choice_none_and_no_tools_parse_nothing() -> None:
    assert parse_output(HERMES_CALL, _plan(tools=[WEATHER], tool_choice="none"), "hermes").content
    assert not _plan().parses_calls


@pytest.mark.parametrize(
    ("text", "ready"),
    [
        ("Hello there", 11),
        ("Hello <tool", 6),  # the tail may start a call: held back
        ("Hello <tool_call>{", 6),
        ("a < b", 5),
    ],
)
def test_streamable_prefix_holds_back_a_possible_call(text: str, ready: int) -> None:
    assert streamable_prefix(text, _plan(tools=[WEATHER]), "hermes") == ready


def test_required_schema_lists_every_function() -> None:
    other = {"type": "function", "function": {"name": "now"}}
    plan = _plan(tools=[WEATHER, other], tool_choice="required")
    assert plan.constraint is not None
    schema = json.loads(plan.constraint.params.spec)
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "now"] and schema["minItems"] == 1


_LOCATION = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _nested_tool(name: str, defs_key: str = "$defs", **defs: Any) -> dict[str, Any]:
    """A tool whose parameters reach their definitions through root-relative refs, as
    ``openai.pydantic_function_tool`` writes them for nested models."""
    defs = defs or {"Location": _LOCATION}
    first = next(iter(defs))
    parameters = {
        "type": "object",
        "properties": {"loc": {"$ref": f"#/{defs_key}/{first}"}},
        "required": ["loc"],
        defs_key: defs,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("defs_key", ["$defs", "definitions"])
def test_required_resolves_each_tools_definitions(follows, defs_key: str) -> None:
    """D1: ``required`` embeds each ``parameters`` in an array schema, where a ref
    ``#/$defs/X`` would point at the array's (missing) definitions: the grammar compiles and
    the output follows the nested schema; plain tools stay inline."""
    plan = _plan(tools=[_nested_tool("locate", defs_key), WEATHER], tool_choice="required")
    assert plan.constraint is not None and plan.constraint.param == "tools"
    schema = json.loads(plan.constraint.params.spec)
    nested, plain = (item["properties"]["arguments"] for item in schema["items"]["anyOf"])
    assert nested == {"$ref": "#/$defs/locate"}
    assert schema["$defs"]["locate"]["properties"]["loc"]["$ref"] == (
        f"#/$defs/locate/{defs_key}/Location"
    )
    assert plain == WEATHER["function"]["parameters"]
    good = '[{"name": "locate", "arguments": {"loc": {"city": "Paris"}}}]'
    assert follows(plan.constraint, good)
    assert not follows(plan.constraint, '[{"name": "locate", "arguments": {"loc": "Paris"}}]')
    assert not follows(plan.constraint, '[{"name": "locate", "arguments": {"loc": {}}}]')
    calls = parse_output(good, plan, "hermes").tool_calls
    assert json.loads(calls[0].function.arguments) == {"loc": {"city": "Paris"}}
    # The checks of each tool's own schema and the named choice see the schema as sent.
    checks = parameter_checks(plan.tools)
    assert [json.loads(c.params.spec) for c in checks][0] == (
        _nested_tool("locate", defs_key)["function"]["parameters"]
    )
    named = _plan(
        tools=[_nested_tool("locate", defs_key)],
        tool_choice={"type": "function", "function": {"name": "locate"}},
    )
    assert json.loads(named.constraint.params.spec) == json.loads(checks[0].params.spec)
    assert follows(named.constraint, '{"loc": {"city": "Paris"}}')


def test_required_keeps_clashing_definitions_of_two_tools_apart(follows) -> None:
    text = {"type": "string"}
    number = {"type": "integer"}
    tools = [_nested_tool("a", Item=text), _nested_tool("b", Item=number)]
    plan = _plan(tools=tools, tool_choice="required")
    assert follows(plan.constraint, '[{"name": "a", "arguments": {"loc": "x"}}]')
    assert follows(plan.constraint, '[{"name": "b", "arguments": {"loc": 7}}]')
    assert not follows(plan.constraint, '[{"name": "a", "arguments": {"loc": 7}}]')
    assert not follows(plan.constraint, '[{"name": "b", "arguments": {"loc": "x"}}]')
    both = '[{"name": "a", "arguments": {"loc": "x"}}, {"name": "b", "arguments": {"loc": 7}}]'
    assert follows(plan.constraint, both)
    serial = _plan(tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert not follows(serial.constraint, both)


def test_required_rewrites_refs_into_properties_and_the_root_only(follows) -> None:
    """Refs ``#/properties/...`` and ``#`` (recursion) point where they did; refs that are
    not root-relative and ``$ref`` keys inside data (``const``) are left alone."""
    tree = {
        "type": "object",
        "properties": {
            "label": {"type": "string"},
            "alias": {"$ref": "#/properties/label"},
            "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            "kind": {"const": {"$ref": "#/not/a/ref"}},
        },
        "required": ["label", "alias", "child"],
        "additionalProperties": False,
    }
    plan = _plan(
        tools=[{"type": "function", "function": {"name": "tree", "parameters": tree}}],
        tool_choice="required",
    )
    moved = json.loads(plan.constraint.params.spec)["$defs"]["tree"]["properties"]
    assert moved["alias"] == {"$ref": "#/$defs/tree/properties/label"}
    assert moved["child"]["anyOf"][0] == {"$ref": "#/$defs/tree"}
    assert moved["kind"] == {"const": {"$ref": "#/not/a/ref"}}
    leaf = '{"label": "b", "alias": "c", "child": null}'
    assert follows(
        plan.constraint,
        f'[{{"name": "tree", "arguments": {{"label": "a", "alias": "x", "child": {leaf}}}}}]',
    )
    assert not follows(
        plan.constraint,
        '[{"name": "tree", "arguments": {"label": "a", "alias": 1, "child": null}}]',
    )


def test_required_with_a_pydantic_models_schema(follows) -> None:
    """What ``openai.pydantic_function_tool`` sends for a nested model: ``$defs`` refs."""
    from pydantic import BaseModel

    class Location(BaseModel):
        city: str
        country: str

    class Trip(BaseModel):
        start: Location
        stops: list[Location]

    parameters = Trip.model_json_schema()
    assert "$defs" in parameters
    tool = {"type": "function", "function": {"name": "Trip", "parameters": parameters}}
    plan = _plan(tools=[tool], tool_choice="required")
    city = '{"city": "Oslo", "country": "NO"}'
    text = f'[{{"name": "Trip", "arguments": {{"start": {city}, "stops": [{city}]}}}}]'
    assert follows(plan.constraint, text)
    assert not follows(plan.constraint, text.replace(', "country": "NO"', ""))
    call = parse_output(text, plan, "hermes").tool_calls[0]
    Trip.model_validate_json(call.function.arguments)


# ------------------------------------------------------------------------------- the API


_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
_RANGE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 9, "maximum": 1}}}
BAD = [
    (
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        "tools[0].function.name",
    ),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    # A parameters schema the grammar library rejects, whatever tool_choice is: checked
    # without being compiled under auto and none.
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no"}}}]},
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": _REF}}],
            "tool_choice": "none",
        },
        "tools[1].function.parameters",
    ),
    (
        {
            "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": _REF}}],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _RANGE}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        {
            "tools": [WEATHER],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "response_format",
    ),
    ({"guided_regex": "((", "max_tokens": 4}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"structured_outputs": {"lark": "start: x"}}, "structured_outputs.lark"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    (
        {"messages": [{"role": "tool", "content": "sunny"}]},
        "messages[0].tool_call_id",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_structured_and_tool_requests_get_400_and_reach_no_engine(
    serve, extra: dict[str, Any], param: str
) -> None:
    s = await serve(engine=GrammarFakeEngine(), chat_template=TOOLS_TEMPLATE)
    body = {"messages": MSG, "max_tokens": 4, **extra}
    assert_openai_error(await s.http.post(CHAT, json=body), 400, param)
    assert s.engine.added == []
    ok = await s.http.post(CHAT, json={"messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200


async def test_tool_schemas_are_checked_once_and_not_compiled_under_auto(serve) -> None:
    """``tool_choice: auto``: each tool's parameters are checked (cached: a repeat checks
    nothing) but not compiled, and the request's output is not constrained."""
    engine = GrammarFakeEngine(max_model_len=2048, num_blocks=1024)
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE)
    checked: list[str] = []
    check = engine.grammars.check

    def counting_check(params):
        checked.append(params.spec)
        return check(params)

    engine.grammars.check = counting_check
    structured = []
    add_request = engine.add_request

    def recording_add_request(request_id, prompt_token_ids, params, arrival_time=None):
        structured.append(params.structured)
        add_request(request_id, prompt_token_ids, params, arrival_time)

    engine.add_request = recording_add_request
    body = {"messages": MSG, "tools": [WEATHER], "max_tokens": 2}
    for _ in range(2):
        assert (await s.http.post(CHAT, json=body)).status_code == 200
    assert checked == [json.dumps(WEATHER["function"]["parameters"], separators=(",", ":"))] * 2
    assert len(engine.grammars._checks) == 1  # the second request found it checked
    assert structured == [None, None]
    text = (await s.http.get("/metrics")).text
    assert 'pagedserve_grammar_compile_seconds_count{model_name="fake-model"} 0.0' in text


async def test_completions_reject_bad_grammars_too(serve) -> None:
    s = await serve(engine=GrammarFakeEngine())
    body = {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "[a-"}}
    response = await s.http.post("/v1/completions", json=body)
    assert_openai_error(response, 400, "structured_outputs.regex")
    assert "Invalid regex" in response.json()["error"]["message"]


async def test_a_grammar_that_compiles_too_long_is_a_400() -> None:
    from concurrent.futures import Future

    from scheduler.request import StructuredOutputParams
    from server.errors import APIError
    from server.structured import Constraint, compile_constraint

    class NeverDone:
        def compile(self, params: StructuredOutputParams) -> tuple[Future, bool]:
            return Future(), True

    constraint = Constraint(StructuredOutputParams("regex", "a+"), "guided_regex")
    with pytest.raises(APIError) as info:
        await compile_constraint(NeverDone(), constraint, timeout_s=0.05)
    assert info.value.status_code == 400 and info.value.code == "grammar_too_complex"


async def test_a_template_without_tools_is_a_400(serve) -> None:
    s = await serve(engine=GrammarFakeEngine())  # the fake tokenizer's template: no tools
    response = await s.http.post(CHAT, json={"messages": MSG, "tools": [WEATHER]})
    assert_openai_error(response, 400, "tools")
    assert response.json()["error"]["code"] == "tools_not_supported"


async def test_auto_tool_calls_are_parsed_in_json_and_streams(serve) -> None:
    tok = tiny_tokenizer()
    engine = GrammarFakeEngine(
        "Sure. " + HERMES_CALL,
        eos_after=len(tok.encode("Sure. " + HERMES_CALL)) + 1,
        max_model_len=2048,
        num_blocks=1024,
    )
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE)
    body = {"messages": MSG, "tools": [WEATHER], "max_tokens": 400, "temperature": 0}
    response = await s.http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    assert reply["message"]["content"] == "Sure."
    call = reply["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    chunks = await _streamed_choices(s, body)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
    assert "<tool" not in content and content.strip() == "Sure."
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["finish_reason"] == "tool_calls"


async def test_tool_history_is_rendered_with_the_template(serve) -> None:
    engine = GrammarFakeEngine(max_model_len=2048, num_blocks=1024)
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE)
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = await s.http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": True}
    )
    text = tiny_tokenizer().decode(response.json()["tokens"])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    reply = await s.http.post(
        CHAT, json={"messages": messages, "tools": [WEATHER], "max_tokens": 3}
    )
    assert reply.status_code == 200, reply.text


async def test_tokenize_counts_the_tools_as_the_chat_route_renders_them(serve) -> None:
    """``/tokenize`` with ``messages`` and ``tools`` gives the chat route's prompt (what a
    user counting a tool-calling request's tokens needs); a template that never reads
    tools, malformed tools (a parameters schema the grammar library rejects included) and
    tools without messages are the chat route's 400s."""
    engine = GrammarFakeEngine(max_model_len=2048, num_blocks=1024)
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE)
    with_tools = await s.http.post("/tokenize", json={"messages": MSG, "tools": [WEATHER]})
    assert with_tools.status_code == 200, with_tools.text
    tokens = with_tools.json()["tokens"]
    plain = (await s.http.post("/tokenize", json={"messages": MSG})).json()["tokens"]
    assert len(tokens) > len(plain) and "get_weather" in tiny_tokenizer().decode(tokens)
    chat = await s.http.post(
        CHAT, json={"messages": MSG, "tools": [WEATHER], "max_tokens": 1, "return_token_ids": True}
    )
    assert chat.json()["choices"][0]["prompt_token_ids"] == tokens
    bad = await s.http.post("/tokenize", json={"messages": MSG, "tools": [{"type": "function"}]})
    assert_openai_error(bad, 400, "tools[0].function")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": _REF}}
    bad = await s.http.post("/tokenize", json={"messages": MSG, "tools": [WEATHER, bad_schema]})
    assert_openai_error(bad, 400, "tools[1].function.parameters")
    alone = await s.http.post("/tokenize", json={"prompt": "hi", "tools": [WEATHER]})
    assert_openai_error(alone, 400, "tools")
    plain_template = await serve(engine=GrammarFakeEngine())
    refused = await plain_template.http.post(
        "/tokenize", json={"messages": MSG, "tools": [WEATHER]}
    )
    assert_openai_error(refused, 400, "tools")
    assert refused.json()["error"]["code"] == "tools_not_supported"


async def test_structured_requests_are_counted(serve) -> None:
    s = await serve(engine=GrammarFakeEngine())
    body = {"messages": MSG, "max_tokens": 2, "n": 2, "guided_choice": ["a", "b"]}
    assert (await s.http.post(CHAT, json=body)).status_code == 200
    plain = {"prompt": ["hi", "ho"], "max_tokens": 2, "n": 3}
    assert (await s.http.post("/v1/completions", json=plain)).status_code == 200
    bad = {**body, "guided_choice": []}  # a 400: not counted
    assert (await s.http.post(CHAT, json=bad)).status_code == 400
    text = (await s.http.get("/metrics")).text
    assert 'pagedserve_structured_requests_total{kind="choice",model_name="fake-model"} 2.0' in text
    assert 'pagedserve_grammar_compile_seconds_count{model_name="fake-model"} 1.0' in text
    by_constraint = "pagedserve_requests_by_constraint_total"
    assert f'{by_constraint}{{constraint="choice",model_name="fake-model"}} 2.0' in text
    assert f'{by_constraint}{{constraint="none",model_name="fake-model"}} 6.0' in text
    assert f'{by_constraint}{{constraint="json",model_name="fake-model"}} 0.0' in text


NESTED_OUTPUT = '[{"name": "get_weather", "arguments": {"loc": {"city": "Paris"}}}]'


async def test_required_with_defs_is_served_and_parsed(serve) -> None:
    """D1 at the HTTP edge: the request that was a 400 ``Cannot find field '$defs'`` is
    checked, compiled and served; its (scripted) output parses into the nested arguments,
    in a response and a stream. The named choice of the same tool is served as before."""
    tok = tiny_tokenizer()
    engine = GrammarFakeEngine(
        NESTED_OUTPUT,
        eos_after=len(tok.encode(NESTED_OUTPUT)) + 1,
        max_model_len=2048,
        num_blocks=1024,
    )
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE)
    for defs_key in ("$defs", "definitions"):
        tools = [_nested_tool("get_weather", defs_key), WEATHER | {"function": {"name": "now"}}]
        body = {
            "messages": MSG,
            "tools": tools,
            "tool_choice": "required",
            "max_tokens": 400,
            "temperature": 0,
        }
        response = await s.http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        reply = response.json()["choices"][0]
        assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
        function = reply["message"]["tool_calls"][0]["function"]
        assert function["name"] == "get_weather"
        assert json.loads(function["arguments"]) == {"loc": {"city": "Paris"}}
        chunks = await _streamed_choices(s, body)
        calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            {"loc": {"city": "Paris"}}
        ]
        named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        assert (await s.http.post(CHAT, json=named)).status_code == 200


async def test_llama3_json_answer_with_a_name_stays_content(serve) -> None:
    """D4: a JSON answer with a ``"name"`` key is no call to a made-up function, in a
    response and a stream."""
    answer = '{"name": "Bob", "age": 30}'
    tok = tiny_tokenizer()
    engine = GrammarFakeEngine(
        answer, eos_after=len(tok.encode(answer)) + 1, max_model_len=2048, num_blocks=1024
    )
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE, tool_call_parser="llama3_json")
    body = {"messages": MSG, "tools": [WEATHER], "max_tokens": 400, "temperature": 0}
    reply = (await s.http.post(CHAT, json=body)).json()["choices"][0]
    assert reply["finish_reason"] == "stop"
    assert reply["message"]["content"] == answer and reply["message"].get("tool_calls") is None
    chunks = await _streamed_choices(s, body)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == answer
    assert not any(c["delta"].get("tool_calls") for c in chunks)
    assert chunks[-1]["finish_reason"] == "stop"


async def test_parallel_tool_calls_false_returns_one_call_in_json_and_streams(serve) -> None:
    """D5: ``parallel_tool_calls: false`` under ``auto``: the first call only."""
    two = f"{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Rome')}"
    tok = tiny_tokenizer()
    engine = GrammarFakeEngine(
        two, eos_after=len(tok.encode(two)) + 1, max_model_len=2048, num_blocks=1024
    )
    s = await serve(engine=engine, chat_template=TOOLS_TEMPLATE)
    body = {
        "messages": MSG,
        "tools": [WEATHER],
        "max_tokens": 400,
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    reply = (await s.http.post(CHAT, json=body)).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in reply["message"]["tool_calls"]] == [
        {"city": "Paris"}
    ]
    chunks = await _streamed_choices(s, body)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert calls[0]["index"] == 0 and chunks[-1]["finish_reason"] == "tool_calls"
    parallel = {**body, "parallel_tool_calls": True}
    reply = (await s.http.post(CHAT, json=parallel)).json()["choices"][0]
    assert len(reply["message"]["tool_calls"]) == 2
