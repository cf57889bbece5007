"""Schemathesis fuzzing of every route in the server's own OpenAPI schema.

The app (FakeEngine behind the real FastAPI app, middleware and engine thread) runs in real
uvicorn on a thread, so requests cross real sockets and HTTP parsing. For each operation,
schemathesis generates schema-valid bodies (positive) and schema-violating ones (negative),
a bounded number each, and every response must:

* never be a 5xx (``not_a_server_error``): bad input is the client's fault, and the fake
  engine cannot fail;
* have a status and content type the schema documents, and a JSON body matching the schema
  for that status;
* if it is a 4xx, be OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``;
* for negative bodies, be a 4xx.

Afterwards the engine is idle with every KV block free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from loadtest.launcher import free_port
from server.api import create_app
from server.config import ServerConfig, ServingConfig
from server.engine_client import AsyncEngineClient
from tests.server.server_fakes import FakeEngine

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402  (a schemathesis dependency)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
NEAR_VALID_EXAMPLES = 60

# Schema-valid bodies drawn at random are nearly always refused by the value checks (an
# unknown field, n=-7...), so the engine is rarely reached. These strategies stay close to a
# real request (mostly known fields, mostly sane values, edge values mixed in) to drive the
# path through tokenization, the engine and SSE as well.
_SAMPLING = {
    "max_tokens": st.one_of(st.none(), st.integers(-1, 300)),
    "n": st.integers(0, 5),
    "temperature": st.floats(-0.5, 3.0, allow_nan=False),
    "top_p": st.floats(0.0, 1.5, allow_nan=False),
    "top_k": st.integers(-2, 50),
    "seed": st.integers(-1, 2**64),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "presence_penalty": st.floats(-3, 3, allow_nan=False),
    "repetition_penalty": st.floats(0, 2, allow_nan=False),
}
NEAR_VALID = {
    "/v1/completions": st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                st.text(max_size=40),
                st.lists(st.integers(-1, 400), max_size=20),
                st.lists(st.text(max_size=12), max_size=3),
                st.lists(st.lists(st.integers(0, 300), max_size=5), max_size=3),
            )
        },
        optional={**_SAMPLING, "logprobs": st.integers(-1, 6), "echo": st.booleans()},
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["system", "user", "assistant", "developer", "x"]),
                        "content": st.one_of(st.text(max_size=30), st.none()),
                    }
                ),
                max_size=4,
            )
        },
        optional={
            **_SAMPLING,
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(-1, 6),
            "max_completion_tokens": st.one_of(st.none(), st.integers(0, 300)),
        },
    ),
}


class ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, AsyncEngineClient]]:
    engine = FakeEngine(max_model_len=256, num_blocks=4096)
    config = ServingConfig(server=ServerConfig(stats_log_interval_s=0, max_n=4))
    client = AsyncEngineClient(engine, check_integrity=True, idle_wake_s=0.05)
    app = create_app(config, client)
    port = free_port()
    server = ThreadServer(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", client
    server.should_exit = True
    thread.join(10)


def openai_shaped_4xx(response: Any) -> None:
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def fuzz(operation: Any, mode: GenerationMode | None, url: str, counts: dict[str, int]) -> None:
    """Run generated cases of one operation through every check: schemathesis's own in
    ``mode``, or (``mode=None``) the near-valid bodies of ``NEAR_VALID``."""
    session = requests.Session()
    if mode is None:
        cases = NEAR_VALID[operation.path].map(lambda body: operation.Case(body=body))
    else:
        cases = operation.as_strategy(generation_mode=mode)

    @given(case=cases)
    @settings(
        max_examples=EXAMPLES[mode] if mode is not None else NEAR_VALID_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same cases every run: a failure reproduces
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        response = case.call(base_url=url, session=session, timeout=30)
        case.validate_response(
            response,
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
                negative_data_rejection,  # negative cases must get a 4xx
            ],
        )
        openai_shaped_4xx(response)
        key = f"{operation.method.upper()} {operation.path} {response.status_code}"
        counts[key] = counts.get(key, 0) + 1

    try:
        check()
    except Unsatisfiable:
        # No way to break a request that has nothing to send (GET /health).
        assert mode == GenerationMode.NEGATIVE and not operation.body, operation.path


def test_every_route_survives_schemathesis(served: tuple[str, AsyncEngineClient]) -> None:
    url, client = served
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    counts: dict[str, int] = {}
    for operation in operations:
        for mode in EXAMPLES:
            fuzz(operation, mode, url, counts)
        if operation.path in NEAR_VALID:
            fuzz(operation, None, url, counts)
    print("fuzz responses:", dict(sorted(counts.items())))
    # The fuzzing reached the engine, not only the validators.
    assert counts.get("POST /v1/completions 200", 0) > 0
    assert counts.get("POST /v1/chat/completions 200", 0) > 0
    deadline = time.monotonic() + 10
    while client.snapshot.num_requests or client.snapshot.num_used_blocks:
        assert time.monotonic() < deadline, client.snapshot
        time.sleep(0.05)
    assert client.health().healthy
