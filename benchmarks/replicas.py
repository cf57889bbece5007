"""Two replicas behind vllm-router vs one replica, at fixed concurrency, on 127.0.0.1.

    python -m benchmarks.replicas                         # the embedded default model
    python -m benchmarks.replicas --concurrency 16,64 --num-requests 64 --json out.json

Two set-ups serve the same workload, one after the other, on this machine's cores:

- ``1 replica``: one ``python -m server`` with ``--num-threads 2``;
- ``2 replicas + router``: two servers with ``--num-threads 1`` each behind ``vllm-router``
  (``cache_aware``, its default; loadtest/replicas.py).

Each point is a closed loop (``loadtest``: that many streaming requests always in flight),
greedy, EOS ignored, so every request produces exactly ``--output-tokens`` tokens. Prompts
are the load generator's random words, the same in both set-ups (same seed), so the router
has no shared prefix to exploit beyond the chat-free prompt start. The table reports output
tokens/s, requests/s, TTFT and TPOT percentiles as the client measured them, errors, and how
many requests each replica finished (from its ``/metrics``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.provenance import git_commit
from loadtest.config import LoadTestConfig
from loadtest.launcher import ServerProcess, free_port
from loadtest.replicas import finished_requests, scrape, start_router
from loadtest.run import run_sweep

STARTUP_TIMEOUT_S = 600.0


def _server_argv(model: str | None, port: int, threads: int, extra: Sequence[str]) -> list[str]:
    argv = [
        sys.executable, "-m", "server",
        "--host", "127.0.0.1", "--port", str(port),
        "--num-threads", str(threads),
        "--stats-log-interval", "0",
        "--log-level", "warning",
        *extra,
    ]  # fmt: skip
    if model is not None:
        argv += ["--model", model]
    return argv


@contextlib.contextmanager
def servers(
    count: int, threads: int, model: str | None, extra: Sequence[str], log_dir: Path
) -> Iterator[list[ServerProcess]]:
    """``count`` servers of ``threads`` threads each, started together, until healthy."""
    procs = []
    for i in range(count):
        port = free_port()
        # OMP_NUM_THREADS too: torch's intra-op pool follows --num-threads, but a library
        # that reads only the environment must not start one thread per core either.
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        argv = _server_argv(model, port, threads, extra)
        procs.append(ServerProcess(argv, port, log_dir / f"server-{count}x{threads}-{i}.log", env))
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_healthy(STARTUP_TIMEOUT_S)
        yield procs
    finally:
        for proc in procs:
            proc.stop(grace_s=20)


def _sweep(base_url: str, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    config = LoadTestConfig(
        base_url=base_url,
        concurrencies=(concurrency,),
        num_requests=max(args.num_requests, concurrency),
        duration_limit_s=args.duration_limit,
        drain_timeout_s=60.0,
        prompt_len=args.prompt_len,
        output_len=f"fixed:{args.output_tokens}",
        seed=args.seed,
        warmup_requests=1,
        # The same prompts for both set-ups: no /tokenize calibration (the router does not
        # forward it), and the router's /metrics is not a replica's.
        calibrate_tokens=False,
        scrape_metrics=False,
        progress=False,
    )
    summary = run_sweep(config).points[0].summary
    return {
        "output_tok_s": summary.output_throughput_tok_s,
        "req_s": summary.request_throughput_req_s,
        "ttft_p50_s": summary.ttft_p50_s,
        "ttft_p90_s": summary.ttft_p90_s,
        "tpot_p50_s": summary.tpot_p50_s,
        "tpot_p90_s": summary.tpot_p90_s,
        "num_completed": summary.num_completed,
        "num_errors": summary.num_errors,
        "duration_s": summary.duration_s,
    }


def run_setup(
    name: str, count: int, threads: int, args: argparse.Namespace, log_dir: Path
) -> list[dict[str, Any]]:
    rows = []
    with servers(count, threads, args.model, args.server_args, log_dir) as procs:
        router = None
        try:
            if count > 1:
                router = start_router([p.base_url for p in procs], log_dir / "router.log")
            url = router.base_url if router is not None else procs[0].base_url
            for concurrency in args.concurrency:
                before = [finished_requests(scrape(p.base_url)) for p in procs]
                load = os.getloadavg()[0]
                row = _sweep(url, args, concurrency)
                after = [finished_requests(scrape(p.base_url)) for p in procs]
                row.update(
                    setup=name,
                    concurrency=concurrency,
                    per_replica_finished=[round(a - b) for a, b in zip(after, before, strict=True)],
                    load_average_before=round(load, 2),
                    load_average_after=round(os.getloadavg()[0], 2),
                )
                rows.append(row)
                print(_format_row(row), file=sys.stderr, flush=True)
        finally:
            if router is not None:
                router.stop(grace_s=5)
    return rows


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.0f}" if seconds is not None else "-"


def _format_row(r: dict[str, Any]) -> str:
    return (
        f"| {r['setup']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {r['req_s']:.2f} | "
        f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} | "
        f"{_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p90_s'])} | {r['num_errors']} | "
        f"{' + '.join(map(str, r['per_replica_finished']))} | "
        f"{r['load_average_before']} -> {r['load_average_after']} |"
    )


HEADER = (
    "| set-up | concurrency | output tok/s | req/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | "
    "errors | finished per replica | load avg before -> after |\n"
    "|---|---:|---:|---:|---:|---:|---:|---|---|"
)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replicas", description=__doc__)
    p.add_argument("--model", default=None, help="model to serve (default: the embedded one)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--num-requests", type=int, default=64, help="per point (at least c)")
    p.add_argument("--prompt-len", default="uniform:32:96")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--duration-limit", type=float, default=180.0, help="seconds per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="results/replicas")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--server-args",
        type=lambda s: s.split(),
        default=[],
        help="extra `serve` flags for every replica, one string (e.g. '--kv-cache-memory 256MiB')",
    )
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = run_setup("1 replica, 2 threads", 1, 2, args, log_dir)
    rows += run_setup("2 replicas x 1 thread + vllm-router", 2, 1, args, log_dir)
    print(f"commit {git_commit()}, {time.time() - started:.0f} s in all")
    print(HEADER)
    for row in rows:
        print(_format_row(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
