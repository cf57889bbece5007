"""Latency targets through the real server: `python -m server --target-itl-ratio 1.5
--target-ttft-ms 2000` (a subprocess on the tiny random Llama and the test tokenizer), called
with the official `openai` client and with curl, as a user would.

Steps are small (32 tokens, a minimum chunk of 4) and the bound tight, so prompts arriving
beside running decodes are cut into chunks the relative bound sizes. Greedy tokens must be
what the offline engine gives each prompt alone (the near-tie rule), and /metrics must show
the targets at work: the relative target's gauge, steps sized by it, their chosen chunks.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine.parity import Reference, assert_parity
from tests.server.tiny_server import TinyServer, make_tiny_model_dir, tiny_server

MAX_TOKENS = 12
PROMPTS = [
    "one two three",
    "four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega",
    "the quick brown fox",
    "jumps over the lazy dog again and again and again until the day is done",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("targets-http"), seed=5)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    log = tmp_path_factory.mktemp("targets-http-log") / "server.log"
    with tiny_server(model, log, "--num-kv-blocks", "64", "--max-num-batched-tokens", "32",
                     "--target-itl-ratio", "1.5", "--target-ttft-ms", "2000",
                     "--min-prefill-chunk-tokens", "4") as server:  # fmt: skip
        yield server


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


async def test_greedy_text_under_the_relative_target_is_each_prompts_alone(
    server: TinyServer, model: Path
) -> None:
    reference = LLM(str(model), device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    alone = [reference.generate([p], params)[0] for p in PROMPTS]
    reference.shutdown()

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    served = (await client.models.list()).data[0].id

    async def complete(prompt: str, delay_s: float) -> tuple[list[int], str]:
        await asyncio.sleep(delay_s)  # later prompts arrive beside running decodes
        response = await client.completions.create(
            model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        choice = response.choices[0]
        return choice.model_extra["token_ids"], choice.text

    got = await asyncio.gather(*(complete(p, 0.02 * i) for i, p in enumerate(PROMPTS)))
    for prompt, (token_ids, text), expected in zip(PROMPTS, got, alone, strict=True):
        # The near-tie rule (tests/engine/parity.py), as for any batch against one alone.
        if assert_parity(token_ids, Reference.from_output(expected), prompt) is None:
            assert text == expected.text, prompt

    # curl, as a user would: the same text for the longest prompt.
    body = {"model": served, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "60", f"{server.url}/v1/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout)["choices"][0]["text"] == alone[2].text

    server.wait_idle()
    metrics = subprocess.run(
        ["curl", "-sS", "--max-time", "30", f"{server.url}/metrics"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert _metric(metrics, "pagedserve_target_itl_ratio") == 1.5
    assert _metric(metrics, "pagedserve_target_ttft_seconds") == 2.0
    # Steps planned beside decodes were sized by the targets, and their chunks recorded.
    assert _metric(metrics, "pagedserve_target_steps_total") > 0
    assert _metric(metrics, "pagedserve_target_prefill_cap_tokens_count") > 0
