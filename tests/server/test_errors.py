"""The table of bad requests: each gets its documented status and an OpenAI-shaped body, and
the server keeps serving (the same table runs against the real server in test_integration)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.errors import APIError, _loc_to_param

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
MAX_BODY = 64 * 1024


def case(
    name: str, path: str, body: Any, status: int, param: str | None = None, method: str = "POST"
) -> Any:
    return pytest.param(method, path, body, status, param, id=name)


# (method, path, body, status, param). `body` is a dict (sent as JSON) or raw bytes.
BAD_REQUESTS = [
    case("missing-prompt", C, {"max_tokens": 4}, 422, "prompt"),
    case("prompt-wrong-type", C, {"prompt": 42}, 422, "prompt"),
    case("prompt-mixed-list", C, {"prompt": [1, "a"]}, 422, "prompt"),
    case("prompt-empty-list", C, {"prompt": []}, 400, "prompt"),
    case("prompt-empty-string", C, {"prompt": ""}, 400, "prompt"),
    case("prompt-too-long", C, {"prompt": "hello " * 400}, 400, "prompt"),
    case("prompt-token-out-of-vocab", C, {"prompt": [1, 999999]}, 400, "prompt"),
    case("prompt-negative-token", C, {"prompt": [[1], [-3]]}, 400, "prompt[1]"),
    case("prompt-lone-surrogate", C, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    case("max-tokens-string", C, {"prompt": "hi", "max_tokens": "16"}, 422, "max_tokens"),
    case("max-tokens-zero", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    case("max-tokens-negative", C, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    case("max-tokens-huge", C, {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    case("max-tokens-float", C, {"prompt": "hi", "max_tokens": 3.5}, 422, "max_tokens"),
    case("n-zero", C, {"prompt": "hi", "n": 0}, 400, "n"),
    case("n-too-large", C, {"prompt": "hi", "n": 1000}, 400, "n"),
    case("temperature-negative", C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    case("temperature-string", C, {"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
    case("temperature-nan", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    case("top-p-above-one", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    case("top-p-zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    case("top-k-negative", C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    case("min-p-above-one", C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    case(
        "presence-penalty-range",
        C,
        {"prompt": "hi", "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    case(
        "repetition-penalty-zero",
        C,
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    case("logprobs-too-many", C, {"prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    case("logprobs-bool", C, {"prompt": "hi", "logprobs": True}, 422, "logprobs"),
    case("stop-empty-string", C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    case("stop-wrong-type", C, {"prompt": "hi", "stop": 5}, 422, "stop"),
    case(
        "stop-token-out-of-vocab",
        C,
        {"prompt": "hi", "stop_token_ids": [-1]},
        400,
        "stop_token_ids",
    ),
    case("seed-below-int64", C, {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    case("seed-above-int64", C, {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    case("seed-string", C, {"prompt": "hi", "seed": "abc"}, 422, "seed"),
    case("suffix-unsupported", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    case("best-of-above-n", C, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    case("logit-bias-not-a-token", C, {"prompt": "hi", "logit_bias": {"x": 5}}, 400, "logit_bias"),
    case(
        "logit-bias-out-of-vocab",
        C,
        {"prompt": "hi", "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
    case("logit-bias-too-large", C, {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    case("logit-bias-too-many", C, {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(301)}},
         400, "logit_bias"),
    case(
        "logit-bias-twice", C, {"prompt": "hi", "logit_bias": {"1": 1, "01": 2}}, 400, "logit_bias"
    ),
    case("logit-bias-string", C, {"prompt": "hi", "logit_bias": {"1": "5"}}, 422, "logit_bias.1"),
    case("prompt-logprobs-negative", C, {"prompt": "hi", "prompt_logprobs": -1}, 400,
         "prompt_logprobs"),
    case("prompt-logprobs-too-many", C, {"prompt": "hi", "prompt_logprobs": 21}, 400,
         "prompt_logprobs"),
    case("prompt-logprobs-streamed", C, {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
         400, "prompt_logprobs"),
    case("chat-prompt-logprobs-streamed", CHAT,
         {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "stream": True},
         400, "prompt_logprobs"),
    case(
        "stream-options-without-stream",
        C,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    case("unknown-field", C, {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    case(
        "unknown-stream-option",
        C,
        {"prompt": "hi", "stream": True, "stream_options": {"usage_every_ms": 5}},
        400,
        "stream_options.usage_every_ms",
    ),
    case("unknown-model", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    case("malformed-json", C, b'{"prompt": "hi",', 422),
    case("empty-body", C, b"", 422),
    case("json-nested-too-deeply", C, b'{"prompt": ' + b"[" * 60_000, 422),
    case("bad-utf8", C, b'{"prompt": "\xff\xfe"}', 422),
    case("json-array-body", C, b"[1, 2]", 422),
    case("chat-missing-messages", CHAT, {"max_tokens": 4}, 422, "messages"),
    case("chat-empty-messages", CHAT, {"messages": []}, 400, "messages"),
    case(
        "chat-unknown-role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    case(
        "chat-content-int",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        422,
        "messages[0].content",
    ),
    case(
        "chat-image-part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
    ),
    case(
        "chat-tool-without-function",
        CHAT,
        {"messages": MSG, "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    case(
        "chat-unknown-response-format",
        CHAT,
        {"messages": MSG, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
    ),
    case(
        "chat-top-logprobs-without-logprobs",
        CHAT,
        {"messages": MSG, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    case(
        "chat-max-completion-tokens-zero",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    case("tokenize-nothing", "/tokenize", {}, 400, "prompt"),
    case("detokenize-out-of-vocab", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    case("unknown-route", "/v1/nope", {}, 404),
    case("wrong-method", C, None, 405, method="GET"),
    case("body-too-large", C, {"prompt": "x" * (MAX_BODY + 10)}, 413),
]


def assert_openai_error(response: Any, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error


async def send(http: Any, method: str, path: str, body: Any) -> Any:
    if body is None:
        return await http.request(method, path)
    if isinstance(body, bytes):
        return await http.request(
            method, path, content=body, headers={"content-type": "application/json"}
        )
    return await http.request(method, path, json=body)


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_request_gets_documented_status_and_shape(
    serve, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    s = await serve(max_body_bytes=MAX_BODY)
    assert_openai_error(await send(s.http, method, path, body), status, param)


async def test_server_keeps_serving_through_the_whole_table(serve) -> None:
    s = await serve(max_body_bytes=MAX_BODY)
    for method, path, body, status, param in (p.values for p in BAD_REQUESTS):
        assert_openai_error(await send(s.http, method, path, body), status, param)
    good = await s.http.post(C, json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    await s.wait_idle()
    assert s.engine.added == [f"{good.json()['id']}-0"], "no bad request reached the engine"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
async def test_a_json_body_without_the_json_content_type_is_told_so(
    serve, content_type: str | None
) -> None:
    s = await serve()
    # curl -d without -H sends application/x-www-form-urlencoded.
    headers = {"content-type": content_type} if content_type else {}
    r = await s.http.post(C, content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    assert_openai_error(r, 415, None)
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in error["message"]
    assert (content_type or "(none)") in error["message"]
    ok = await s.http.post(
        C,
        content=b'{"prompt": "hi", "max_tokens": 2}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200, ok.text


async def test_unknown_fields_can_be_ignored(serve) -> None:
    s = await serve(unknown_fields="ignore")
    r = await s.http.post(C, json={"prompt": "hi", "max_tokens": 2, "foo": 1})
    assert r.status_code == 200


async def test_known_harmless_openai_fields_are_accepted(serve) -> None:
    s = await serve()
    r = await s.http.post(
        CHAT,
        json={
            "messages": MSG,
            "max_tokens": 2,
            "store": False,
            "metadata": {"k": "v"},
            "user": "u1",
            "parallel_tool_calls": True,
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "The request body is empty: send a JSON object."),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": "a\xffb"}', "not valid UTF-8 JSON"),
    ],
    ids=["empty", "deep", "not-utf8"],
)
async def test_a_body_that_is_not_json_says_why(serve, body: bytes, says: str) -> None:
    s = await serve()
    r = await send(s.http, "POST", C, body)
    assert_openai_error(r, 422, None)
    error = r.json()["error"]
    assert says in error["message"] and error["code"] == "invalid_json", error


async def test_any_int64_seed_is_a_seed(serve) -> None:
    """OpenAI's seed is an int64; a negative one fixes the draws like any other."""
    s = await serve()
    for seed in (-(2**63), 2**63 - 1):  # choice 1's seed + 1 wraps around
        body = {"prompt": "hi", "max_tokens": 4, "seed": seed, "n": 2}
        first, again = [await s.http.post(C, json=body) for _ in range(2)]
        assert first.status_code == 200, first.text
        assert first.json()["choices"] == again.json()["choices"]


async def test_request_the_engine_refuses_is_a_400(serve) -> None:
    from tests.server.server_fakes import FakeEngine

    # Fits max_model_len, but not the (tiny) KV pool even alone: the engine says no.
    s = await serve(FakeEngine(num_blocks=2, block_size=4, max_model_len=256))
    r = await s.http.post(C, json={"prompt": "hello " * 20, "max_tokens": 2})
    assert_openai_error(r, 400, None)
    assert "KV pool" in r.json()["error"]["message"]


def test_validation_locations_become_openai_params() -> None:
    assert _loc_to_param(("body", "messages", 0, "content")) == "messages[0].content"
    assert _loc_to_param(("body", "prompt", "list[int]", 1)) == "prompt[1]"
    assert _loc_to_param(("body",)) is None


def test_api_error_body_shape() -> None:
    err = APIError(400, "bad", param="x", code="c")
    assert json.loads(err.response().body) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": "c"}
    }
