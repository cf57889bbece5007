"""Overload, chaos and SIGTERM against the real server (`python -m server` subprocess).

The server serves a tiny random Llama (tests/server/tiny_server.py) so that hundreds of
requests take seconds on 2 CPU cores; everything else is the production path (the chaos
server adds only the test-only fault injector, through tests/server/fault_server.py). Greedy
references are the server's own answers for each prompt run alone (one request at a time),
taken before the load: under load every request must get exactly those tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.tiny_server import TinyServer, exit_output, make_tiny_model_dir, tiny_server

MARKER = 5  # --fault-token-id of tests.server.fault_server: prompts holding it fail in a step
FIRST_TOKEN = 10  # ordinary prompts use ids from here on (no specials, never the marker)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-served"))


def random_prompts(num: int, seed: int, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(1, 40))] for _ in range(num)
    ]


def references(server: TinyServer, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens (up to MAX_TOKENS) with nothing else running."""
    return [tokens for tokens, _ in scored_references(server, prompts)]


def scored_references(
    server: TinyServer, prompts: list[list[int]]
) -> list[tuple[list[int], list[float | None]]]:
    """Each prompt's greedy tokens (up to MAX_TOKENS) and prompt logprobs, with nothing else
    running."""
    out = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for prompt in prompts:
            payload = {**body(prompt, MAX_TOKENS), "prompt_logprobs": 0}
            r = http.post("/v1/completions", json=payload)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["token_ids"], prompt_logprob_values(choice)))
    return out


def prompt_logprob_values(choice: dict[str, Any]) -> list[float | None]:
    """A choice's vLLM-style ``prompt_logprobs`` (``prompt_logprobs: 0``: each position's own
    token only) as the logprob at each position, None at the first."""
    values: list[float | None] = []
    for entry in choice["prompt_logprobs"]:
        if entry is None:
            values.append(None)
        else:
            assert len(entry) == 1, entry
            values.append(next(iter(entry.values()))["logprob"])
    return values


def body(prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
    }


def streamed_tokens(lines: list[str]) -> tuple[list[int], dict[str, Any] | None]:
    """Token ids of an SSE completion stream, and its in-band error event if any."""
    tokens: list[int] = []
    for line in lines:
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return tokens, event
        for choice in event["choices"]:
            tokens.extend(choice.get("token_ids") or [])
    return tokens, None


def assert_openai_error(payload: Any, code: str) -> None:
    assert set(payload) == {"error"} and payload["error"]["code"] == code, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------ overload


@pytest.fixture(scope="module")
def overload_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinyServer]:
    log = tmp_path_factory.mktemp("overload") / "server.log"
    # Asynchronous scheduling here (the chaos soak below runs synchronous steps): the same
    # tokens under a burst of admissions, aborts of refused streams and preemption.
    with tiny_server(
        model_dir, log,
        "--max-num-seqs", "4",
        "--max-waiting-requests", "4",
        "--num-kv-blocks", "64",
        "--block-size", "4",
        "--check-integrity", "true",
        "--async-scheduling",
    ) as server:  # fmt: skip
        yield server


def test_overload_10x_capacity_gets_full_answers_or_503(overload_server: TinyServer) -> None:
    """80 concurrent requests against max_num_seqs 4 + max_waiting_requests 4: each one gets
    its full, correct completion or a 503 with Retry-After; none hangs; the pool is free and
    consistent afterwards."""
    server = overload_server
    prompts = random_prompts(10, seed=1)
    expected = references(server, prompts)
    capacity = 4 + 4

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, Any]:
        prompt = prompts[i % len(prompts)]
        stream = i % 3 == 0
        if not stream:
            r = await http.post("/v1/completions", json=body(prompt, MAX_TOKENS))
            if r.status_code == 503:
                return "503", (r.headers.get("retry-after"), r.json())
            assert r.status_code == 200, r.text
            return "ok", (i, r.json()["choices"][0]["token_ids"])
        async with http.stream("POST", "/v1/completions", json=body(prompt, MAX_TOKENS, True)) as r:
            if r.status_code == 503:
                return "503", (r.headers.get("retry-after"), json.loads(await r.aread()))
            assert r.status_code == 200
            tokens, error = streamed_tokens([line async for line in r.aiter_lines()])
            assert error is None, error
            return "ok", (i, tokens)

    async def run() -> list[tuple[str, Any]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            tasks = [one(http, i) for i in range(10 * capacity)]
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # none hangs

    results = asyncio.run(run())
    outcomes = Counter(kind for kind, _ in results)
    print(f"overload outcomes: {dict(outcomes)}")
    assert outcomes["ok"] >= capacity and outcomes["503"] > 0, outcomes
    for kind, value in results:
        if kind == "503":
            retry_after, payload = value
            assert retry_after == "1"
            assert_openai_error(payload, "server_overloaded")
        else:
            i, tokens = value
            assert tokens == expected[i % len(prompts)], f"request {i}"
    health = server.wait_idle()
    assert health["status"] == "ok" and health["engine"]["kv_blocks_used"] == 0


# ------------------------------------------------------------------------------ chaos


@pytest.fixture(scope="module", params=["sync", "async"])
def chaos_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[TinyServer]:
    log = tmp_path_factory.mktemp("chaos") / "server.log"
    # 48 blocks of 4 tokens: 8 sequences of up to 40 + 12 tokens do not all fit, so the
    # scheduler preempts and recomputes during the soak, on top of everything else. Once
    # with synchronous steps, once with asynchronous scheduling (the poisoned requests
    # then fail inside a launch beside decodes fed on the device).
    extra = ["--async-scheduling"] if request.param == "async" else []
    with tiny_server(
        model_dir, log,
        "--max-num-seqs", "8",
        "--max-waiting-requests", "64",
        "--num-kv-blocks", "48",
        "--block-size", "4",
        "--fault-token-id", str(MARKER),
        "--check-integrity", "true",
        *extra,
        module="tests.server.fault_server",
    ) as server:  # fmt: skip
        yield server


def test_chaos_soak(chaos_server: TinyServer) -> None:
    """A few hundred requests with random prompts, lengths and modes; about 20 % of clients
    hang up at a random point, some carry a random deadline, a few are engineered to raise
    inside the engine, and about a third of those not streamed ask for their prompt's logprobs
    (rows of logits at every prompt position, no prefix cache). Every request that was not cut
    short gets exactly its solo tokens, and its solo prompt logprobs where it asked; the pool
    ends free and consistent; the server's RSS does not grow from the first third of the run
    to the last."""
    server = chaos_server
    prompts = random_prompts(24, seed=7)
    solo = scored_references(server, prompts)
    rng = random.Random(11)
    num_requests, concurrency = 300, 24
    plans = []
    for i in range(num_requests):
        roll = rng.random()
        kind = (
            "poison" if roll < 0.04
            else "disconnect" if roll < 0.24
            else "deadline" if roll < 0.34
            else "normal"
        )  # fmt: skip
        plans.append(
            {
                "i": i,
                "kind": kind,
                "prompt": rng.randrange(len(prompts)),
                "max_tokens": rng.randint(1, MAX_TOKENS),
                "stream": rng.random() < 0.5,
                "after_frames": rng.randint(0, 6),
                "after_s": rng.uniform(0.0, 0.3),
                "deadline_s": rng.uniform(0.02, 1.0),
                "scored": rng.random() < 0.33,
            }
        )
    rss: dict[str, int] = {}

    async def one(http: httpx.AsyncClient, plan: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        prompt = list(prompts[plan["prompt"]])
        if plan["kind"] == "poison":
            prompt.insert(len(prompt) // 2, MARKER)
        headers = (
            {"X-Request-Timeout": f"{plan['deadline_s']:.3f}"} if plan["kind"] == "deadline" else {}
        )
        payload = body(prompt, plan["max_tokens"], plan["stream"])
        if plan["scored"] and not plan["stream"]:
            payload["prompt_logprobs"] = 0
        if plan["kind"] == "disconnect" and not plan["stream"]:
            try:  # a client that gives up: httpx closes the connection on its timeout
                r = await http.post("/v1/completions", json=payload, timeout=plan["after_s"] + 0.01)
            except httpx.TimeoutException:
                return "gone", plan
            assert r.status_code == 200, r.text  # it finished before the client gave up
            return "tokens", completed(plan, r.json()["choices"][0])
        if not plan["stream"]:
            r = await http.post("/v1/completions", json=payload, headers=headers)
            if r.status_code == 200:
                return "tokens", completed(plan, r.json()["choices"][0])
            return f"status-{r.status_code}", {**plan, "error": r.json()}
        async with http.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
            if r.status_code != 200:  # failed before the stream started (e.g. a deadline)
                return f"status-{r.status_code}", {**plan, "error": json.loads(await r.aread())}
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if plan["kind"] == "disconnect" and len(lines) > 2 * plan["after_frames"]:
                    return "gone", plan  # leaving the block closes the connection
        tokens, error = streamed_tokens(lines)
        if error is not None:
            return "stream-error", {**plan, "error": error}
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
        return "tokens", {**plan, "tokens": tokens}

    def completed(plan: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        scored = prompt_logprob_values(choice) if "prompt_logprobs" in choice else None
        return {**plan, "tokens": choice["token_ids"], "prompt_logprobs": scored}

    async def run() -> list[tuple[str, dict[str, Any]]]:
        semaphore = asyncio.Semaphore(concurrency)
        done = 0

        async def limited(plan: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            nonlocal done
            async with semaphore:
                result = await one(http, plan)
            done += 1
            if done == num_requests // 3:
                rss["first_third"] = server.rss_bytes()
            return result

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.wait_for(asyncio.gather(*map(limited, plans)), 110)

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    health = server.wait_idle()
    rss["end"] = server.rss_bytes()
    outcomes = Counter(kind for kind, _ in results)
    print(f"chaos: {num_requests} requests in {elapsed:.1f}s, outcomes {dict(outcomes)}, rss {rss}")
    for kind, result in results:
        plan_kind = result["kind"]
        if kind == "tokens":
            assert plan_kind in ("normal", "deadline", "disconnect"), result
            solo_tokens, solo_scores = solo[result["prompt"]]
            assert result["tokens"] == solo_tokens[: result["max_tokens"]], result
            scores = result.get("prompt_logprobs")
            assert (scores is not None) == (result["scored"] and not result["stream"]), result
            if scores is not None:  # float32; another batch sums in another order
                assert scores[0] is None and solo_scores[0] is None, result
                assert scores[1:] == pytest.approx(solo_scores[1:], abs=1e-4), result
        elif kind in ("status-500", "stream-error") and plan_kind == "poison":
            error = result["error"]
            assert_openai_error(error, "engine_error")
            assert "InjectedFault" in error["error"]["message"]
        elif kind in ("status-504", "stream-error") and plan_kind == "deadline":
            assert_openai_error(result["error"], "request_timeout")
        else:
            assert kind == "gone" and plan_kind == "disconnect", result
    # Every poisoned request failed (none slipped through), and plenty completed.
    assert sum(p["kind"] == "poison" for p in plans) == sum(
        k in ("status-500", "stream-error") and r["kind"] == "poison" for k, r in results
    )
    assert outcomes["tokens"] > num_requests // 2
    assert sum(r.get("prompt_logprobs") is not None for _, r in results) > num_requests // 10
    assert health["status"] == "ok" and health["engine"]["kv_blocks_used"] == 0
    growth = rss["end"] - rss["first_third"]
    assert growth < 16 * 1024**2, f"RSS grew by {growth / 1024**2:.1f} MiB: {rss}"


# ------------------------------------------------------------------------------ SIGTERM


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(
    model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    with tiny_server(
        model_dir, log,
        "--num-kv-blocks", "256",
        "--block-size", "4",
        "--max-num-seqs", "2",
        "--drain-timeout", "60",
    ) as server:  # fmt: skip
        prompts = random_prompts(6, seed=3)
        # 3 waves of 2 requests x 300 steps: seconds of work still in flight at SIGTERM.
        long_tokens = 300
        mapped: set[str] = set()  # the server's mapped files, read while it serves

        async def in_flight(http: httpx.AsyncClient, prompt: list[int], stream: bool) -> list[int]:
            payload = {**body(prompt, long_tokens, stream), "ignore_eos": True}
            if not stream:
                r = await http.post("/v1/completions", json=payload)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            async with http.stream("POST", "/v1/completions", json=payload) as r:
                tokens, error = streamed_tokens([line async for line in r.aiter_lines()])
            assert error is None, error
            return tokens

        async def run() -> tuple[list[list[int]], list[httpx.Response], int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                tasks = [
                    asyncio.create_task(in_flight(http, p, stream=i % 2 == 0))
                    for i, p in enumerate(prompts)
                ]
                while (await http.get("/health")).json()["requests"]["in_flight"] < len(prompts):
                    await asyncio.sleep(0.02)
                mapped.update(server.mapped_files())
                server.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                    refused = [
                        await fresh.post("/v1/completions", json=body(prompts[0], 2)),
                        await fresh.get("/health"),
                    ]
                finished = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(server.process.wait, 30)
            return finished, refused, code

        finished, (new_request, health), code = asyncio.run(run())
    assert all(len(tokens) == long_tokens for tokens in finished)
    assert new_request.status_code == 503 and new_request.headers["retry-after"] == "1"
    assert_openai_error(new_request.json(), "server_shutting_down")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert code == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert "SIGTERM: draining 6 in-flight request(s)" in text and "drained" in text
    # The CPU path never loads triton (nothing on it runs a Triton kernel): a loaded
    # extension costs start-up time and memory, and triton's prints a leak report at exit.
    # Unless transformers' own imports load it (5.17's AutoTokenizer imports torch._dynamo,
    # which imports triton wherever it is installed).
    if "libtriton.so" in mapped:
        assert _transformers_loads_triton(), "the CPU server loaded triton's extension"
    assert exit_output(text) == []


def _transformers_loads_triton() -> bool:
    """Whether importing what the server's tokenizer loading imports loads triton here."""
    code = "import sys; from transformers import AutoTokenizer; print('triton' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return run.stdout.strip().endswith("True")


def test_sigterm_exit_is_quiet_with_triton_loaded(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the Triton backend (here under the interpreter, so on the CPU) triton's nanobind
    extension is loaded, and nanobind prints every object of its types still alive when the
    interpreter exits ("nanobind: leaked N instances ..."): after a drain the objects the
    server froze out of the collector (server/cli.py) must be collectable again, or a clean
    stop ends in a screen of those warnings."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the child inherits it, on any machine
    log = tmp_path / "server.log"
    with tiny_server(
        model_dir, log, "--attention-backend", "triton", "--num-kv-blocks", "16"
    ) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=body([10, 11, 12], 3), timeout=60)
        assert r.status_code == 200, r.text
        assert "libtriton.so" in server.mapped_files()  # what this test is about
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(30)
    text = log.read_text()
    assert code == 0, text[-2000:]
    assert exit_output(text) == []
