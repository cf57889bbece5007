"""Data-parallel replicas behind a router, on 127.0.0.1: the router process and the figures
read back from each replica's ``/metrics``.

The router is ``vllm-router`` from PyPI (``pip install vllm-router``; the ``test`` extra
pins it), a Rust binary that polls every worker's ``/health`` and routes by prompt prefix
(``cache_aware``, its default policy). Its own Prometheus listener is put on a free port of
127.0.0.1: its default, 29000, would collide between two routers on one machine.

Used by tests/deploy/test_router.py and benchmarks/replicas.py; deploy/README.md shows the
same router in docker compose and on Kubernetes.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx

from loadtest.launcher import HOST, ServerProcess, free_port
from loadtest.probe import parse_prometheus_text

ROUTER = "vllm-router"
ROUTER_STARTUP_TIMEOUT_S = 60.0


def router_binary() -> str | None:
    """The ``vllm-router`` executable, on PATH or beside this interpreter; None if absent."""
    found = shutil.which(ROUTER)
    if found is not None:
        return found
    sibling = Path(sys.executable).parent / ROUTER
    return str(sibling) if sibling.exists() else None


def router_command(
    binary: str,
    worker_urls: Sequence[str],
    port: int,
    *,
    policy: str = "cache_aware",
    health_check_interval_s: int = 1,
    extra: Iterable[str] = (),
) -> list[str]:
    """The router's argv: ``worker_urls`` behind ``HOST:port`` with ``policy``.

    A worker is marked down after one failed health check and up after one success, so a
    killed replica leaves the rotation within ``health_check_interval_s``. A request the
    router sends it in between fails to connect and is retried; the retries (6 attempts in
    all) back off 0.2, 0.4, 0.8, 1.6, 1.6 s, 4.6 s in all, well over a health-check period,
    so a later one picks a worker after the dead one is out. The router's default backoff
    (tens of milliseconds) spends every retry on the dead worker: ``cache_aware`` keeps
    choosing the replica that holds the prompt's prefix.
    """
    return [
        binary,
        "--host", HOST,
        "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", str(health_check_interval_s),
        "--health-failure-threshold", "1",
        "--health-success-threshold", "1",
        "--retry-max-retries", "6",
        "--retry-initial-backoff-ms", "200",
        "--retry-backoff-multiplier", "2",
        "--retry-max-backoff-ms", "1600",
        "--prometheus-host", HOST,
        "--prometheus-port", str(free_port()),
        "--log-level", "warning",
        *extra,
    ]  # fmt: skip


def start_router(
    worker_urls: Sequence[str],
    log_path: str | Path,
    *,
    policy: str = "cache_aware",
    binary: str | None = None,
) -> ServerProcess:
    """Start the router in front of healthy ``worker_urls``; return it once it answers.

    The router itself waits until every worker is healthy before it listens.

    Raises:
        FileNotFoundError: no ``vllm-router`` is installed.
        RuntimeError: it exited or did not come up (its log tail is in the message).
    """
    binary = binary or router_binary()
    if binary is None:
        raise FileNotFoundError(f"{ROUTER} is not installed (pip install {ROUTER})")
    port = free_port()
    argv = router_command(binary, worker_urls, port, policy=policy)
    process = ServerProcess(argv, port, log_path)
    process.start_healthy(ROUTER_STARTUP_TIMEOUT_S, grace_s=5)
    return process


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """A server's ``/metrics`` as ``{sample name: value}``, summed over label sets."""
    text = httpx.get(f"{base_url}/metrics", timeout=timeout_s, trust_env=False).text
    values: dict[str, float] = {}
    for key, value in parse_prometheus_text(text).items():
        name = key.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + value
    return values


def finished_requests(metrics: dict[str, float]) -> float:
    """Engine requests a replica finished, however they ended."""
    return metrics.get("pagedserve_requests_finished_total", 0.0)


def prefix_cache_hits(metrics: dict[str, float]) -> float:
    """Prompt tokens a replica found in its prefix cache (the router-facing vLLM name)."""
    return metrics.get("vllm:prefix_cache_hits_total", 0.0)
