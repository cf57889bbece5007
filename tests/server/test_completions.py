"""POST /v1/completions against the FakeEngine: text, usage, stop handling, n, echo, logprobs."""

from __future__ import annotations

import json

import pytest

from tests.server.server_fakes import FakeEngine, tiny_tokenizer

CONTINUATION = " the quick brown fox jumps over the lazy dog."


def greedy_text(num_tokens: int, continuation: str = CONTINUATION) -> str:
    tok = tiny_tokenizer()
    ids = tok.encode(continuation)
    return tok.decode([ids[i % len(ids)] for i in range(num_tokens)])


def sse_payloads(body: str) -> list[dict]:
    frames = body.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]", frames[-3:]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]


def streamed_text(payloads: list[dict], index: int = 0) -> str:
    return "".join(c["text"] for p in payloads for c in p["choices"] if c["index"] == index)


async def test_greedy_text_usage_and_length_finish(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hello world", "max_tokens": 6, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": greedy_text(6),
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    prompt_len = len(tiny_tokenizer().encode("hello world"))
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 6,
        "total_tokens": prompt_len + 6,
    }
    await s.wait_idle()


async def test_max_tokens_defaults_to_16(serve) -> None:
    s = await serve()
    r = await s.http.post("/v1/completions", json={"prompt": "hi", "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 16


async def test_max_tokens_null_runs_to_the_context_length(serve) -> None:
    s = await serve(FakeEngine(max_model_len=40))
    prompt_len = len(tiny_tokenizer().encode("hello world"))
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hello world", "max_tokens": None, "temperature": 0}
    )
    assert r.json()["usage"]["completion_tokens"] == 40 - prompt_len
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_eos_finishes_with_stop_and_adds_no_text(serve) -> None:
    s = await serve(FakeEngine(eos_after=4))
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 10, "temperature": 0}
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None  # the model's EOS: no stop the request named
    assert choice["text"] == greedy_text(3)  # the EOS counts as a token but adds no text
    assert r.json()["usage"]["completion_tokens"] == 4


async def test_ignore_eos_runs_to_max_tokens(serve) -> None:
    s = await serve(FakeEngine(eos_after=4))
    r = await s.http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
    )
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 10


async def test_stop_token_ids(serve) -> None:
    s = await serve()
    brown = tiny_tokenizer().encode(" brown")
    assert len(brown) == 1
    r = await s.http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 10, "temperature": 0, "stop_token_ids": brown},
    )
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", brown[0])
    assert choice["text"] == " the quick"  # the stop token's text is not returned
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_stop_string_across_tokens_non_streaming(serve) -> None:
    s = await serve(FakeEngine(step_delay_s=0.01))  # slow enough for the abort to matter
    # " quick" and " brown" are separate tokens; the stop string straddles them.
    r = await s.http.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 200,
            "temperature": 0,
            "stop": ["ck bro", "zzz"],
            "return_token_ids": True,
        },
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == " the qui"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "ck bro")
    # Tokens and usage end at the token that completed the stop string.
    tok = tiny_tokenizer()
    assert choice["token_ids"] == tok.encode(" the quick brown")
    assert r.json()["usage"]["completion_tokens"] == 3
    await s.wait_idle()  # the engine request was aborted, its blocks returned
    assert s.engine.aborted, "the server must abort the engine request at a stop string"


@pytest.mark.parametrize("stream", [False, True])
async def test_min_tokens_lets_no_stop_string_end_the_text_before_it(serve, stream) -> None:
    """vLLM's rule: a stop string ends the choice only in the text of an output token past
    min_tokens. "ck bro" is completed by the third token (" brown"): with min_tokens 2 it
    stops there (though it started in the second), with 3 only at its next occurrence."""
    s = await serve()
    for min_tokens, text in [(2, " the qui"), (3, CONTINUATION + " the qui")]:
        body = {"prompt": "hi", "max_tokens": 40, "temperature": 0, "stop": "ck bro",
                "min_tokens": min_tokens, "stream": stream}  # fmt: skip
        r = await s.http.post("/v1/completions", json=body)
        if stream:
            assert streamed_text(sse_payloads(r.text)) == text
        else:
            assert r.json()["choices"][0]["text"] == text
            assert r.json()["choices"][0]["finish_reason"] == "stop"
    for min_tokens in (-1, 41):
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40,
                                                       "min_tokens": min_tokens})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize("stream", [False, True])
async def test_include_stop_str_in_output_keeps_the_stop(serve, stream) -> None:
    """vLLM's include_stop_str_in_output: the stop string, or the stop token's text, ends the
    text instead of being cut."""
    s = await serve()
    brown = tiny_tokenizer().encode(" brown")
    for stop, text in [({"stop": "ck bro"}, " the quick bro"),
                       ({"stop_token_ids": brown}, " the quick brown")]:  # fmt: skip
        body = {"prompt": "hi", "max_tokens": 10, "temperature": 0, "stream": stream,
                "include_stop_str_in_output": True, **stop}  # fmt: skip
        r = await s.http.post("/v1/completions", json=body)
        got = streamed_text(sse_payloads(r.text)) if stream else r.json()["choices"][0]["text"]
        assert got == text


async def test_skip_special_tokens_false_keeps_their_text(serve) -> None:
    s = await serve(FakeEngine(continuation=" a<|im_start|> b"))
    body = {"prompt": "hi", "max_tokens": 5, "temperature": 0}  # " ", "a", special, " ", "b"
    skipped = (await s.http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    kept = (
        await s.http.post("/v1/completions", json={**body, "skip_special_tokens": False})
    ).json()["choices"][0]["text"]
    assert (skipped, kept) == (" a b", " a<|im_start|> b")


async def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(serve) -> None:
    s = await serve()
    ids = list(range(5, 45))
    body = {"prompt": ids, "max_tokens": 2, "return_token_ids": True}
    for keep, want in [(7, ids[-7:]), (100, ids), (256, ids), (-1, ids)]:
        r = await s.http.post("/v1/completions", json={**body, "truncate_prompt_tokens": keep})
        assert r.json()["choices"][0]["prompt_token_ids"] == want
        assert r.json()["usage"]["prompt_tokens"] == len(want)
    chat = {"messages": [{"role": "user", "content": "a long question " * 5}], "max_tokens": 1}
    full = (await s.http.post("/v1/chat/completions", json=chat)).json()["usage"]
    cut = await s.http.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 3})
    assert full["prompt_tokens"] > 3 and cut.json()["usage"]["prompt_tokens"] == 3
    for keep in (0, -2, 257):  # the fake engine's context: 256 tokens
        r = await s.http.post("/v1/completions", json={**body, "truncate_prompt_tokens": keep})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_reason_names_the_stop_that_ended_each_choice(serve, route, stream) -> None:
    """vLLM's stop_reason: the stop string matched or the stop token id, null for the model's
    EOS and for a length finish; streamed in the finish chunk, null in the others."""
    s = await serve(FakeEngine(eos_after=12))
    brown = tiny_tokenizer().encode(" brown")
    prompt = {"prompt": "hi"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    cases = [
        ({"stop": ["zzz", "ck bro"]}, "stop", "ck bro"),
        ({"stop_token_ids": brown}, "stop", brown[0]),
        ({"stop": "zzz", "stop_token_ids": [7]}, "stop", None),  # the EOS came first
        ({"max_tokens": 2}, "length", None),
        ({"stop": "quick", "include_stop_str_in_output": True}, "stop", "quick"),
    ]
    for fields, finish, stop_reason in cases:
        body = {**prompt, "max_tokens": 20, "temperature": 0, "stream": stream, **fields}
        r = await s.http.post(route, json=body)
        assert r.status_code == 200, r.text
        if stream:
            choices = [c for p in sse_payloads(r.text) for c in p["choices"]]
            *before, last = choices
            assert all(c["stop_reason"] is None for c in before)
        else:
            (last,) = r.json()["choices"]
        assert (last["finish_reason"], last["stop_reason"]) == (finish, stop_reason), fields
    await s.wait_idle()


async def test_stop_string_across_tokens_streaming(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 12, "temperature": 0, "stop": "ck bro", "stream": True},
    )
    payloads = sse_payloads(r.text)
    assert streamed_text(payloads) == " the qui"
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("ck bro" not in c["text"] for p in payloads for c in p["choices"])
    await s.wait_idle()


async def test_stop_string_at_the_very_start_gives_empty_text(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 12, "temperature": 0, "stop": " the"}
    )
    assert r.json()["choices"][0]["text"] == ""
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_n_with_seed_is_distinct_and_reproducible(serve) -> None:
    s = await serve()
    body = {"prompt": "hi", "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 1234}
    first = (await s.http.post("/v1/completions", json=body)).json()
    second = (await s.http.post("/v1/completions", json=body)).json()
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert texts == [c["text"] for c in second["choices"]]
    prompt_len = len(tiny_tokenizer().encode("hi"))
    assert first["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 24,
        "total_tokens": prompt_len + 24,
    }
    # the engine saw n requests, named after the HTTP request
    assert sorted(r.rsplit("-", 1)[1] for r in s.engine.added[:3]) == ["0", "1", "2"]


async def test_batch_of_prompts_is_prompt_major_and_counts_each_prompt_once(serve) -> None:
    s = await serve()
    tok = tiny_tokenizer()
    prompts = ["hello", "one two three"]
    r = await s.http.post(
        "/v1/completions",
        json={
            "prompt": prompts,
            "n": 2,
            "max_tokens": 3,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [
        tok.encode(p) for p in prompts for _ in range(2)
    ]
    prompt_tokens = sum(len(tok.encode(p)) for p in prompts)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 4 * 3


async def test_token_id_prompts(serve) -> None:
    s = await serve()
    tok = tiny_tokenizer()
    single = tok.encode("hello world")
    r = await s.http.post(
        "/v1/completions", json={"prompt": single, "max_tokens": 2, "temperature": 0}
    )
    assert r.json()["usage"]["prompt_tokens"] == len(single)
    r = await s.http.post(
        "/v1/completions", json={"prompt": [single, single[:1]], "max_tokens": 2, "temperature": 0}
    )
    assert len(r.json()["choices"]) == 2
    assert r.json()["usage"]["prompt_tokens"] == len(single) + 1


async def test_echo_prepends_the_prompt(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0, "echo": True}
    )
    assert r.json()["choices"][0]["text"] == "hello" + greedy_text(3)
    r = await s.http.post(
        "/v1/completions",
        json={"prompt": "hello", "max_tokens": 3, "temperature": 0, "echo": True, "stream": True},
    )
    assert streamed_text(sse_payloads(r.text)) == "hello" + greedy_text(3)


async def test_logprobs_format(serve) -> None:
    s = await serve()
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    )
    lp = r.json()["choices"][0]["logprobs"]
    tok = tiny_tokenizer()
    ids = tok.encode(CONTINUATION)[:4]
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    assert lp["token_logprobs"] == [-0.25] * 4
    assert all(
        len(top) == 2 and top[t] == -0.25
        for top, t in zip(lp["top_logprobs"], lp["tokens"], strict=True)
    )
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets


async def test_multibyte_stream_has_no_replacement_chars(serve) -> None:
    continuation = " 日本語 🎉 café ∑"
    s = await serve(FakeEngine(continuation=continuation))
    n = len(tiny_tokenizer().encode(continuation))
    r = await s.http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": n, "temperature": 0, "stream": True}
    )
    payloads = sse_payloads(r.text)
    assert streamed_text(payloads) == continuation
    assert all("\ufffd" not in c["text"] for p in payloads for c in p["choices"])


async def test_concurrent_requests_are_isolated(serve) -> None:
    import asyncio

    s = await serve(FakeEngine(max_num_seqs=4, num_blocks=256))
    lengths = [1, 3, 5, 7, 9, 11, 13, 15]
    rs = await asyncio.gather(
        *[
            s.http.post(
                "/v1/completions",
                json={"prompt": f"one two {i}", "max_tokens": k, "temperature": 0},
            )
            for i, k in enumerate(lengths)
        ]
    )
    for r, k in zip(rs, lengths, strict=True):
        assert r.json()["choices"][0]["text"] == greedy_text(k)
    await s.wait_idle()
