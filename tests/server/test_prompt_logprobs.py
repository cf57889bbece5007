"""Prompt logprobs in the API against the FakeEngine (its scripted values: each prompt token
-1.5 at rank 2, token 3 first at -0.5): completions' ``echo`` with ``logprobs`` (the lists
lm-evaluation-harness reads, ``max_tokens`` 0 and 1, streamed and not) and vLLM's
``prompt_logprobs`` field on both endpoints. The engine's values against transformers:
tests/engine/test_prompt_logprobs.py; through the real server: tests/server/test_integration.py.
"""

from __future__ import annotations

from tests.server.server_fakes import tiny_tokenizer
from tests.server.test_completions import greedy_text, sse_payloads, streamed_text

PROMPT = "hello big world"


def _ids() -> list[int]:
    return tiny_tokenizer().encode(PROMPT)


def _texts(ids: list[int]) -> list[str]:
    tok = tiny_tokenizer()
    return [tok.decode([i]) for i in ids]


def _assert_echoed_prompt(lp: dict, ids: list[int], top_n: int) -> None:
    n = len(ids)
    assert lp["tokens"][:n] == _texts(ids)
    assert lp["token_logprobs"][:n] == [None] + [-1.5] * (n - 1)
    assert lp["top_logprobs"][0] is None
    tok = tiny_tokenizer()
    for top, text in zip(lp["top_logprobs"][1:n], lp["tokens"][1:n], strict=True):
        # The top-N alternatives and the prompt's own token (OpenAI: up to N + 1 entries).
        alternatives = {tok.decode([t]): v for t, v in [(3, -0.5), (4, -1.0), (5, -1.25)][:top_n]}
        assert top == {**alternatives, text: -1.5}
    offsets = [0]
    for t in lp["tokens"][: n - 1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"][:n] == offsets


async def test_echo_with_logprobs_scores_the_prompt_then_the_output(serve) -> None:
    s = await serve()
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    r = await s.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = _ids()
    assert choice["text"] == PROMPT + greedy_text(2)
    lp = choice["logprobs"]
    _assert_echoed_prompt(lp, ids, 1)
    assert len(lp["tokens"]) == len(ids) + 2
    assert lp["token_logprobs"][len(ids) :] == [-0.25, -0.25]
    # The generated tokens' offsets count from the end of the echoed prompt text.
    assert lp["text_offset"][len(ids)] == len(PROMPT)
    assert "prompt_logprobs" not in choice


async def test_echo_with_max_tokens_0_returns_the_prompt_alone(serve) -> None:
    """lm-evaluation-harness's loglikelihood request: nothing generated is returned."""
    s = await serve()
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = await s.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    body_json = r.json()
    (choice,) = body_json["choices"]
    ids = _ids()
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    _assert_echoed_prompt(choice["logprobs"], ids, 2)
    assert body_json["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)
    }  # fmt: skip
    # Without echo, max_tokens 0 is still a 400 (nothing to return).
    r = await s.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_streamed_echo_with_logprobs(serve) -> None:
    s = await serve()
    ids = _ids()
    for max_tokens in (0, 3):
        body = {"prompt": [PROMPT, "big"], "max_tokens": max_tokens, "temperature": 0,
                "echo": True, "logprobs": 1, "stream": True, "n": 2}  # fmt: skip
        r = await s.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        payloads = sse_payloads(r.text)
        for index, prompt in enumerate([PROMPT, PROMPT, "big", "big"]):
            chunks = [c for p in payloads for c in p["choices"] if c["index"] == index]
            # The echo and the prompt's logprobs come first, in one chunk.
            assert chunks[0]["text"] == prompt
            prompt_ids = tiny_tokenizer().encode(prompt)
            _assert_echoed_prompt(chunks[0]["logprobs"], prompt_ids, 1)
            assert streamed_text(payloads, index) == prompt + greedy_text(max_tokens)
            tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert len(tokens) == len(prompt_ids) + max_tokens
            assert chunks[-1]["finish_reason"] == "length"
    assert ids  # the prompt has tokens to score


async def test_prompt_logprobs_field_on_completions(serve) -> None:
    s = await serve()
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    r = await s.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ids = _ids()
    choices = r.json()["choices"]
    expected = [None] + [
        {
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": tiny_tokenizer().decode([3])},
            "4": {"logprob": -1.0, "rank": 2, "decoded_token": tiny_tokenizer().decode([4])},
            str(t): {"logprob": -1.5, "rank": 2, "decoded_token": tiny_tokenizer().decode([t])},
        }
        for t in ids[1:]
    ]
    # Both choices carry their prompt's logprobs; only the first choice's request computed them.
    assert [c["prompt_logprobs"] for c in choices] == [expected, expected]
    engine = s.engine
    assert [engine.added_params[r].prompt_logprobs for r in engine.added] == [2, None]
    assert choices[0]["logprobs"] is None and choices[0]["text"] == greedy_text(2)


async def test_prompt_logprobs_field_on_chat(serve) -> None:
    s = await serve()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt_logprobs": 0}  # fmt: skip
    r = await s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    assert got[0] is None and len(got) > 2
    # 0: the prompt's own token alone.
    assert all(len(position) == 1 for position in got[1:])
    assert all(next(iter(p.values()))["logprob"] in (-1.5, -0.5) for p in got[1:])
    r = await s.http.post("/v1/chat/completions", json={**body, "prompt_logprobs": None})
    assert "prompt_logprobs" not in r.json()
