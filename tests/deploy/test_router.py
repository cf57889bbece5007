"""Two pagedserve replicas behind a real ``vllm-router`` on 127.0.0.1.

Each replica is a real ``python -m server`` on the tiny random Llama (one CPU thread); the
router is the PyPI ``vllm-router`` binary with its default ``cache_aware`` policy. The test
sends requests through the router and reads where they went from each replica's
``/metrics``: finished requests and the ``vllm:prefix_cache_hits_total`` counter. Requests
are sent one at a time (but for one that streams while another is routed) so the
per-replica deltas between two scrapes belong to one request.

The module starts three processes once (~10 s on a quiet 2-core machine) and sends a few
dozen short requests.
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
# A's first request streams this long (its prompt is 357 tokens of the 512 the model takes),
# long enough to see it running on one replica.
A_FIRST_TOKENS = 128


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


def _where(before: list[Scrape], after: list[Scrape]) -> int:
    """The one replica that finished exactly one request between two scrapes."""
    finished = _per_replica(before, after, finished_requests)
    assert sorted(finished) == [0, 1], f"requests finished per replica: {finished}"
    return finished.index(1)


def test_requests_sharing_a_prefix_land_on_one_replica(replicas: Replicas) -> None:
    """vllm-router's cache_aware policy, as it is in 0.1.17: a prompt whose prefix matches
    more than ``--cache-threshold`` (0.3) of the router's radix tree goes to the replica that
    the tree holds it for; a prompt that matches nothing goes where the router's balance
    rule sends it.

    1. A's first request streams a long answer from one replica, X. Then B's first
       request matches nothing in the tree and goes to the replica Y that the router's rule
       for a miss picks (either one is accepted: which it picks is the router's business).
    2. Then A, A, B, B, A, B, one at a time: each group must stay on its first request's
       replica, which serves every later request of the group from its prefix cache.

    Round robin fails step 2: it sends the two A's in a row (and the two B's) to different
    replicas. Random placement passes it with probability 2**-6.
    """
    a_first = f"{PREFIX_A} question 0:"
    body = {"model": replicas.model, "prompt": a_first, "max_tokens": A_FIRST_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    # X is the replica that finished A: a scrape while A streams could come after its last
    # token on a loaded machine (128 tokens of the tiny model take a fraction of a second).
    before = replicas.scrape_all()
    with replicas.http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        assert sum(line.startswith("data: {") for line in stream.iter_lines()) > 1
    x = _where(before, replicas.scrape_all())
    before = replicas.scrape_all()
    r = replicas.complete(f"{PREFIX_B} question 0:")
    assert r.status_code == 200, r.text
    placement = {"A": x, "B": _where(before, replicas.scrape_all())}

    counts = {"A": 1, "B": 1}
    for group in "AABBAB":
        before = replicas.scrape_all()
        prefix = PREFIX_A if group == "A" else PREFIX_B
        r = replicas.complete(f"{prefix} question {counts[group]}:")
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        after = replicas.scrape_all()
        target = placement[group]
        where = _where(before, after)
        assert where == target, (
            f"{group} request {counts[group]} went to replica {where}, its group's is {target}"
        )
        # Served from that replica's prefix cache: the prefix's full blocks (at least 20 of
        # 16 tokens) were hits there, and nothing was looked up on the other.
        hits = _per_replica(before, after, prefix_cache_hits)
        assert hits[1 - target] == 0, hits
        assert hits[target] >= 20 * BLOCK_SIZE, hits
        counts[group] += 1


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
