"""Run a sweep: probe the server, build the workload once, run every point, summarize.

``run_sweep(config)`` (or ``await arun_sweep(config)`` inside an event loop) is the one entry
point the CLI, ``compare`` and integration tests share. Every point sends the same seeded
workload (the same prompt and output lengths, cancellations and arrival draws), so points
differ only in how requests arrive; each point's synthetic prompts are other words, though
(``config.prompt_salt`` and the point's index): a server with a prefix cache would otherwise
find every later point's prompts cached by the first point, and answer them without their
prefills (a trace's prompts are the trace's, the same at every point).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.arrivals import InFlight, arrival_offsets, run_closed_loop, run_open_loop
from loadtest.client import ClientOptions, CompletionClient, RequestRecord, http_client
from loadtest.config import LoadTestConfig, SweepPoint
from loadtest.distributions import LengthDist
from loadtest.probe import discover_model, scrape_metrics, tokens_per_word
from loadtest.stats import Summary, summarize
from loadtest.workloads import (
    RequestSpec,
    grounded_workload,
    load_trace,
    make_prompt,
    synthetic_workload,
)

SCHEMA_VERSION = 1


@dataclass(slots=True)
class PointResult:
    """One sweep point: what was sent, what each request measured, and the summary."""

    point: SweepPoint
    summary: Summary
    records: list[RequestRecord]
    server_metrics_after: dict[str, float] | None = None
    # Scrapes taken during the point (config.metrics_interval_s); kept out of to_json, where
    # they would repeat every series of the server once a scrape.
    server_metrics_during: list[dict[str, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        requests = []
        for record in self.records:
            row = asdict(record)
            # Microseconds are plenty and keep result files about half the size.
            row["chunk_times_s"] = [round(t, 6) for t in record.chunk_times_s]
            requests.append(row)
        return {
            "point": self.point.to_json(),
            "summary": asdict(self.summary),
            "server_metrics_after": self.server_metrics_after,
            "requests": requests,
        }


@dataclass(slots=True)
class SweepResult:
    config: LoadTestConfig
    model: str
    tokens_per_word: float
    tokens_per_word_source: str  # "tokenize" (measured) or "assumed" (1.0)
    metrics_before: dict[str, float] | None
    points: list[PointResult]
    created_at: str

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "sweep",
            "created_at": self.created_at,
            "config": self.config.to_json(),
            "server": {
                "base_url": self.config.base_url,
                "model": self.model,
                "tokens_per_word": self.tokens_per_word,
                "tokens_per_word_source": self.tokens_per_word_source,
                "metrics_before": self.metrics_before,
            },
            "points": [p.to_json() for p in self.points],
        }


def build_workload(
    config: LoadTestConfig, tokens_per_word: float, point_index: int = 0
) -> list[RequestSpec]:
    """The requests point ``point_index`` of ``config`` sends (deterministic given the seed
    and the salt; only the synthetic prompts' words differ between points)."""
    if config.trace_path:
        return load_trace(
            config.trace_path,
            seed=config.seed,
            tokens_per_word=tokens_per_word,
            max_requests=config.num_requests,
            time_scale=config.trace_time_scale,
        )
    if config.workload == "grounded":
        return grounded_workload(
            config.num_requests, LengthDist.parse(config.output_len), config.seed + point_index
        )
    # Point 0 of an unsalted sweep keeps the words it always had.
    salt = f"{config.prompt_salt}:{point_index}" if config.prompt_salt or point_index else ""
    return synthetic_workload(
        num_requests=config.num_requests,
        prompt_len=LengthDist.parse(config.prompt_len),
        output_len=LengthDist.parse(config.output_len),
        seed=config.seed,
        tokens_per_word=tokens_per_word,
        shared_prefix_len=config.shared_prefix_len,
        num_prefixes=config.num_prefixes,
        cancel_fraction=config.cancel_fraction,
        text_salt=salt,
    )


class _Progress:
    """A tqdm bar when tqdm is importable and wanted; otherwise nothing."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_point(
    client: CompletionClient,
    point: SweepPoint,
    specs: list[RequestSpec],
    config: LoadTestConfig,
    sample_metrics: bool = False,
) -> PointResult:
    """Send ``specs`` as ``point`` says, bounded by the duration limit and drain timeout.

    ``sample_metrics``: scrape ``/metrics`` every ``config.metrics_interval_s`` meanwhile.
    """
    records: list[RequestRecord] = []
    during: list[dict[str, float]] = []
    in_flight = InFlight()
    bar = _Progress(len(specs), point.label, config.progress)
    origin = time.perf_counter()

    async def send(spec: RequestSpec) -> None:
        record = RequestRecord.for_spec(spec)
        records.append(record)
        in_flight.enter()
        try:
            await client.stream_completion(spec, record, origin)
        finally:
            in_flight.exit()
            bar.update()

    loop = asyncio.get_running_loop()
    stop_at = loop.time() + config.duration_limit_s
    if point.kind == "concurrency":
        assert point.concurrency is not None
        driver = run_closed_loop(specs, point.concurrency, send, stop_at)
    else:
        if point.kind == "rate":
            assert point.request_rate is not None
            # Arrival times have their own random stream: same schedule for every server.
            rng = random.Random(f"{config.seed}:arrivals")
            offsets = arrival_offsets(len(specs), point.request_rate, point.burstiness, rng)
        else:
            offsets = [spec.arrival_s or 0.0 for spec in specs]
        driver = run_open_loop(specs, offsets, send, stop_at, config.max_concurrency)
    sampler = None
    if sample_metrics and config.metrics_interval_s > 0:
        sampler = asyncio.create_task(_sample_metrics(client, config.metrics_interval_s, during))
    try:
        await asyncio.wait_for(driver, timeout=config.duration_limit_s + config.drain_timeout_s)
    except asyncio.TimeoutError:
        pass  # in-flight requests were cancelled; their records say cancel_reason="time_limit"
    finally:
        bar.close()
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    duration = time.perf_counter() - origin
    records.sort(key=lambda r: r.index)
    summary = summarize(records, duration, config.slo, in_flight.peak)
    return PointResult(point=point, summary=summary, records=records, server_metrics_during=during)


async def _sample_metrics(
    client: CompletionClient, interval_s: float, into: list[dict[str, float]]
) -> None:
    """Scrape ``/metrics`` every ``interval_s`` into ``into`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        samples = await scrape_metrics(client.http)
        if samples:
            into.append(samples)


async def _warmup(client: CompletionClient, num_requests: int) -> None:
    """Short unrecorded requests, so one-off costs (allocations, JIT) do not skew point one."""
    rng = random.Random("warmup")
    for i in range(num_requests):
        spec = RequestSpec(index=-1 - i, prompt=make_prompt(16, rng), prompt_len=16, max_tokens=4)
        record = RequestRecord.for_spec(spec)
        await client.stream_completion(spec, record, time.perf_counter())
        if record.error is not None:
            raise RuntimeError(f"warm-up request failed: {record.error}")


async def arun_sweep(
    config: LoadTestConfig, on_point: Callable[[PointResult], None] | None = None
) -> SweepResult:
    """Run every point of ``config`` against its server.

    Args:
        config: what to send and how.
        on_point: called after each point (the CLI prints a table row as points finish).

    Returns:
        All points with summaries and per-request records.
    """
    async with http_client(config.base_url, 30.0, config.api_key) as http:
        model = config.model or await discover_model(http)
        measured = None
        if config.calibrate_tokens:
            measured = await tokens_per_word(http, model, config.seed)
    tokens_per_word_used = measured or 1.0
    options = ClientOptions(
        base_url=config.base_url,
        model=model,
        api_key=config.api_key,
        ignore_eos=config.ignore_eos,
        temperature=config.temperature,
        extra_body=config.extra_body,
        timeout_s=config.request_timeout_s,
    )
    points: list[PointResult] = []
    async with CompletionClient(options) as client:
        await _warmup(client, config.warmup_requests)
        # Scraped after the warm-up, so "after point 1 - before" covers point 1 alone.
        metrics_before = await scrape_metrics(client.http) if config.scrape_metrics else None
        specs = build_workload(config, tokens_per_word_used)
        for index, point in enumerate(config.points()):
            if index and not config.trace_path:  # a trace's prompts are the same every point
                specs = build_workload(config, tokens_per_word_used, index)
            result = await run_point(
                client, point, specs, config, sample_metrics=metrics_before is not None
            )
            if config.scrape_metrics and metrics_before is not None:
                result.server_metrics_after = await scrape_metrics(client.http)
            points.append(result)
            if on_point is not None:
                on_point(result)
    return SweepResult(
        config=config,
        model=model,
        tokens_per_word=measured or 1.0,
        tokens_per_word_source="tokenize" if measured else "assumed",
        metrics_before=metrics_before,
        points=points,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )


def run_sweep(
    config: LoadTestConfig, on_point: Callable[[PointResult], None] | None = None
) -> SweepResult:
    """Synchronous :func:`arun_sweep` (starts its own event loop)."""
    return asyncio.run(arun_sweep(config, on_point))


# A JSON list of numbers spread over lines by indent=2, e.g. "[\n  0.1,\n  0.2\n]".
_NUMBER_LIST = re.compile(r"\[\n\s*(-?[\d.eE+-]+(?:,\n\s*-?[\d.eE+-]+)*)\n\s*\]")


def dumps_result(obj: dict[str, Any]) -> str:
    """Indented JSON with number lists (per-chunk times) kept on one line each."""
    text = json.dumps(obj, indent=2, allow_nan=False)
    # NOTE: json.dumps escapes newlines inside strings, so "[\n" only occurs as layout.
    return _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def write_result(obj: dict[str, Any], path: str | Path) -> Path:
    """Write a result JSON (creating parent folders) and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps_result(obj) + "\n", encoding="utf-8")
    return out


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file a sweep or a comparison wrote.

    Raises:
        ValueError: the file is not one (not JSON, or JSON without a result's kind).
    """
    try:
        obj: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not a result file (not text: {exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a result file (not JSON: {exc})") from None
    kind = obj.get("kind") if isinstance(obj, dict) else None
    if kind not in ("sweep", "compare"):
        raise ValueError(
            f"{path} is not a result file: a sweep's or a comparison's JSON has "
            '"kind": "sweep" or "compare" (what `bench run --out` and `bench compare` write)'
        )
    result: dict[str, Any] = obj
    return result
