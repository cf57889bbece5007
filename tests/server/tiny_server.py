"""A real `python -m server` subprocess serving a tiny random Llama, for fault and load tests.

The model is the 2-layer random Llama of tests/engine/conftest.py with the byte-level BPE
tokenizer of server_fakes.py saved beside it, so the server loads it like any HF directory
(config.json, safetensors, tokenizer files) and serves text and token-id prompts, with
steps of a few milliseconds on one CPU thread. Everything between HTTP and the model is the
real thing: uvicorn, the engine thread, scheduler, KV pool, detokenizer.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.launcher import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120


def make_tiny_model_dir(path: Path, seed: int = 0) -> Path:
    """The tiny random Llama plus the test tokenizer, as an HF directory."""
    from tests.engine.conftest import make_tiny_llama
    from tests.server.server_fakes import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    make_tiny_llama(
        path,
        num_kv_heads=2,
        seed=seed,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(path)
    return path


class TinyServer:
    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.process = process
        self.log = log

    def health(self) -> tuple[int, dict[str, Any]]:
        r = httpx.get(f"{self.url}/health", timeout=10)
        return r.status_code, r.json()

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def mapped_files(self) -> set[str]:
        """Names of the files mapped into the server process (its shared objects; Linux)."""
        maps = Path(f"/proc/{self.process.pid}/maps").read_text().splitlines()
        return {Path(fields[5]).name for fields in map(str.split, maps) if len(fields) >= 6}

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """Wait until no request is left, every KV block is free, and the engine's
        check_integrity() passed after its last step; return the health body."""
        deadline = time.monotonic() + timeout_s
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            _, body = self.health()
            engine = body["engine"]
            if (
                engine["num_requests"] == 0
                and engine["kv_blocks_used"] == 0
                and body["requests"]["in_flight"] == 0
                and engine["integrity_checked_at_step"] == engine["num_steps"]
            ):
                return body
            time.sleep(0.05)
        raise AssertionError(f"server not idle after {timeout_s}s: {body}")


def exit_output(log_text: str) -> list[str]:
    """What the server printed after uvicorn's last line ("Finished server process [pid]"):
    at-exit output such as an extension's leak report. Nothing, after a clean stop."""
    lines = log_text.splitlines()
    last = max(
        (i for i, line in enumerate(lines) if "Finished server process" in line), default=None
    )
    assert last is not None, f"uvicorn never finished: {log_text[-2000:]}"
    return lines[last + 1 :]


def server_argv(module: str, model: Path, port: int, *args: str) -> list[str]:
    """``python -m <module>`` serving ``model`` in float32 on the CPU at 127.0.0.1:``port``,
    with no periodic stats lines, then ``args``."""
    return [
        sys.executable, "-m", module,
        "--model", str(model),
        "--device", "cpu",
        "--dtype", "float32",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--stats-log-interval", "0",
        *args,
    ]  # fmt: skip


@contextlib.contextmanager
def tiny_server(
    model_dir: Path,
    log: Path,
    *args: str,
    module: str = "server",
    wrapper: Sequence[str] = (),
) -> Iterator[TinyServer]:
    """Start ``python -m <module>`` (the server, or a test entry point that wraps it, such as
    tests.server.fault_server) on a free port with ``args`` added; stop it (SIGKILL if needed).
    ``wrapper`` goes before the command (e.g. ``prlimit --nofile=200:200 --``).
    """
    port = free_port()
    argv = [*wrapper, *server_argv(module, model_dir, port, *args)]
    # One torch thread: see real_server.py (oversubscribed cores make steps many times slower).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    server = ServerProcess(argv, port, log, env=env, cwd=REPO)
    server.start()
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        yield TinyServer(server.base_url, server.process, log)
    finally:
        server.stop(grace_s=20)
