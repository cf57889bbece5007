"""``--max-queue-time`` under overload: the same soak against a server without the bound and
one with it.

    python -m benchmarks.queue_bound                              # ~5 min on 2 cores
    python -m benchmarks.queue_bound --duration 20 --calibrate-s 10 --max-queue-time 5  # ~2 min
    python -m benchmarks.queue_bound --json results/queue_bound.json

Two servers in turn on 127.0.0.1 (``loadtest.launcher``), the same model and flags, the
second with ``--max-queue-time S``. The first one's capacity is measured by a closed loop at
``--max-num-seqs`` concurrency (``--calibrate-s``; ``--capacity`` skips it); then each
server, warmed up alike (two requests, then a full batch), gets the same open-loop Poisson
arrivals (one seed) at ``--load`` (3x) that capacity for ``--duration`` seconds, streaming
completions of fixed lengths, greedy, EOS ignored. What is still running ``--drain-s``
after the window closes is cancelled and counted.

Per run it prints: the requests sent, admitted (200) and refused (503, by error code), the
share of 503s that carry ``Retry-After``; the admitted requests' wait for their first token
as the client saw it (max, p99, p50: the bound covers queueing and prefill, so this is what
it caps; one cancelled at the drain's end before its first token counts with its wait so
far, a lower bound, and ``cancelled_before_first_token`` says how many did); the server's
share of engine-started requests whose queue time exceeded S
(``pagedserve_request_queue_time_seconds``: read when S is a bucket edge, as 30 s is);
throughput as the tokens the server delivered per second inside the window
(``pagedserve_generation_tokens_total``) and the requests completed inside it per second.
Then the ratios bounded / unbounded. The issue's bars: no admitted request waits past S +
one step, the rest get 503 with Retry-After, throughput >= 0.95x the unbounded run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.provenance import git_commit
from loadtest.launcher import ServerProcess, free_port
from loadtest.probe import parse_prometheus_text
from loadtest.stats import percentile
from loadtest.workloads import make_prompt
from planner.cpu import cpu_model_name

ROOT = Path(__file__).resolve().parents[1]
GENERATION_TOKENS = "pagedserve_generation_tokens_total"
QUEUE_TIME_BUCKET = "pagedserve_request_queue_time_seconds_bucket"
WARM_UP_TRIES = 5
STARTUP_TIMEOUT_S = 900.0  # a first start converts the default model and builds the kernels


@dataclass
class Outcome:
    """One request of the soak, as the client saw it."""

    sent_at: float
    status: int | None = None
    code: str | None = None  # the error's code (a 503's), or the transport error's name
    retry_after: str | None = None
    first_token_s: float | None = None  # sent to the first streamed token
    completed_at: float | None = None  # [DONE] received
    cancelled_at: float | None = None  # still running when the drain ended


@dataclass
class Run:
    name: str
    max_queue_time_s: float | None
    rate: float
    window_s: float
    started_at: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    tokens_in_window: float = 0.0
    queue_buckets: dict[float, float] = field(default_factory=dict)  # le -> count, run only

    def summary(self) -> dict[str, Any]:
        sent = len(self.outcomes)
        admitted = [o for o in self.outcomes if o.status == 200]
        refused = [o for o in self.outcomes if o.status == 503]
        # A request cancelled before its first token waited at least until then.
        censored = [
            o.cancelled_at - o.sent_at
            for o in admitted
            if o.first_token_s is None and o.cancelled_at is not None
        ]
        waits = [o.first_token_s for o in admitted if o.first_token_s is not None] + censored
        completed = [o.completed_at for o in admitted if o.completed_at is not None]
        window_end = self.started_at + self.window_s
        started = self.queue_buckets.get(float("inf"), 0.0)
        over = None
        if self.max_queue_time_s is not None and self.max_queue_time_s in self.queue_buckets:
            over = (started - self.queue_buckets[self.max_queue_time_s]) / max(started, 1.0)
        return {
            "name": self.name,
            "max_queue_time_s": self.max_queue_time_s,
            "rate_per_s": round(self.rate, 3),
            "sent": sent,
            "admitted": len(admitted),
            "completed": len(completed),
            "cancelled_at_drain": sum(o.cancelled_at is not None for o in self.outcomes),
            "cancelled_before_first_token": len(censored),
            "refused_503": len(refused),
            "refused_share": len(refused) / sent if sent else 0.0,
            "refused_codes": dict(Counter(o.code for o in refused)),
            "refused_with_retry_after_share": (
                sum(o.retry_after is not None for o in refused) / len(refused) if refused else None
            ),
            "other_errors": dict(
                Counter(
                    o.code or str(o.status) for o in self.outcomes if o.status not in (200, 503)
                )
            ),
            "first_token_wait_max_s": max(waits) if waits else None,
            "first_token_wait_p99_s": percentile(waits, 99) if waits else None,
            "first_token_wait_p50_s": percentile(waits, 50) if waits else None,
            "engine_started": started,
            "queue_time_over_bound_share": over,
            "tokens_per_s": self.tokens_in_window / self.window_s,
            "completed_per_s": sum(t <= window_end for t in completed) / self.window_s,
        }


def _counter(text: str, name: str) -> float:
    return sum(v for k, v in parse_prometheus_text(text).items() if k.split("{")[0] == name)


def _queue_buckets(text: str) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for key, value in parse_prometheus_text(text).items():
        if key.startswith(QUEUE_TIME_BUCKET + "{"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


async def _metrics(http: httpx.AsyncClient) -> str:
    return (await http.get("/metrics", timeout=30)).text


def _body(args: argparse.Namespace, rng: random.Random, stream: bool) -> dict[str, Any]:
    return {
        "prompt": make_prompt(args.prompt_tokens, rng),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def _one(http: httpx.AsyncClient, body: dict[str, Any], outcome: Outcome) -> None:
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                text = await response.aread()
                outcome.retry_after = response.headers.get("retry-after")
                try:
                    outcome.code = json.loads(text)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    outcome.code = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    outcome.completed_at = time.monotonic()
                    return
                if outcome.first_token_s is None:
                    outcome.first_token_s = time.monotonic() - outcome.sent_at
                if '"error"' in data and json.loads(data).get("error"):
                    outcome.code = json.loads(data)["error"].get("code") or "error event"
                    return
    except asyncio.CancelledError:
        outcome.cancelled_at = time.monotonic()
        raise
    except httpx.HTTPError as exc:
        outcome.code = type(exc).__name__


async def warm_up(base_url: str, args: argparse.Namespace) -> None:
    """Two requests alone, then a full batch: the first steps' one-time costs (first touches
    of the KV cache, the kernels' first calls) would otherwise land in the soak's first
    seconds, where the bounded server turns them into refusals. A cold first request can
    itself outlast a short bound (a 503 whose work still warmed the engine): each is tried
    up to WARM_UP_TRIES times."""
    rng = random.Random(f"{args.seed}:warm-up")

    async def one(http: httpx.AsyncClient) -> None:
        body = _body(args, rng, stream=False)
        for _ in range(WARM_UP_TRIES):
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 503:
                r.raise_for_status()
                return
        raise SystemExit(f"warm-up: {WARM_UP_TRIES} tries got 503: {r.text[:300]}")

    async with httpx.AsyncClient(base_url=base_url, timeout=None) as http:
        for _ in range(2):
            await one(http)
        await asyncio.gather(*(one(http) for _ in range(args.max_num_seqs)))


async def calibrate(base_url: str, args: argparse.Namespace) -> float:
    """Requests per second at saturation: a closed loop at --max-num-seqs concurrency,
    counted after the first quarter of --calibrate-s (first-request costs, ramp-up)."""
    rng = random.Random(f"{args.seed}:calibrate")
    done: list[float] = []
    start = time.monotonic()
    stop_at = start + args.calibrate_s

    async def worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            r = await http.post("/v1/completions", json=_body(args, rng, stream=False))
            r.raise_for_status()
            done.append(time.monotonic())

    limits = httpx.Limits(max_connections=args.max_num_seqs * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.max_num_seqs)))
    counted_from = start + args.calibrate_s / 4
    counted = [t for t in done if t >= counted_from]
    if len(counted) < 2:
        raise SystemExit(
            f"calibration: only {len(done)} requests finished in {args.calibrate_s:g} s; "
            "raise --calibrate-s or pass --capacity"
        )
    return (len(counted) - 1) / (counted[-1] - counted[0])


async def soak(base_url: str, run: Run, args: argparse.Namespace) -> None:
    rng = random.Random(f"{args.seed}:soak")  # the same arrivals and prompts for every run
    arrivals: list[float] = []
    t = 0.0
    while (t := t + rng.expovariate(run.rate)) < run.window_s:
        arrivals.append(t)
    bodies = [_body(args, rng, stream=True) for _ in arrivals]
    limits = httpx.Limits(max_connections=len(arrivals) + 16, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        before = await _metrics(http)
        start = run.started_at = time.monotonic()
        tasks = []
        for at, body in zip(arrivals, bodies, strict=True):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(sent_at=time.monotonic())
            run.outcomes.append(outcome)
            tasks.append(asyncio.create_task(_one(http, body, outcome)))
        await asyncio.sleep(max(0.0, start + run.window_s - time.monotonic()))
        in_window = await _metrics(http)
        _, pending = await asyncio.wait(tasks, timeout=args.drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        after = await _metrics(http)
    run.tokens_in_window = _counter(in_window, GENERATION_TOKENS) - _counter(
        before, GENERATION_TOKENS
    )
    first, last = _queue_buckets(before), _queue_buckets(after)
    run.queue_buckets = {le: last[le] - first.get(le, 0.0) for le in last}


def start_server(args: argparse.Namespace, extra: list[str], log: Path) -> ServerProcess:
    port = free_port()
    argv = [
        sys.executable, "-m", "server",
        "--model", args.model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs),
        "--stats-log-interval", "0",
        *args.server_arg,
        *extra,
    ]  # fmt: skip
    server = ServerProcess(argv, port, log, cwd=ROOT)
    server.start_healthy(STARTUP_TIMEOUT_S, grace_s=10)
    return server


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return " ".join(f"{k}:{v}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.queue_bound",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-queue-time", type=float, default=30.0, help="S, seconds")
    parser.add_argument("--load", type=float, default=3.0, help="arrival rate / capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="sending window, s")
    parser.add_argument("--drain-s", type=float, default=60.0,
                        help="after the window, how long requests may still run")  # fmt: skip
    parser.add_argument("--capacity", type=float, default=None,
                        help="requests/s at saturation (default: measured)")  # fmt: skip
    parser.add_argument("--calibrate-s", type=float, default=20.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an extra server flag (repeat), e.g. --server-arg=--num-kv-blocks=512",
    )
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.max_queue_time <= 0 or args.load <= 0 or args.duration <= 0:
        parser.error("--max-queue-time, --load and --duration must be positive")
    # Thousands of streams may be open at once in the unbounded run.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="queue_bound-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    capacity = args.capacity
    runs = []
    for name, bound in (("unbounded", None), ("bounded", args.max_queue_time)):
        extra = [] if bound is None else ["--max-queue-time", f"{bound:g}"]
        log = log_dir / f"{name}.log"
        print(f"{name}: starting the server (log {log})", flush=True)
        server = start_server(args, extra, log)
        try:
            asyncio.run(warm_up(server.base_url, args))
            if capacity is None:
                capacity = asyncio.run(calibrate(server.base_url, args))
                print(f"capacity {capacity:.2f} requests/s at concurrency {args.max_num_seqs}")
            run = Run(name, bound, args.load * capacity, args.duration)
            print(f"{name}: {run.rate:.2f} requests/s for {args.duration:g} s", flush=True)
            asyncio.run(soak(server.base_url, run, args))
            runs.append(run)
        finally:
            server.stop(grace_s=30)

    summaries = [r.summary() for r in runs]
    keys = [k for k in summaries[0] if k != "name"]
    print(f"\n{'':32}" + "".join(f"  {s['name']:>36}" for s in summaries))
    for key in keys:
        print(f"{key:32}" + "".join(f"  {_fmt(s[key]):>36}" for s in summaries))
    unbounded, bounded = summaries
    ratios = {
        "tokens_per_s": bounded["tokens_per_s"] / max(unbounded["tokens_per_s"], 1e-9),
        "completed_per_s": bounded["completed_per_s"] / max(unbounded["completed_per_s"], 1e-9),
    }
    wait_max = bounded["first_token_wait_max_s"]
    print(
        f"\nbounded / unbounded: throughput (tokens/s) {ratios['tokens_per_s']:.3f}x, "
        f"completed requests/s {ratios['completed_per_s']:.3f}x; bounded max wait "
        f"{_fmt(wait_max)} s against a bound of {args.max_queue_time:g} s; 503s with "
        f"Retry-After {_fmt(bounded['refused_with_retry_after_share'])}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "commit": git_commit(ROOT),
                    "cpu": cpu_model_name(),
                    "capacity_per_s": capacity,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": summaries,
                    "ratios": ratios,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
