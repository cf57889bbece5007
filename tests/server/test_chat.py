"""POST /v1/chat/completions: template, message validation, max tokens, logprobs format."""

from __future__ import annotations

import openai

from tests.server.server_fakes import FakeEngine, tiny_tokenizer
from tests.server.test_completions import greedy_text

MSG = [{"role": "user", "content": "hi"}]


async def test_chat_uses_the_template_without_double_specials(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}],
                },
            ],
            "max_tokens": 3,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    tok = tiny_tokenizer()
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(expected, add_special_tokens=False)
    assert choice["message"] == {"role": "assistant", "content": greedy_text(3)}
    assert r.json()["object"] == "chat.completion" and r.json()["id"].startswith("chatcmpl-")


async def test_the_sdk_s_none_for_optional_fields_means_their_defaults(serve) -> None:
    """The openai SDK sends a keyword given as None as JSON null (wrappers pass
    ``kwargs.get("n")``); OpenAI's schema makes these fields nullable."""
    s = await serve()
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=s.http)
    out = await client.chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=3, temperature=0,
        n=None, logprobs=None, stream=None, stream_options=None,
    )  # fmt: skip
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    assert out.usage is not None and out.usage.completion_tokens == 3
    text = await client.completions.create(
        model="fake-model", prompt="hi", max_tokens=2, echo=None, n=None, stream=None
    )
    assert len(text.choices) == 1 and not text.choices[0].text.startswith("hi")


async def test_chat_default_max_tokens_is_the_rest_of_the_context(serve) -> None:
    s = await serve(FakeEngine(max_model_len=64))
    r = (await s.http.post("/v1/chat/completions", json={"messages": MSG})).json()
    assert r["usage"]["total_tokens"] == 64
    assert r["choices"][0]["finish_reason"] == "length"


async def test_max_completion_tokens_wins_over_max_tokens(serve) -> None:
    s = await serve()
    r = (
        await s.http.post(
            "/v1/chat/completions",
            json={"messages": MSG, "max_tokens": 9, "max_completion_tokens": 2},
        )
    ).json()
    assert r["usage"]["completion_tokens"] == 2


async def test_chat_logprobs_format(serve) -> None:
    s = await serve()
    r = (
        await s.http.post(
            "/v1/chat/completions",
            json={
                "messages": MSG,
                "max_tokens": 3,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        )
    ).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    # logprobs without top_logprobs: the chosen token only
    r = (
        await s.http.post(
            "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "logprobs": True}
        )
    ).json()
    assert all(e["top_logprobs"] == [] for e in r["choices"][0]["logprobs"]["content"])


async def test_chat_logprobs_bytes_rebuild_characters_split_across_tokens(serve) -> None:
    """OpenAI's ``bytes`` are the token's raw UTF-8 bytes: a token that is part of a
    character says which part (its text alone is U+FFFD), so the joined bytes are the text."""
    s = await serve(FakeEngine(continuation="日本 🎉 ok"))
    body = {"messages": MSG, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 1}  # fmt: skip
    r = (await s.http.post("/v1/chat/completions", json=body)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert any(e["token"] == "\ufffd" for e in content), "the case under test: split characters"
    joined = bytes(b for e in content for b in e["bytes"]).decode()
    assert joined == r["choices"][0]["message"]["content"]
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


async def test_chat_stop_string_streaming(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/chat/completions",
        json={
            "messages": MSG,
            "max_tokens": 20,
            "temperature": 0,
            "stop": ["own f"],
            "stream": True,
        },
    )
    import json

    chunks = [json.loads(f[6:]) for f in r.text.split("\n\n") if f.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == " the quick br"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
