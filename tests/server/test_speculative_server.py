"""Speculative decoding through the real server: `python -m server --speculative-method ngram`
(a subprocess on the tiny random Llama and the test tokenizer) answers completions with a
stop string and ``n=2`` as the same app without speculation does.

Greedy choices must be the plain server's, text and finish reason: speculation is exact, and
the stop string is cut by the server from tokens that may have come several to a step (an
accepted run of drafts). Sampled choices with a seed differ from the plain server's (the
rejection sampler draws from other streams), so they are checked for what holds for any
sample: the stop string cut, the same response for the same seed, tokens counted in usage.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kvpool.config import KVPoolConfig
from scheduler.config import SchedulerConfig
from tests.server.conftest import ServeFactory
from tests.server.tiny_server import TinyServer, make_tiny_model_dir, tiny_server

# Repeats, so that the last tokens have earlier matches and n-gram lookups propose drafts.
PROMPT = "one two three four one two three four one two three four one two"
MAX_TOKENS = 24
NUM_KV_BLOCKS = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("spec-http"), seed=3)


@pytest.fixture(scope="module")
def spec_server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    log = tmp_path_factory.mktemp("spec-http-log") / "server.log"
    # Row cost 0: every decoding request proposes k drafts (the acceptance-aware rule would
    # soon pause a random model's mostly wrong ones), so the responses come through
    # verifications.
    with tiny_server(model, log, "--num-kv-blocks", str(NUM_KV_BLOCKS),
                     "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                     "--ngram-min", "1", "--speculative-row-cost", "0") as server:  # fmt: skip
        yield server


def _choices(response: httpx.Response) -> list[tuple[int, str, str]]:
    assert response.status_code == 200, response.text
    return sorted((c["index"], c["text"], c["finish_reason"]) for c in response.json()["choices"])


def _counter(metrics: str, name: str) -> float:
    (value,) = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name)]
    return value


async def test_stop_strings_and_n_through_a_speculating_server(
    spec_server: TinyServer, serve: ServeFactory, model: Path
) -> None:
    scheduler = SchedulerConfig()
    plain = await serve(
        engine=LLMEngine(
            EngineConfig(model=str(model), device="cpu", dtype="float32"),
            KVPoolConfig(num_blocks=NUM_KV_BLOCKS),
            scheduler,
        ),
        scheduler=scheduler,
    )
    base: dict[str, Any] = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    greedy = {**base, "temperature": 0}
    async with httpx.AsyncClient(base_url=spec_server.url, timeout=60) as spec:
        # The greedy text, unstopped: the stop string is a piece from its middle.
        full = _choices(await plain.http.post("/v1/completions", json=greedy))
        assert _choices(await spec.post("/v1/completions", json=greedy)) == full
        [(_, text, _)] = full
        assert len(text) >= 8, f"too little text to cut: {text!r}"
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = text[: text.index(stop)]

        body = {**greedy, "n": 2, "stop": [stop]}
        want = _choices(await plain.http.post("/v1/completions", json=body))
        got = _choices(await spec.post("/v1/completions", json=body))
        assert want == [(0, cut, "stop"), (1, cut, "stop")]
        assert got == want

        sampled = {**base, "n": 2, "stop": [stop], "temperature": 0.9, "seed": 7}
        first = await spec.post("/v1/completions", json=sampled)
        again = await spec.post("/v1/completions", json=sampled)
        assert _choices(first) == _choices(again), "a seeded request is not reproducible"
        for _, sample, reason in _choices(first):
            assert stop not in sample
            assert reason in ("stop", "length")
        assert first.json()["usage"]["completion_tokens"] > 0

        metrics = (await spec.get("/metrics")).text
    drafts = _counter(metrics, "pagedserve_spec_decode_draft_tokens_total")
    accepted = _counter(metrics, "pagedserve_spec_decode_accepted_tokens_total")
    assert drafts > 0 and accepted > 0, "the server did not speculate"
    spec_server.wait_idle()
