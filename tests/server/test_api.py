"""The small routes: /v1/models, /health, /version, /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from server.protocol import ModelList
from tests.server.server_fakes import FakeEngine, tiny_tokenizer


async def test_models_lists_the_served_name(serve) -> None:
    s = await serve(served_model_name="my-model")
    body = (await s.http.get("/v1/models")).json()
    ModelList.model_validate(body)
    assert [m["id"] for m in body["data"]] == ["my-model"]
    assert body["data"][0]["max_model_len"] == 256
    r = await s.http.post(
        "/v1/completions", json={"model": "my-model", "prompt": "hi", "max_tokens": 1}
    )
    assert r.status_code == 200 and r.json()["model"] == "my-model"
    r = await s.http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_the_official_client_retrieves_the_model_and_gets_404_for_another(serve) -> None:
    s = await serve(served_model_name="org/my-model")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=s.http)
    card = await client.models.retrieve("org/my-model")
    assert (card.id, card.object, card.owned_by) == ("org/my-model", "model", "pagedserve")
    assert card.model_dump()["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("gpt-4")
    assert caught.value.status_code == 404
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found", error
    assert "gpt-4" in error["message"] and error["param"] == "model"


async def test_health_reports_the_kv_pool(serve) -> None:
    s = await serve(FakeEngine(step_delay_s=0.01))
    r = await s.http.get("/health")
    assert r.status_code == 200
    engine = r.json()["engine"]
    assert engine["kv_blocks_total"] == 64 and engine["kv_blocks_used"] == 0
    task = asyncio.create_task(
        s.http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 30})
    )
    await asyncio.sleep(0.1)
    busy = (await s.http.get("/health")).json()["engine"]
    assert busy["kv_blocks_used"] > 0 and busy["num_requests"] == 1
    assert busy["kv_blocks_used"] + busy["kv_blocks_free"] == busy["kv_blocks_total"]
    await task
    await s.wait_idle()
    assert (await s.http.get("/health")).json()["engine"]["kv_blocks_used"] == 0


async def test_health_reports_the_kv_cache_size(serve) -> None:
    s = await serve(FakeEngine(num_blocks=64, block_size=4))
    kv = (await s.http.get("/health")).json()["kv_cache"]
    # FakeEngine's pool: float32 ("auto"), 2 layers x 1 KV head x 64 dims, K and V
    assert kv == {
        "dtype": "auto",
        "num_tokens": 256,
        "bytes_per_token": 1024,
        "total_bytes": 256 * 1024,
    }


async def test_health_is_503_while_the_engine_is_stuck(serve) -> None:
    engine = FakeEngine()
    release = threading.Event()
    engine.before_step = lambda e: release.wait(5)
    s = await serve(engine, engine_stall_timeout_s=0.2)
    task = asyncio.create_task(s.http.post("/v1/completions", json={"prompt": "hi"}))
    await asyncio.sleep(0.4)
    r = await s.http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unhealthy"
    # new requests are refused at once with a 503 instead of queueing behind the stall
    refused = await s.http.post("/v1/completions", json={"prompt": "hi"})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    engine.before_step = None
    release.set()
    assert (await task).status_code == 200
    assert (await s.http.get("/health")).status_code == 200


async def test_version(serve) -> None:
    s = await serve()
    assert (await s.http.get("/version")).json()["version"]


async def test_tokenize_and_detokenize_roundtrip(serve) -> None:
    s = await serve()
    tok = tiny_tokenizer()
    r = (await s.http.post("/tokenize", json={"prompt": "héllo 日本"})).json()
    assert r["tokens"] == tok.encode("héllo 日本") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    back = (await s.http.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert back == {"prompt": "héllo 日本"}


async def test_tokenize_messages_matches_the_chat_route(serve) -> None:
    s = await serve()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tokens = (await s.http.post("/tokenize", json={"messages": messages})).json()["tokens"]
    chat = (
        await s.http.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 1, "return_token_ids": True},
        )
    ).json()
    assert chat["choices"][0]["prompt_token_ids"] == tokens
    assert chat["usage"]["prompt_tokens"] == len(tokens)


async def test_openapi_schema_documents_the_routes(serve) -> None:
    s = await serve()
    paths = (await s.http.get("/openapi.json")).json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/health",
        "/tokenize",
        "/detokenize",
        "/version",
    ):
        assert path in paths


async def test_tokenize_returns_token_strings_when_asked(serve) -> None:
    s = await serve()
    tok = s.engine.tokenizer
    r = await s.http.post("/tokenize", json={"prompt": "the quick", "return_token_strs": True})
    body = r.json()
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    plain = (await s.http.post("/tokenize", json={"prompt": "the quick"})).json()
    assert "token_strs" not in plain and plain["tokens"] == body["tokens"]
