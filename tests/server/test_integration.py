"""The real server: `python -m server` in a subprocess on 127.0.0.1 (real uvicorn, sockets),
serving the embedded default model, called with the official `openai` package and raw httpx
(tests/server/real_server.py starts it).

References: the offline engine (`engine.LLM`) run on each prompt alone, and transformers'
own forward pass on the same weights for logprobs. The server starts once per session.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.server.real_server import (
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    WORDS,
    RealServer,
    alone,
    async_client,
    running_server,
    sync_client,
    torch_threads,
)
from tests.server.test_errors import BAD_REQUESTS, assert_openai_error
from tests.server.test_streaming import split_frames

pytestmark = pytest.mark.slow

# The server runs float32 on the CPU on any machine (real_server.py); so does its reference.
DEVICE = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    with running_server(tmp_path_factory.mktemp("server") / "server.log") as real:
        yield real


@pytest.fixture(scope="session")
def reference() -> LLM:
    """The offline engine on the same model: each prompt is generated alone."""
    with torch_threads(1):
        return LLM(model="default", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, **DEVICE)


# ------------------------------------------------------------------------------ tests


def test_startup_logs_say_what_was_loaded(server: RealServer) -> None:
    text = server.log.read_text()
    assert "loaded SmolLM2-135M-Instruct" in text
    assert f"KV cache: {NUM_KV_BLOCKS} blocks x 16 tokens = {NUM_KV_BLOCKS * 16} tokens" in text
    models = sync_client(server).models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_openai_sync_completion_and_chat(server: RealServer, reference: LLM) -> None:
    client = sync_client(server)
    prompt = "The capital of France is"
    expected = alone(reference, prompt, SamplingParams(max_tokens=8, temperature=0))
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0
    )
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)

    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text

    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": "Say hello in French."}],
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say hello in French."}],
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_logit_bias_through_the_openai_client(server: RealServer, reference: LLM) -> None:
    """OpenAI's logit_bias (token ids as string keys): the server's tokens are the offline
    engine's with the same bias, which bans the unbiased answer's first tokens."""
    client = sync_client(server)
    prompt = "The capital of France is"
    plain = alone(reference, prompt, SamplingParams(max_tokens=6, temperature=0))
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[1]: -100.0}
    expected = alone(
        reference, prompt, SamplingParams(max_tokens=6, temperature=0, logit_bias=bias)
    )
    assert expected.token_ids[:2] != plain.token_ids[:2]
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
    )  # fmt: skip
    assert resp.choices[0].text == expected.text
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Say yes."}],
        logit_bias={str(plain.token_ids[0]): 100},  # forced, every token
    )  # fmt: skip
    assert chat.choices[0].message.content == reference.tokenizer.decode([plain.token_ids[0]] * 4)


def test_sse_framing_on_the_wire(server: RealServer) -> None:
    with httpx.Client(timeout=60) as http:
        r = http.post(
            f"{server.url}/v1/completions",
            json={
                "prompt": "Once upon a time",
                "max_tokens": 5,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = split_frames(r.content)
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    for raw, chunk in zip(frames[:-1], chunks, strict=True):
        assert (
            raw
            == b"data: "
            + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
            + b"\n\n"
        )


def test_32_concurrent_greedy_requests_match_the_offline_engine(
    server: RealServer, reference: LLM
) -> None:
    prompts = [" ".join(WORDS[: 2 + i % len(WORDS)]) + f" ({i})" for i in range(32)]
    max_tokens = [3 + i % 8 for i in range(32)]

    async def run_all() -> list[Any]:
        client = async_client(server)
        return await asyncio.gather(
            *[
                client.completions.create(
                    model="SmolLM2-135M-Instruct",
                    prompt=p,
                    max_tokens=k,
                    temperature=0,
                    logprobs=2,
                    extra_body={"return_token_ids": True},
                )
                for p, k in zip(prompts, max_tokens, strict=True)
            ]
        )

    responses = asyncio.run(run_all())
    tolerated = []
    for prompt, k, resp in zip(prompts, max_tokens, responses, strict=True):
        expected = alone(reference, prompt, SamplingParams(max_tokens=k, temperature=0, logprobs=2))
        choice = resp.choices[0]
        got = choice.model_extra["token_ids"]
        assert choice.model_extra["prompt_token_ids"] == expected.prompt_token_ids
        if got == expected.token_ids:
            assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
            continue
        # The near-tie rule (tests/engine/parity.py): a divergence is accepted only where the
        # reference's top-2 logits are within rounding (margin < 1e-3); everything before it
        # must match exactly.
        pairs = enumerate(zip(got, expected.token_ids, strict=False))
        j = next((i for i, (a, b) in pairs if a != b), None)
        assert j is not None, f"{prompt!r}: same tokens, different lengths: {got}"
        top = expected.logprobs[j].top
        margin = top[0][1] - top[1][1]
        assert margin < 1e-3, f"{prompt!r}: token {j} differs ({got} vs {expected.token_ids})"
        tolerated.append((prompt, j, margin))
    if tolerated:
        print(f"tolerated near-tie divergences: {tolerated}")
    server.wait_pool_free()


def spanning_stop(reference: LLM, text: str, token_ids: list[int]) -> str:
    """A stop string made of the end of one token and the start of the next."""
    tok = reference.tokenizer
    pieces = [tok.decode([t]) for t in token_ids]
    for a, b in zip(pieces, pieces[1:], strict=False):
        if len(a) >= 3 and len(b) >= 3 and a.isascii() and b.isascii():
            return a[-2:] + b[:2]
    raise AssertionError(f"no two long adjacent tokens in {pieces}")


def test_stop_string_spanning_tokens(server: RealServer, reference: LLM) -> None:
    prompt = "The history of science shows that"
    full = alone(reference, prompt, SamplingParams(max_tokens=24, temperature=0))
    stop = spanning_stop(reference, full.text, full.token_ids)
    expected = full.text[: full.text.index(stop)]
    client = sync_client(server)
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0, stop=[stop]
    )
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 24
    chunks = list(
        client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_pool_free()


def test_n3_with_seed_is_distinct_and_reproducible(server: RealServer) -> None:
    client = sync_client(server)
    kwargs: dict[str, Any] = dict(
        model="SmolLM2-135M-Instruct",
        prompt="My favourite food is",
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=1234,
        extra_body={"return_token_ids": True},
    )
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3, texts
    assert texts == [c.text for c in second.choices]
    token_ids = [c.model_extra["token_ids"] for c in first.choices]
    assert first.usage.completion_tokens == sum(len(t) for t in token_ids)
    assert first.usage.prompt_tokens == len(first.choices[0].model_extra["prompt_token_ids"])


def test_logprobs_match_transformers_log_softmax(server: RealServer, reference: LLM) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model

    prompt = "The quick brown fox"
    resp = sync_client(server).completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    prompt_ids, out_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(out_ids) == 6
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model("default").path, dtype=torch.float32
    ).eval()
    with torch.no_grad(), torch_threads(1):
        logits = hf(torch.tensor([prompt_ids + out_ids])).logits[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    tok = reference.tokenizer
    for j, token_id in enumerate(out_ids):
        row = log_probs[len(prompt_ids) + j - 1]
        assert abs(lp.token_logprobs[j] - row[token_id].item()) < 1e-3
        top = lp.top_logprobs[j]
        assert len(top) == 5, top  # greedy: the chosen token is one of the top 5
        values, ids = row.topk(5)
        for value, tid in zip(values.tolist(), ids.tolist(), strict=True):
            assert abs(top[tok.decode([tid])] - value) < 1e-3


def test_echoed_prompt_logprobs_as_lm_eval_asks_for_them(
    server: RealServer, reference: LLM
) -> None:
    """lm-evaluation-harness's loglikelihood request through the openai client (token-id
    prompt, ``echo``, ``logprobs=1``, ``max_tokens`` 0 and 1): every prompt token's logprob
    is transformers' log_softmax, and the top-1 says whether the text was the greedy one."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model

    prompt_ids = reference.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model("default").path, dtype=torch.float32
    ).eval()
    with torch.no_grad(), torch_threads(1):
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    greedy_ref = [int(ref[i - 1].argmax()) == prompt_ids[i] for i in range(1, len(prompt_ids))]
    for max_tokens in (0, 1):
        resp = sync_client(server).completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt_ids, max_tokens=max_tokens,
            temperature=0, logprobs=1, echo=True,
        )  # fmt: skip
        lp = resp.choices[0].logprobs
        assert len(lp.token_logprobs) == len(prompt_ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(prompt_ids)):
            row = ref[i - 1]
            assert abs(lp.token_logprobs[i] - row[prompt_ids[i]].item()) < 1e-3
            assert abs(max(lp.top_logprobs[i].values()) - row.max().item()) < 1e-3
        assert resp.usage.completion_tokens == max_tokens
        # The harness's greedy check: is each prompt token the top-1 at its position?
        greedy = [
            lp.tokens[i] == max(lp.top_logprobs[i], key=lp.top_logprobs[i].get)
            for i in range(1, len(prompt_ids))
        ]
        assert greedy == greedy_ref


def test_aborting_10_streams_frees_the_pool_while_others_complete(
    server: RealServer, reference: LLM
) -> None:
    prompts = ["Write a long story about a dragon", "List every prime number"]
    expected = [
        alone(reference, p, SamplingParams(max_tokens=12, temperature=0)).text for p in prompts
    ]

    async def abandoned(http: httpx.AsyncClient, i: int) -> int:
        body = {
            "prompt": f"Tell me everything about topic {i}",
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        received = 0
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                received += line.startswith("data: {")
                if received >= 3:
                    break  # leaving the block closes the connection mid-stream
        return received

    async def completed(client: openai.AsyncOpenAI, prompt: str) -> str:
        resp = await client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0
        )
        return resp.choices[0].text

    async def run() -> tuple[list[int], list[str]]:
        async with httpx.AsyncClient(timeout=120) as http:
            client = async_client(server)
            results = await asyncio.gather(
                *[abandoned(http, i) for i in range(10)], *[completed(client, p) for p in prompts]
            )
        return list(results[:10]), list(results[10:])

    received, texts = asyncio.run(run())
    assert received == [3] * 10
    assert texts == expected
    # 10 x 200 tokens would take far longer than this: the streams were aborted.
    server.wait_pool_free(timeout_s=10)
    assert server.health()["status"] == "ok"


def test_non_streaming_disconnect_frees_the_pool(server: RealServer) -> None:
    # 240 tokens take over a second even at batch-1 speed (~5 ms a token); the client gives up
    # after 0.5 s, mid-generation.
    body = {"prompt": "Count slowly", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    server.wait_pool_free(timeout_s=10)


def test_error_table_against_the_real_server(server: RealServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for param_set in BAD_REQUESTS:
            method, path, body, status, param = param_set.values
            if body is None:
                r = http.request(method, path)
            elif isinstance(body, bytes):
                r = http.request(
                    method, path, content=body, headers={"content-type": "application/json"}
                )
            else:
                r = http.request(method, path, json=body)
            assert_openai_error(r, status, param)
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
    server.wait_pool_free()
    assert server.health()["status"] == "ok"
