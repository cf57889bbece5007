"""Latency targets on and off, same server, same loads: ITL p99 against the target,
throughput and TTFT p50 against the untargeted run, and the step-time model's accuracy.

    python -m benchmarks.latency_targets                       # target = 3 x decode step
    python -m benchmarks.latency_targets --target-itl-ms 400 --json results/lt.json
    python -m benchmarks.latency_targets --quick --trace-dir results/lt-steps   # ~10 min
    python -m benchmarks.latency_targets --quick --target-itl-ratio 2           # relative

Two loads, each run against pagedserve started without a target and then with
``--target-itl-ms`` (both on 127.0.0.1, ``loadtest.launcher``; the HTTP load generator
``loadtest.run`` drives them):

1. closed loop at concurrency 64, 128-token prompts, 64 output tokens (greedy, EOS ignored);
2. Poisson arrivals at ``--load`` (80%) of the untargeted server's capacity for prompts of
   64 to 1,024 tokens (uniform) and 64 output tokens. The capacity is measured first, by a
   short closed-loop run of that workload at concurrency 32 on the untargeted server.

The default target is 3 x the decode-only step time at concurrency 64, read as the
untargeted run's ITL p50 (most of its steps are decode-only); ``--target-itl-ms`` gives it.
``--target-itl-ratio R`` runs the targeted server with the relative target instead (a step
with prompt tokens at most R x the same decodes alone); its table reads the target as R x
that ITL p50. The table has, per load: ITL p99, its ratio to the target and to the run's own
ITL p50 (the issue's p99 / p50), output throughput and TTFT p50
and their ratios to the untargeted run, and from the targeted server's /metrics the share of
steps that kept their budget and of steps whose predicted time was within 20% of the
measured one (``pagedserve_step_time_prediction_ratio``, read between the load's scrapes).
The issue's bars: ITL p99 <= 1.2 x target, throughput >= 0.9 x, TTFT p50 <= 1.5 x, and the
prediction within 20% for >= 90% of steps.

``--quick`` bounds the run (64 closed-loop requests, 32 for the capacity, 24 Poisson ones, a
90 s sending window and 120 s drain per load): about 10 minutes on a quiet 2-core machine.
With ``--trace-dir`` each server also writes its step trace (engine/step_trace.py), and the
run ends with their replay through the predictor (``benchmarks.step_replay``): the share
within 20% by step kind beside the same-shape noise floor, the model's error told apart
from the machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import step_replay
from benchmarks.provenance import git_commit
from engine.step_trace import ENV as TRACE_ENV
from loadtest.config import LoadTestConfig
from loadtest.launcher import ServerProcess, build_command, free_port
from loadtest.run import SweepResult, run_sweep
from planner.cpu import cpu_model_name

ROOT = Path(__file__).resolve().parents[1]
PREDICTION = "pagedserve_step_time_prediction_ratio"


@dataclass(frozen=True, slots=True)
class Load:
    """One load of a server's run; ``config`` gets the rows of the loads before it (the
    Poisson rate comes from the capacity load)."""

    name: str
    config: Callable[[dict[str, Any]], LoadTestConfig]


def _le(key: str) -> str | None:
    match = re.search(r'le="([^"]*)"', key)
    return match.group(1) if match else None


def _series_sum(metrics: Mapping[str, float] | None, name: str, le: str | None = None) -> float:
    total = 0.0
    for key, value in (metrics or {}).items():
        if key.split("{", 1)[0] == name and (le is None or _le(key) == le):
            total += value
    return total


def server_shares(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, float | None]:
    """Between two scrapes: steps within their budget, and predictions within 20%."""

    def delta(name: str, le: str | None = None) -> float:
        return _series_sum(after, name, le) - _series_sum(before, name, le)

    steps = delta("pagedserve_target_steps_total")
    count = delta(PREDICTION + "_count")
    within = delta(PREDICTION + "_bucket", "1.2") - delta(PREDICTION + "_bucket", "0.8")
    return {
        "steps_within_budget": delta("pagedserve_target_steps_met_total") / steps
        if steps
        else None,
        "predictions_within_20pct": within / count if count else None,
        "predicted_steps": count,
    }


def run_load(
    cmd: str,
    name: str,
    loads: list[Load],
    log_dir: Path,
    startup_timeout_s: float,
    trace_dir: Path | None = None,
) -> dict[str, Any]:
    """Start one server, run every load against it in order, stop it. With ``trace_dir``
    the server writes its step trace to ``trace_dir/<name>.jsonl`` (engine/step_trace.py)."""
    port = free_port()
    argv = build_command(cmd, host="127.0.0.1", port=port)
    env = None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, TRACE_ENV: str(trace_dir / f"{name}.jsonl")}
    server = ServerProcess(argv, port, log_dir / f"{name}.log", env=env)
    print(f"starting {name}: {' '.join(argv)}", flush=True)
    server.start()
    out: dict[str, Any] = {}
    try:
        server.wait_healthy(timeout_s=startup_timeout_s)
        for load in loads:
            t0 = time.monotonic()
            config = replace(load.config(out), base_url=server.base_url)
            sweep: SweepResult = run_sweep(config)
            point = sweep.points[0]
            s = point.summary
            out[load.name] = {
                "itl_p50_s": s.itl_p50_s,
                "itl_p99_s": s.itl_p99_s,
                "ttft_p50_s": s.ttft_p50_s,
                "tpot_p50_s": s.tpot_p50_s,
                "output_tok_s": s.output_throughput_tok_s,
                "request_rate": s.num_completed / s.duration_s if s.duration_s else None,
                "num_completed": s.num_completed,
                "num_errors": s.num_errors,
                "duration_s": s.duration_s,
                **server_shares(sweep.metrics_before, point.server_metrics_after),
            }
            print(
                f"{name} {load.name}: ITL p99 {s.itl_p99_s}, TTFT p50 {s.ttft_p50_s}, "
                f"{s.output_throughput_tok_s:.1f} tok/s, {s.num_completed} done "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    finally:
        server.stop()
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return format("-", spec.split(".")[0])  # the same width, no precision
    return format(value, spec)


def table(results: dict[str, Any], target_s: float, ratio: float | None = None) -> str:
    """The results as text; ``ratio``: the target was ``--target-itl-ratio`` (``target_s``
    is then that many untargeted c=64 ITL p50s)."""
    head = f"target ITL {target_s * 1000:.0f} ms"
    if ratio is not None:
        head = f"target ITL {ratio:g} x the decode step (about {target_s * 1000:.0f} ms)"
    lines = [
        head,
        f"{'load':<12}{'run':<10}{'ITL p99':>10}{'/target':>9}{'/p50':>7}{'out tok/s':>11}"
        f"{'ratio':>7}"
        f"{'TTFT p50':>10}{'ratio':>7}{'in budget':>11}{'pred +-20%':>11}",
    ]
    for load in ("c64", "poisson"):
        base = results["untargeted"].get(load)
        tgt = results["targeted"].get(load)
        for run, row in (("none", base), ("target", tgt)):
            if row is None:
                continue
            targeted = run == "target"
            lines.append(
                f"{load:<12}{run:<10}{_fmt(row['itl_p99_s'], '>9.3f')}s"
                f"{_fmt(_ratio(row['itl_p99_s'], target_s), '>9.2f')}"
                f"{_fmt(_ratio(row['itl_p99_s'], row['itl_p50_s']), '>7.2f')}"
                f"{_fmt(row['output_tok_s'], '>11.1f')}"
                f"{_fmt(_ratio(row['output_tok_s'], base['output_tok_s']) if targeted else 1.0, '>7.2f')}"  # noqa: E501
                f"{_fmt(row['ttft_p50_s'], '>9.3f')}s"
                f"{_fmt(_ratio(row['ttft_p50_s'], base['ttft_p50_s']) if targeted else 1.0, '>7.2f')}"  # noqa: E501
                f"{_fmt(row.get('steps_within_budget'), '>11.2f')}"
                f"{_fmt(row.get('predictions_within_20pct'), '>11.2f')}"
            )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model_name(),
        "cpus": os.cpu_count(),
        "commit": git_commit(),
        "loadavg": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency_targets", description=__doc__)
    p.add_argument(
        "--target-itl-ms",
        type=float,
        default=None,
        help="the target; default 3 x the untargeted c=64 ITL p50",
    )
    p.add_argument(
        "--target-itl-ratio",
        type=float,
        default=None,
        help="run the targeted server with this relative target instead of --target-itl-ms",
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=96, help="closed-loop requests")
    p.add_argument("--poisson-requests", type=int, default=48)
    p.add_argument(
        "--capacity-requests",
        type=int,
        default=32,
        help="requests of the capacity run (closed loop at half the concurrency)",
    )
    p.add_argument("--load", type=float, default=0.8, help="Poisson rate / capacity")
    p.add_argument(
        "--server-cmd",
        default=f"{sys.executable} -m server --host {{host}} "
        "--port {port} --stats-log-interval 0",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--duration-limit",
        type=float,
        default=150.0,
        help="seconds a load may send requests (bounds the run)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="seconds requests in flight at the duration limit may still run",
    )
    p.add_argument("--json", type=Path, default=ROOT / "results" / "latency_targets.json")
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="each server writes a step trace here (untargeted.jsonl, targeted.jsonl) for "
        "python -m benchmarks.step_replay replay",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="bounded counts: --num-requests 64 --poisson-requests 24 --capacity-requests 32 "
        "--duration-limit 90 --drain-timeout 120",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.poisson_requests, args.capacity_requests = 64, 24, 32
        args.duration_limit, args.drain_timeout = 90.0, 120.0
    if args.target_itl_ms is not None and not args.target_itl_ms > 0:
        p.error("--target-itl-ms must be positive")
    if args.target_itl_ratio is not None:
        if args.target_itl_ms is not None:
            p.error("give --target-itl-ms or --target-itl-ratio, not both")
        if not args.target_itl_ratio > 1:
            p.error("--target-itl-ratio must be above 1")
    log_dir = args.json.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    before = machine()
    print(f"machine: {before['cpu']}, load average {before['loadavg']}", flush=True)

    common = dict(base_url="http://127.0.0.1:0", ignore_eos=True, temperature=0.0,
                  progress=False, warmup_requests=2, metrics_interval_s=0.0,
                  duration_limit_s=args.duration_limit,
                  drain_timeout_s=args.drain_timeout)  # fmt: skip
    c64 = LoadTestConfig(concurrencies=(args.concurrency,), num_requests=args.num_requests,
                         prompt_len="fixed:128", output_len="fixed:64", prompt_salt="c64",
                         **common)  # type: ignore[arg-type]  # fmt: skip
    mixed = dict(prompt_len="uniform:64:1024", output_len="fixed:64", **common)
    capacity = LoadTestConfig(concurrencies=(max(1, args.concurrency // 2),),
                              num_requests=args.capacity_requests,
                              prompt_salt="capacity", **mixed)  # type: ignore[arg-type]  # fmt: skip

    results: dict[str, Any] = {"machine": before}
    rate: dict[str, float] = {}

    def poisson(done: dict[str, Any]) -> LoadTestConfig:
        if not rate:  # the untargeted server measured the capacity just before
            rate["capacity"] = done["capacity"]["request_rate"]
            rate["poisson"] = args.load * rate["capacity"]
            print(f"capacity {rate['capacity']:.2f} req/s -> Poisson {rate['poisson']:.2f} "
                  "req/s", flush=True)  # fmt: skip
        return LoadTestConfig(request_rates=(rate["poisson"],),
                              num_requests=args.poisson_requests, prompt_salt="poisson",
                              seed=1, **mixed)  # type: ignore[arg-type]  # fmt: skip

    untargeted = run_load(args.server_cmd, "untargeted",
                          [Load("c64", lambda _: c64), Load("capacity", lambda _: capacity),
                           Load("poisson", poisson)], log_dir, args.startup_timeout,
                          args.trace_dir)  # fmt: skip
    ratio = args.target_itl_ratio
    decode_ms = untargeted["c64"]["itl_p50_s"] * 1000
    target_ms = args.target_itl_ms or round((ratio or 3) * decode_ms)
    flag = f"--target-itl-ms {target_ms}" if ratio is None else f"--target-itl-ratio {ratio:g}"
    print(f"targeted server: {flag} (untargeted c64 ITL p50 {decode_ms:.0f} ms)", flush=True)
    targeted = run_load(f"{args.server_cmd} {flag}", "targeted",
                        [Load("c64", lambda _: c64), Load("poisson", poisson)], log_dir,
                        args.startup_timeout, args.trace_dir)  # fmt: skip
    results.update(untargeted=untargeted, targeted=targeted, target_itl_ms=target_ms,
                   target_itl_ratio=ratio,
                   poisson_rate=rate["poisson"], capacity_rate=rate["capacity"])  # fmt: skip
    results["machine_after"] = machine()
    text = table(results, target_ms / 1000, ratio)
    print(text)
    print(f"load average before {before['loadavg']}, after {results['machine_after']['loadavg']}")
    results["table"] = text
    if args.trace_dir is not None:
        for name in ("untargeted", "targeted"):
            print(step_replay.report(args.trace_dir / f"{name}.jsonl", step_replay.WARMUP))
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
