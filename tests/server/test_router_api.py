"""What data-parallel routers read from a worker (FakeEngine, no sockets): the vLLM-named
gauges, /get_server_info, /get_model_info, /get_load, /health_generate, and the sampling
fields routers add to every request. The real vllm-router in front of real replicas is
tests/deploy/test_router.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import StepStats
from server.config import ServingConfig
from server.metrics import ServerMetrics
from server.router_fields import ROUTER_NEUTRAL_FIELDS, neutral_router_fields
from tests.server.server_fakes import FakeEngine

# The bodies vllm-router 0.1.17 forwarded for a client's plain completion and chat request
# (recorded from a worker that logs what it receives; deploy/README.md).
VLLM_ROUTER_COMPLETION = {
    "prompt": "hello there",
    "max_tokens": 3,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
SGLANG_ROUTER_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "logprobs": False,
    "max_completion_tokens": 3,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def series(text: str) -> dict[str, float]:
    """``{sample name: value}`` summed over label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def labels_of(text: str, name: str) -> dict[str, str]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return dict(s.labels)
    raise KeyError(name)


def test_vllm_named_series_follow_the_pagedserve_ones() -> None:
    metrics = ServerMetrics("m", info={"block_size": "16"}, num_kv_blocks=200)
    for step in (
        StepStats(0.01, num_running=3, num_waiting=2, num_prefill_tokens=64,
                  num_decode_tokens=1, num_preemptions=0, num_kv_blocks_used=50,
                  num_kv_blocks_total=200, prefix_cache_queries=64, prefix_cache_hits=48),
        StepStats(0.01, num_running=5, num_waiting=1, num_prefill_tokens=32,
                  num_decode_tokens=3, num_preemptions=0, num_kv_blocks_used=70,
                  num_kv_blocks_total=200, prefix_cache_queries=32, prefix_cache_hits=16),
    ):  # fmt: skip
        metrics.record_step(step)
    text, _ = metrics.exposition(None)
    got = series(text.decode())
    assert got["vllm:num_requests_running"] == got["pagedserve_num_requests_running"] == 5
    assert got["vllm:num_requests_waiting"] == got["pagedserve_num_requests_waiting"] == 1
    assert got["vllm:kv_cache_usage_perc"] == got["pagedserve_kv_cache_usage_ratio"] == 0.35
    assert got["vllm:gpu_cache_usage_perc"] == 0.35
    assert got["vllm:prefix_cache_queries_total"] == 96
    assert got["vllm:prefix_cache_hits_total"] == got["pagedserve_prefix_cache_hits_total"] == 64
    assert got["vllm:gpu_prefix_cache_queries_total"] == 96
    assert got["vllm:gpu_prefix_cache_hits_total"] == 64
    assert labels_of(text.decode(), "vllm:cache_config_info") == {
        "block_size": "16",
        "num_gpu_blocks": "200",
    }


def test_no_vllm_metrics_flag() -> None:
    assert ServingConfig.from_cli(["--no-vllm-metrics"], {}).server.vllm_metric_names is False
    assert ServingConfig.from_cli([], {}).server.vllm_metric_names is True
    env = {"PAGEDSERVE_NO_VLLM_METRICS": "true"}
    assert ServingConfig.from_cli([], env).server.vllm_metric_names is False
    text, _ = ServerMetrics("m", vllm_names=False).exposition(None)
    assert "vllm:" not in text.decode()


async def test_app_serves_vllm_names_unless_turned_off(serve) -> None:
    s = await serve()
    await s.http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    await s.wait_idle()
    got = series((await s.http.get("/metrics")).text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert name in got, name
    off = await serve(vllm_metric_names=False)
    assert "vllm:" not in (await off.http.get("/metrics")).text


async def test_server_and_model_info(serve) -> None:
    s = await serve()
    info = (await s.http.get("/get_server_info")).json()
    assert info == (await s.http.get("/server_info")).json()
    assert info["served_model_name"] == "fake-model"
    assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["max_model_len"] == 256
    assert info["num_kv_blocks"] == 64
    assert info["batching"] == "continuous"
    model = (await s.http.get("/get_model_info")).json()
    assert model == (await s.http.get("/model_info")).json()
    assert model["served_model_name"] == "fake-model" and model["is_generation"] is True
    assert model["vocab_size"] == len(s.engine.tokenizer)


async def test_get_load_counts_requests_and_kv_tokens(serve) -> None:
    s = await serve(engine=FakeEngine(step_delay_s=0.02))
    assert (await s.http.get("/get_load")).json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    # While a request runs it counts, and its blocks count as KV tokens (block size 16).
    body = {"prompt": "a b c", "max_tokens": 60}
    task = asyncio.create_task(s.http.post("/v1/completions", json=body))
    deadline = time.monotonic() + 5
    load = {}
    while time.monotonic() < deadline:
        load = (await s.http.get("/get_load")).json()[0]
        if load["num_reqs"] == 1 and load["num_tokens"] > 0:
            break
        await asyncio.sleep(0.01)
    assert load["num_reqs"] == 1 and load["num_tokens"] % 16 == 0 and load["num_tokens"] > 0
    assert 0 <= load["num_waiting_reqs"] <= 1
    assert (await task).status_code == 200
    await s.wait_idle()
    assert (await s.http.get("/get_load")).json()[0]["num_reqs"] == 0


async def test_health_generate(serve) -> None:
    s = await serve()
    r = await s.http.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert len(s.engine.added) == 1  # one engine request went through
    await s.wait_idle()
    # A step that fails under the probe's request: 503 with the engine's reason, not a hang
    # (the engine itself keeps serving: fault isolation).
    s.engine.fail_next_step = RuntimeError("boom")
    r = await s.http.get("/health_generate")
    assert r.status_code == 503
    assert r.json()["status"] == "unhealthy" and "boom" in r.json()["reason"]
    assert (await s.http.get("/health_generate")).status_code == 200


async def test_router_added_fields_at_their_neutral_values_are_accepted(serve) -> None:
    s = await serve()
    r = await s.http.post("/v1/completions", json=VLLM_ROUTER_COMPLETION)
    assert r.status_code == 200, r.text
    r = await s.http.post("/v1/chat/completions", json=SGLANG_ROUTER_CHAT)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", sorted(ROUTER_NEUTRAL_FIELDS))
async def test_router_fields_with_another_value_are_still_unknown(serve, field: str) -> None:
    s = await serve()
    body = {"prompt": "a", "max_tokens": 1, field: not ROUTER_NEUTRAL_FIELDS[field]}
    r = await s.http.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field


def test_neutral_fields_compare_booleans_by_identity() -> None:
    assert neutral_router_fields({"return_hidden_states": False}) == {"return_hidden_states"}
    assert neutral_router_fields({"return_hidden_states": 0}) == set()
    assert neutral_router_fields({"no_stop_trim": 0}) == set()
    assert neutral_router_fields(None) == set()


async def test_render_gives_the_tokens_the_request_will_be_prefilled_with(serve) -> None:
    s = await serve()
    tokenized = (await s.http.post("/tokenize", json={"prompt": "hello there"})).json()
    r = await s.http.post("/v1/completions/render", json=VLLM_ROUTER_COMPLETION)
    assert r.status_code == 200, r.text
    [entry] = r.json()
    assert entry["token_ids"] == tokenized["tokens"]
    assert entry["model"] == "fake-model" and entry["request_id"].startswith("cmpl-")
    assert entry["sampling_params"]["max_tokens"] == 3
    assert "argmax_only" not in entry["sampling_params"]  # derived, not a parameter
    assert entry["sampling_params"]["stop"] == []
    # Two prompts: one entry each.
    two = {"prompt": ["a", "b c"], "max_tokens": 2, "stop": "x"}
    entries = (await s.http.post("/v1/completions/render", json=two)).json()
    assert [e["sampling_params"]["stop"] for e in entries] == [["x"], ["x"]]
    assert len(entries) == 2
    # Chat: the templated prompt, as /tokenize renders it.
    chat_tokens = (
        await s.http.post("/tokenize", json={"messages": SGLANG_ROUTER_CHAT["messages"]})
    ).json()["tokens"]
    r = await s.http.post("/v1/chat/completions/render", json=SGLANG_ROUTER_CHAT)
    assert r.status_code == 200, r.text
    assert r.json()[0]["token_ids"] == chat_tokens
    # Nothing was submitted to the engine, and a bad body gets the endpoint's own 400.
    assert s.engine.added == []
    bad = await s.http.post("/v1/completions/render", json={"prompt": "a", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
