"""The real server for tests/server/test_integration.py: `python -m server` in a subprocess on
127.0.0.1, serving the embedded default model, and the helpers its tests call it with (the
official `openai` clients, the offline engine run on one prompt alone). The test module holds
the session fixtures, so the server starts once per session.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from engine import LLM, SamplingParams
from loadtest.launcher import HOST, ServerProcess, free_port
from tests.server.test_errors import MAX_BODY

MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 128  # 2048 token slots: room for the 32 concurrent requests below
STARTUP_TIMEOUT_S = 300  # the first start converts the GGUF (tens of seconds); later ones load
WORDS = (
    "the history of science shows that careful measurement and honest reporting "
    "matter more than any single clever idea because"
).split()


class RealServer:
    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_pool_free(self, timeout_s: float = 10.0) -> float:
        """Seconds until no request is left and every KV block is free again."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            engine = self.health()["engine"]
            if engine["num_requests"] == 0 and engine["kv_blocks_used"] == 0:
                return time.monotonic() - start
            time.sleep(0.05)
        raise AssertionError(f"KV pool not free after {timeout_s}s: {self.health()}")


@contextlib.contextmanager
def running_server(log: Path) -> Iterator[RealServer]:
    """`python -m server` on a free port of 127.0.0.1, its output in `log`, until healthy;
    stopped on exit (loadtest/launcher.py's ServerProcess)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "server",
        "--host", HOST,
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        # float32 on the CPU on any machine: the offline reference it is compared with runs
        # there too (tests/server/test_integration.py), under the float32 near-tie rule.
        "--device", "cpu", "--dtype", "float32",
        "--max-num-seqs", "32",
        "--max-body-size", str(MAX_BODY),
        "--stats-log-interval", "0",
        "--log-level", "info",
    ]  # fmt: skip
    # One torch thread: on a small shared CPU box, torch's default (one thread per core)
    # oversubscribes the cores with this test process and others, and OpenMP spin-waiting then
    # makes every step many times slower. The server's behaviour under test does not depend on it.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with ServerProcess(argv, port, log, env=env) as process:
        process.wait_healthy(STARTUP_TIMEOUT_S)
        yield RealServer(process.base_url, log)


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run reference computations single-threaded (see the server fixture), then restore the
    process-wide setting so other test folders in the same session are unaffected."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def alone(llm: LLM, prompt: str, params: SamplingParams) -> Any:
    with torch_threads(1):
        (out,) = llm.generate([prompt], params)
    return out


def sync_client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def async_client(server: RealServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
