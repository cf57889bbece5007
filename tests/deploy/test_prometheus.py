"""The real server scraped by a real Prometheus with the project's own scrape config, and every
PromQL expression of the Grafana dashboard evaluated through Prometheus' HTTP API.

Prometheus is Debian's ``prometheus`` package (``apt-get install -y prometheus``); the test
skips when the binary is absent. The server is ``python -m server`` on the embedded default
model. Order matters: Prometheus scrapes the idle server first (the counters' baseline, so
``rate()`` sees the traffic), then the traffic runs, then the queries.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.launcher import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "pagedserve.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")
MODEL = "SmolLM2-135M-Instruct"
NUM_KV_BLOCKS = 64
STARTUP_TIMEOUT_S = 300  # the first start on a machine converts the GGUF
# Long enough to span the whole test, so every rate() sees the traffic.
RATE_WINDOW = "10m"
PROMPT = (
    "The history of science shows that careful measurement and honest reporting matter more "
    "than any single clever idea, because"
)


def _wait(
    condition: Any,
    timeout_s: float,
    what: str,
    log: Path | None = None,
    process: subprocess.Popen[bytes] | None = None,
) -> Any:
    """Poll ``condition`` until it holds; fail with ``log``'s tail on the timeout, or at once
    when ``process`` (what is waited for) has exited: a server that stopped at start-up with
    an error is not waited on for the whole start-up allowance."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
        except (httpx.TransportError, ValueError):
            result = None
        if result:
            return result
        exited = process is not None and process.poll() is not None
        if exited or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
            if exited:
                assert process is not None
                raise AssertionError(f"{what} exited with {process.returncode}\n{tail}")
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.25)


@dataclass
class Stack:
    server_url: str
    prometheus_url: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{promql}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scalar(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, f"{promql}: {result}"
        return float(result[0]["value"][1])

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = httpx.get(f"{self.server_url}/metrics", timeout=10).text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (apt-get install -y prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    server_log = tmp / "server.log"
    # One torch thread, as in tests/server/test_integration.py: the shared CPU box otherwise
    # oversubscribes its cores. The MBU check below divides by the peak measured (or cached)
    # under the same thread count.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    server = _start(
        [sys.executable, "-m", "server", "--port", str(port), "--max-model-len", "256",
         "--num-kv-blocks", str(NUM_KV_BLOCKS), "--stats-log-interval", "0",
         "--device", "cpu", "--dtype", "float32",
         # Targets far above any step here: the latency-target panels get data while every
         # step plans as it would without them (the whole budget fits).
         "--target-itl-ms", "60000", "--target-tpot-ms", "60000", "--target-ttft-ms", "600000",
         # n-gram speculation (the speculative-decoding panels): exact, so every count
         # below holds as without it; the "third" prompt repeats itself so drafts exist.
         "--speculative-method", "ngram", "--num-speculative-tokens", "2"],
        server_log,
        env,
    )  # fmt: skip
    server_url = f"http://127.0.0.1:{port}"
    processes = [server]
    try:
        # The project's scrape config, with only the target and the interval changed.
        config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
        config["global"]["scrape_interval"] = "1s"
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        prom_port = free_port()
        prom_log = tmp / "prometheus.log"
        prometheus = _start(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            prom_log,
            dict(os.environ),
        )  # fmt: skip
        processes.append(prometheus)
        stack = Stack(server_url, f"http://127.0.0.1:{prom_port}")
        _wait(
            lambda: httpx.get(f"{server_url}/health", timeout=2).status_code == 200,
            STARTUP_TIMEOUT_S,
            "the server",
            server_log,
            server,
        )
        _wait(
            lambda: httpx.get(f"{stack.prometheus_url}/-/ready", timeout=2).status_code == 200,
            60,
            "prometheus",
            prom_log,
            prometheus,
        )
        _wait(
            lambda: stack.query('up{job="pagedserve"} == 1'),
            60,
            "prometheus' first scrape",
            prom_log,
        )
        yield stack
    finally:
        for process in processes:
            _stop(process)


@dataclass
class Sent:
    """What the client saw of the requests that finished on their own."""

    usages: list[dict[str, int]]
    reasons: list[str]
    mbu: float
    bandwidth: float
    peak_bandwidth: float


async def _complete(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


async def _traffic(url: str) -> tuple[list[dict[str, Any]], int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        # Three concurrent requests that run to max_tokens, one ended by a stop string,
        # and a bad request (400).
        batch = await asyncio.gather(
            *(
                _complete(http, prompt=f"{PROMPT} {word}", max_tokens=6, ignore_eos=True)
                for word in ("first", "second", "third: one two three one two three one two")
            )
        )
        # Constrained by a regex (the structured-output panels): it still ends at the ".".
        stopped = await _complete(
            http,
            prompt="The capital of France is",
            max_tokens=24,
            stop=["."],
            guided_regex="[^.]{0,80}[.]",
        )
        bad = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        # Last, alone: batch-1 decode steps, for the MBU check.
        alone = await _complete(http, prompt=PROMPT, max_tokens=16, ignore_eos=True)
    return [*batch, stopped, alone], bad.status_code


@pytest.fixture(scope="module")
def sent(stack: Stack) -> Sent:
    responses, bad_status = asyncio.run(_traffic(stack.server_url))
    assert bad_status == 400
    # The gauges now describe the last step: a decode of the lone request at batch size 1.
    scrape = stack.scrape()
    model = frozenset({("model_name", MODEL)})
    assert scrape[("pagedserve_num_requests_running", model)] == 0
    sent = Sent(
        usages=[r["usage"] for r in responses],
        reasons=[r["choices"][0]["finish_reason"] for r in responses],
        mbu=scrape[("pagedserve_mbu", model)],
        bandwidth=scrape[("pagedserve_achieved_bandwidth_bytes_per_second", model)],
        peak_bandwidth=scrape[("pagedserve_peak_bandwidth_bytes_per_second", model)],
    )
    # Wait until Prometheus has scraped the end state.
    total = scrape[("pagedserve_generation_tokens_total", model)]
    _wait(
        lambda: stack.query(f"pagedserve_generation_tokens_total == {total}"),
        30,
        "a scrape after the traffic",
    )
    return sent


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, expr) of every target in the committed dashboard."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [
        (panel["title"], target.get("legendFormat", ""), target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets") or []
    ]


def test_every_dashboard_query_returns_data(stack: Stack, sent: Sent) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 30
    empty = []
    for title, legend, expr in queries:
        promql = expr.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", ".*")
        assert "$" not in promql, f"unsubstituted variable in {title}: {expr}"
        values = [float(r["value"][1]) for r in stack.query(promql)]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title} / {legend}: {promql} -> {values}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_counters_and_histograms_agree_with_the_requests_sent(stack: Stack, sent: Sent) -> None:
    assert sent.reasons == ["length"] * 3 + ["stop", "length"]
    prompt = sum(u["prompt_tokens"] for u in sent.usages)
    generated = [u["completion_tokens"] for u in sent.usages]

    def total(name: str, selector: str = "") -> float:
        return stack.scalar(f"sum({name}{{{selector}}})")

    finished = "pagedserve_requests_finished_total"
    assert total(finished, 'finished_reason="length"') == 4
    assert total(finished, 'finished_reason="stop"') == 1
    assert total(finished, 'finished_reason=~"abort|error"') == 0
    by_constraint = "pagedserve_requests_by_constraint_total"
    assert total(by_constraint, 'constraint="regex"') == 1
    assert total(by_constraint, 'constraint="none"') == 4
    assert total("pagedserve_prompt_tokens_total") == prompt
    assert total("pagedserve_generation_tokens_total") == sum(generated)
    assert total("pagedserve_request_prompt_tokens_sum") == prompt
    assert total("pagedserve_request_generation_tokens_sum") == sum(generated)
    assert total("pagedserve_request_generation_tokens_count") == 5
    assert total("pagedserve_time_to_first_token_seconds_count") == 5
    assert total("pagedserve_time_to_first_token_seconds_bucket", 'le="+Inf"') == 5
    assert total("pagedserve_e2e_request_latency_seconds_count") == 5
    assert total("pagedserve_request_queue_time_seconds_count") == 5
    assert total("pagedserve_time_per_output_token_seconds_count") == sum(
        1 for n in generated if n >= 2
    )
    assert total("pagedserve_inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
    http = "pagedserve_http_requests_total"
    assert total(http, 'handler="/v1/completions", status="200"') == 5
    assert total(http, 'handler="/v1/completions", status="400"') == 1
    assert total("pagedserve_kv_blocks_total") == NUM_KV_BLOCKS
    info = stack.query(f'pagedserve_config_info{{model_name="{MODEL}"}}')
    assert info[0]["metric"]["batching"] == "continuous"
    assert info[0]["metric"]["peak_bandwidth_source"] in ("measured", "flag")


def test_mbu_at_batch_one_decode_is_plausible(sent: Sent) -> None:
    # The lone request's decode steps read every weight once (~120 MB of the checkpoint's
    # GGUF blocks for SmolLM2-135M) plus its KV cache. The peak is a 512 MB read, from
    # memory; a step's bytes can partly come from a large last-level cache instead, so the
    # gauge may pass 1 on a machine with a large shared L3 (benchmarks/RESULTS.md). The upper
    # bound only catches a unit slip (a factor of 1,000).
    print(
        f"batch-1 decode: {sent.bandwidth / 1e9:.2f} GB/s of {sent.peak_bandwidth / 1e9:.2f} "
        f"GB/s peak, MBU {sent.mbu:.3f}"
    )
    assert 0 < sent.mbu < 5
    assert sent.mbu == pytest.approx(sent.bandwidth / sent.peak_bandwidth)


def test_the_planner_reads_the_servers_metrics(stack: Stack, sent: Sent) -> None:
    # `pagedserve plan --measured URL` reads these names (planner/measured.py).
    from planner.measured import measurement_from_prometheus

    text = httpx.get(f"{stack.server_url}/metrics", timeout=10).text
    measured = measurement_from_prometheus(text, stack.server_url)
    generated = [u["completion_tokens"] for u in sent.usages]
    assert measured.output_tokens == pytest.approx(sum(generated) / len(generated))
    assert measured.prompt_tokens == pytest.approx(
        sum(u["prompt_tokens"] for u in sent.usages) / len(generated)
    )
    assert measured.ttft_s is not None and measured.tpot_s is not None


def test_the_images_healthcheck_command(stack: Stack) -> None:
    # The Dockerfile's HEALTHCHECK, run as the container would (PAGEDSERVE_PORT set).
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    command = json.loads(dockerfile.split("HEALTHCHECK", 1)[1].split("CMD", 1)[1].split("\n")[0])
    assert command[0] == "python"
    port = stack.server_url.rsplit(":", 1)[1]
    env = {**os.environ, "PAGEDSERVE_PORT": port}
    ok = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, check=False)
    assert ok.returncode == 0, ok.stderr
    env["PAGEDSERVE_PORT"] = str(free_port())  # nothing listens there
    down = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, check=False)
    assert down.returncode != 0


def test_client_abort_is_counted(stack: Stack, sent: Sent) -> None:
    async def abort_after_first_chunk() -> None:
        async with httpx.AsyncClient(base_url=stack.server_url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return  # leaving the block closes the connection mid-stream

    asyncio.run(abort_after_first_chunk())
    _wait(
        lambda: stack.query(
            'sum(pagedserve_requests_finished_total{finished_reason="abort"}) == 1'
        ),
        30,
        "the abort in Prometheus",
    )
    (_, _, aborts) = next(q for q in dashboard_queries() if q[1] == "aborts")
    share = stack.scalar(
        aborts.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", ".*")
    )
    assert share == pytest.approx(1 / 6, rel=0.05)  # 1 abort of 6 finished requests


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_skipped_check_is_named_in_the_summary_line(tmp_path: Path, workers: str) -> None:
    """Without the prometheus binary the checks above skip; a plain ``make test`` (``-q``,
    which hides skip reasons, on pytest-xdist workers) must still say so in one line of its
    summary (tests/conftest.py's ``pytest_terminal_summary``)."""
    (tmp_path / "test_tools.py").write_text(
        "import pytest\n\n"
        "def test_needs_a_tool():\n    pytest.skip('the frob binary is not installed')\n\n"
        "def test_needs_it_too():\n    pytest.skip('the frob binary is not installed')\n\n"
        "def test_runs():\n    pass\n",
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "tests.conftest", "--rootdir",
         str(tmp_path), "-c", os.devnull, str(tmp_path / "test_tools.py")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED 2 checks: ")]
    assert len(lines) == 1, done.stdout
    names = "test_tools.py::{test_needs_a_tool, test_needs_it_too}"
    assert f"{names} (the frob binary is not installed)" in lines[0], lines[0]
    assert "test_runs" not in lines[0]
