"""Two pagedserve replicas behind a real ``vllm-router`` on 127.0.0.1.

Each replica is a real ``python -m server`` on the tiny random Llama (one CPU thread); the
router is the PyPI ``vllm-router`` binary with its default ``cache_aware`` policy. The test
sends requests through the router and reads where they went from each replica's
``/metrics``: finished requests and the ``vllm:prefix_cache_hits_total`` counter. Requests
are sent one at a time so the per-replica deltas belong to one group of requests.

The module starts three processes once (~10 s on a quiet 2-core machine) and sends a few dozen short
requests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.launcher import ServerProcess, free_port
from loadtest.probe import parse_prometheus_text
from loadtest.replicas import (
    finished_requests,
    prefix_cache_hits,
    router_binary,
    scrape,
    start_router,
)
from tests.server.tiny_server import REPO, STARTUP_TIMEOUT_S, make_tiny_model_dir

pytestmark = pytest.mark.skipif(
    router_binary() is None,
    reason="vllm-router is not installed (pip install -e '.[test]' installs it)",
)

BLOCK_SIZE = 16
# Two long prefixes that share nothing: ~25 full KV blocks of the byte-level tokenizer each.
PREFIX_A = "Replica routing test, document A. " * 12
PREFIX_B = "Completely different text for B! " * 12
REQUESTS_PER_GROUP = 4


class Replicas:
    def __init__(self, servers: list[ServerProcess], router: ServerProcess) -> None:
        self.servers = servers
        self.router = router
        self.http = httpx.Client(base_url=router.base_url, timeout=60, trust_env=False)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def complete(self, prompt: str) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        return self.http.post("/v1/completions", json=body)

    def scrape_all(self) -> list[dict[str, float]]:
        return [scrape(s.base_url) for s in self.servers]


@contextlib.contextmanager
def replica_set(tmp: Path) -> Iterator[Replicas]:
    model_dir = make_tiny_model_dir(tmp / "model")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    servers = []
    for i in range(2):
        port = free_port()
        argv = [
            sys.executable, "-m", "server",
            "--model", str(model_dir),
            "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port),
            "--num-threads", "1",
            "--block-size", str(BLOCK_SIZE),
            "--num-kv-blocks", "256",
            "--stats-log-interval", "0",
        ]  # fmt: skip
        servers.append(ServerProcess(argv, port, tmp / f"replica{i}.log", env=env, cwd=REPO))
    router: ServerProcess | None = None
    try:
        for server in servers:  # both load at once
            server.start()
        for server in servers:
            server.wait_healthy(STARTUP_TIMEOUT_S)
        router = start_router([s.base_url for s in servers], tmp / "router.log")
        replicas = Replicas(servers, router)
        try:
            yield replicas
        finally:
            replicas.http.close()
    finally:
        if router is not None:
            router.stop(grace_s=5)
        for server in servers:
            server.stop(grace_s=10)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    with replica_set(tmp_path_factory.mktemp("replicas")) as r:
        yield r


Scrape = dict[str, float]


def _per_replica(
    before: list[Scrape], after: list[Scrape], read: Callable[[Scrape], float]
) -> list[float]:
    return [read(a) - read(b) for b, a in zip(before, after, strict=True)]


def test_replicas_expose_router_endpoints_and_vllm_gauges(replicas: Replicas) -> None:
    for server in replicas.servers:
        metrics = scrape(server.base_url)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total",
        ):
            assert name in metrics, name
        load = httpx.get(f"{server.base_url}/get_load", timeout=10).json()
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] >= 0
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
        assert info["served_model_name"] == replicas.model and info["block_size"] == BLOCK_SIZE
    # The router proxies the model list and server info from its workers.
    assert replicas.http.get("/v1/models").status_code == 200
    assert replicas.http.get("/get_server_info").status_code == 200


def test_the_router_renders_prompts_on_the_replicas(replicas: Replicas) -> None:
    # vllm-router asks each worker's renderer for the prompt's token ids before routing; it
    # gets them (200), so it never falls back to /tokenize, and no route answers 404.
    r = replicas.complete("render me:")
    assert r.status_code == 200, r.text
    renders = tokenizes = not_found = 0.0
    for server in replicas.servers:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        for key, value in parse_prometheus_text(text).items():
            if not key.startswith("pagedserve_http_requests_total{"):
                continue
            renders += value if 'handler="/v1/completions/render",' in key else 0
            tokenizes += value if 'handler="/tokenize"' in key else 0
            not_found += value if 'status="404"' in key else 0
    assert renders >= 1 and tokenizes == 0 and not_found == 0


def test_requests_sharing_a_prefix_land_on_one_replica(replicas: Replicas) -> None:
    # Where a prefix matching nothing cached goes is the router's choice (vllm-router 0.1.17
    # takes the least loaded worker, the first on a tie, so sequential requests may all land
    # on one replica); only that a group stays together is checked.
    for prefix in (PREFIX_A, PREFIX_B):
        before = replicas.scrape_all()
        for i in range(REQUESTS_PER_GROUP):
            r = replicas.complete(f"{prefix} question {i}:")
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
        after = replicas.scrape_all()
        finished = _per_replica(before, after, finished_requests)
        hits = _per_replica(before, after, prefix_cache_hits)
        # Every request of the group went to one replica...
        assert sorted(finished) == [0, REQUESTS_PER_GROUP], (prefix[:20], finished)
        target = finished.index(REQUESTS_PER_GROUP)
        # ...which served all but the first from its prefix cache: the prefix's full blocks
        # (at least 20 of 16 tokens) were hits for each of the others, and none elsewhere.
        assert hits[1 - target] == 0, hits
        assert hits[target] >= (REQUESTS_PER_GROUP - 1) * 20 * BLOCK_SIZE, hits


def test_a_killed_replica_is_routed_around(replicas: Replicas) -> None:
    # Runs last in the module: it kills a replica.
    before = replicas.scrape_all()
    r = replicas.complete(f"{PREFIX_A} before the kill:")
    assert r.status_code == 200, r.text
    after = replicas.scrape_all()
    # Kill the replica that holds PREFIX_A, the one cache_aware prefers for it.
    victim = _per_replica(before, after, finished_requests).index(1)
    survivor = replicas.servers[1 - victim]
    os.killpg(replicas.servers[victim].process.pid, signal.SIGKILL)
    replicas.servers[victim].process.wait(timeout=10)

    survivor_before = finished_requests(scrape(survivor.base_url))
    start = time.monotonic()
    num = 6
    for i in range(num):
        r = replicas.complete(f"{PREFIX_A} after the kill {i}:")
        assert r.status_code == 200, (i, r.status_code, r.text)
    elapsed = time.monotonic() - start
    assert finished_requests(scrape(survivor.base_url)) - survivor_before == num
    # Retries and the 1 s health check, not a client timeout, took the dead replica out.
    assert elapsed < 30, elapsed
