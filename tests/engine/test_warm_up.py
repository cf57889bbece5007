"""The engine's warm-up (``LLMEngine.warm_up``, run at the end of construction on CUDA),
driven on CPU: it leaves no request behind, nothing of it in what the server exposes, and
the tokens served after it are the ones an engine without it serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.presets import preset, write_synthetic_tokenizer
from loadtest.probe import parse_prometheus_text
from server.api import create_app
from server.config import ServerConfig, ServingConfig
from server.engine_client import AsyncEngineClient

# Prompts of 1 to 64 tokens: every length the warm-up's kernels specialise on up to a few
# blocks, without the minutes a full step budget's prompt takes on a busy CPU.
WARM_UP_TOKENS = 64
M = '{model_name="tiny-llama"}'


def _tiny(**kwargs: object) -> LLM:
    return LLM("tiny-llama", load_format="dummy", device="cpu", **kwargs)  # type: ignore[arg-type]


def test_warm_up_leaves_no_request_and_an_empty_cache_and_the_same_greedy_tokens() -> None:
    cold, warm = _tiny(), _tiny()
    engine = warm.engine
    engine.warm_up(WARM_UP_TOKENS)
    assert not engine.has_unfinished_requests() and engine.num_unfinished_requests == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.check_integrity()
    kv = engine.kv_manager.stats()
    assert kv.num_used_blocks == 0 and engine.num_free_blocks == engine.num_total_blocks
    # Its prompts are nobody's prefix: dropped from the cache, the counters start again.
    assert kv.num_cached_blocks == kv.num_evictable_blocks == 0
    assert kv.prefix_cache_queries == kv.prefix_cache_hits == kv.num_evictions == 0
    assert engine.last_step_stats is None

    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 40, 17))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    assert [o.token_ids for o in warm.generate(prompts, params)] == expected
    assert engine.kv_manager.stats().prefix_cache_queries == sum(len(p) for p in prompts)


def test_metrics_after_warm_up_count_served_requests_only(tmp_path: Path) -> None:
    """What a user sees in ``/metrics``: request and token counters, prefix-cache counters
    and the cached-block gauges, before and after one request."""
    tokenizer = write_synthetic_tokenizer(preset("tiny-llama"), tmp_path)
    engine = LLMEngine(
        EngineConfig(
            model="tiny-llama", load_format="dummy", device="cpu", tokenizer=str(tokenizer)
        )
    )
    engine.warm_up(WARM_UP_TOKENS)
    prompt = " ".join(["the"] * 40)  # 40 tokens: two full blocks of 16

    async def scrape_around_one_request() -> tuple[dict[str, float], dict[str, float], dict]:
        client = AsyncEngineClient(engine, check_integrity=True, idle_wake_s=0.05)
        app = create_app(ServingConfig(server=ServerConfig(stats_log_interval_s=0)), client)
        client.start()
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                before = parse_prometheus_text((await http.get("/metrics")).text)
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4}
                usage = (await http.post("/v1/completions", json=body, timeout=60)).json()["usage"]
                after = parse_prometheus_text((await http.get("/metrics")).text)
        finally:
            await client.shutdown()
        return before, after, usage

    before, after, usage = asyncio.run(scrape_around_one_request())
    assert usage == {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "preemptions_total", "step_tokens_count",
                 "time_to_first_token_seconds_count"):  # fmt: skip
        assert before[f"pagedserve_{name}{M}"] == 0, name
    finished = '{finished_reason="length",model_name="tiny-llama"}'
    assert before[f"pagedserve_requests_finished_total{finished}"] == 0
    assert after[f"pagedserve_requests_finished_total{finished}"] == 1
    assert after[f"pagedserve_prompt_tokens_total{M}"] == 40
    assert after[f"pagedserve_generation_tokens_total{M}"] == 4
    assert after[f"pagedserve_prefix_cache_queries_total{M}"] == 40
    assert after[f"pagedserve_time_to_first_token_seconds_count{M}"] == 1
    # The request's full blocks only (40 prompt + 3 computed output tokens: 2 blocks).
    assert after[f"pagedserve_kv_blocks_cached{M}"] == 2
    assert after[f"pagedserve_kv_blocks_evictable{M}"] == 2
