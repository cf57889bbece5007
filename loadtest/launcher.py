"""Start a server as a subprocess on 127.0.0.1, wait until it is healthy, stop it.

Used by ``compare``. The server command is a template so any OpenAI-compatible server can be
launched; placeholders are filled with ``str.format`` and the result is split with ``shlex``
(no shell is involved). The child gets its own process group so that stopping it also stops
any workers it spawned, and only that group is signalled.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

HOST = "127.0.0.1"  # compare only ever talks to this machine


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_command(template: str, **values: object) -> list[str]:
    """Fill ``template``'s ``{placeholders}`` and split it into argv.

    A bare ``pagedserve`` is resolved next to the running interpreter when it is not on PATH,
    so ``.venv/bin/python -m loadtest compare`` works without activating the virtualenv.
    """
    argv = shlex.split(template.format(**values))
    if not argv:
        raise ValueError("empty server command")
    if shutil.which(argv[0]) is None:
        sibling = Path(sys.executable).parent / argv[0]
        if sibling.exists():
            argv[0] = str(sibling)
    return argv


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already


class ServerProcess:
    """A server subprocess with its output in a log file.

    Args:
        argv: the command.
        port: the port it was told to listen on (on 127.0.0.1).
        log_path: where its stdout and stderr go.
        env: the child's environment (default: this process's).
        cwd: the child's working directory (default: this process's).
    """

    def __init__(
        self,
        argv: list[str],
        port: int,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.argv = argv
        self.port = port
        self.base_url = f"http://{HOST}:{port}"
        self.log_path = Path(log_path)
        self.env = env
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The running child (after ``start()``), for callers that signal or wait on it."""
        assert self._proc is not None, "start() first"
        return self._proc

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # The child keeps its own copy of the file descriptor after we close ours.
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
                cwd=self.cwd,
            )

    def start_healthy(self, timeout_s: float, grace_s: float = 10.0) -> float:
        """``start()`` and ``wait_healthy()``; a child that does not come up is stopped
        (``stop(grace_s)``) before the error propagates, so no caller leaks it.

        Returns:
            Seconds it took to become healthy.
        """
        self.start()
        try:
            return self.wait_healthy(timeout_s)
        except BaseException:
            self.stop(grace_s=grace_s)
            raise

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``GET /health`` until it answers 200.

        Returns:
            Seconds it took.

        Raises:
            RuntimeError: the process exited, or ``timeout_s`` passed (the log tail is included).
        """
        assert self._proc is not None, "start() first"
        start = time.monotonic()
        with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as http:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"server exited with code {code} during start-up: {self.argv}\n"
                        f"{self.log_tail()}"
                    )
                try:
                    if http.get("/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(
                        f"server not healthy after {timeout_s:.0f}s: {self.argv}\n{self.log_tail()}"
                    )
                time.sleep(0.25)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, then SIGKILL it after ``grace_s``."""
        proc = self._proc
        if proc is None:
            return None
        # NOTE: the child leads its own session (start_new_session), so its pgid is its pid.
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10.0)
        # Workers the server spawned may outlive it; the group id stays reserved while any
        # member lives, so this reaches only them.
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.returncode

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
