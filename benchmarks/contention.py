"""Decode speed when another process wants a core.

    python -m benchmarks.contention                          # concurrency 1 and 16
    python -m benchmarks.contention --concurrency 1 --num-requests 16 --json out.json

Servers share hosts and run in containers with CPU quotas. This starts pagedserve's server
(a subprocess on 127.0.0.1, ``loadtest.launcher``) and, at each concurrency, drives it with
the HTTP load generator (``loadtest.run``) twice: alone, and beside one busy process
(``python3 -c 'while True: pass'``) pinned to one of the CPUs the server may use. It prints
TPOT p50 for each and their ratio; the target is a ratio of at most 2.2 (a 2-thread server
next to one busy process should lose about half its speed, not most of it).

The quiet and busy runs of a point follow each other on the same server, with prompts no
earlier run sent (a prefix cache would skip their prefills). Other load on the machine moves
both; the ratio is only as steady as the machine is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadtest.config import LoadTestConfig
from loadtest.launcher import ServerProcess, build_command, free_port
from loadtest.run import run_sweep

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 2.2
BUSY_LOOP = "while True: pass"


@dataclass(frozen=True, slots=True)
class Point:
    concurrency: int
    quiet_tpot_p50_s: float | None
    busy_tpot_p50_s: float | None
    quiet_tok_s: float
    busy_tok_s: float
    busy_cpu: int

    @property
    def ratio(self) -> float | None:
        if not self.quiet_tpot_p50_s or self.busy_tpot_p50_s is None:
            return None
        return self.busy_tpot_p50_s / self.quiet_tpot_p50_s


@contextlib.contextmanager
def busy_process(cpu: int) -> Iterator[int]:
    """One process spinning on ``cpu`` for the block; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.sched_setaffinity(proc.pid, {cpu})
        time.sleep(0.5)  # let it run before the point starts
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)


def cpu_name() -> str:
    """The CPU's model name (as ``lscpu`` prints it), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def commit(checkout: Path) -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def measure(args: argparse.Namespace, log_dir: Path) -> list[Point]:
    port = free_port()
    argv = build_command(f"{args.server_cmd} --host 127.0.0.1 --port {{port}}", port=port)
    server = ServerProcess(argv, port, log_dir / "server.log", cwd=args.server_cwd)
    cpus = sorted(os.sched_getaffinity(0))
    busy_cpu = cpus[-1]
    print(f"starting {' '.join(argv)} (log: {server.log_path})", flush=True)
    server.start()
    points = []
    try:
        startup_s = server.wait_healthy(timeout_s=args.startup_timeout)
        print(f"healthy after {startup_s:.0f} s", flush=True)
        for c in args.concurrency:
            config = LoadTestConfig(
                base_url=server.base_url,
                concurrencies=(c,),
                num_requests=max(args.num_requests, c),
                prompt_len=f"fixed:{args.prompt_tokens}",
                output_len=f"fixed:{args.max_tokens}",
                ignore_eos=True,
                temperature=0.0,
                progress=False,
                warmup_requests=2,
                scrape_metrics=False,
                metrics_interval_s=0,
            )
            quiet = run_sweep(_salted(config, f"quiet-c{c}")).points[0].summary
            with busy_process(busy_cpu):
                busy = run_sweep(_salted(config, f"busy-c{c}")).points[0].summary
            for name, s in (("alone", quiet), ("busy", busy)):
                if s.num_errors:
                    print(f"WARNING: c={c} {name}: {s.num_errors} requests failed", flush=True)
            point = Point(
                concurrency=c,
                quiet_tpot_p50_s=quiet.tpot_p50_s,
                busy_tpot_p50_s=busy.tpot_p50_s,
                quiet_tok_s=quiet.output_throughput_tok_s,
                busy_tok_s=busy.output_throughput_tok_s,
                busy_cpu=busy_cpu,
            )
            print(format_point(point), flush=True)
            points.append(point)
    finally:
        server.stop()
    return points


def _salted(config: LoadTestConfig, salt: str) -> LoadTestConfig:
    return replace(config, prompt_salt=salt)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def format_point(p: Point) -> str:
    ratio = "n/a" if p.ratio is None else f"{p.ratio:.2f}x"
    return (
        f"c={p.concurrency:<3} TPOT p50 alone {_ms(p.quiet_tpot_p50_s):>9}, beside a busy "
        f"process on CPU {p.busy_cpu} {_ms(p.busy_tpot_p50_s):>9}: {ratio} "
        f"(output {p.quiet_tok_s:.0f} -> {p.busy_tok_s:.0f} tok/s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.contention",
        description="TPOT of pagedserve's server alone and beside one busy process pinned to "
        "one of its CPUs.",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-requests", type=int, default=24, help="per run (default 24)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--server-cmd",
        default=f"{shlex.quote(sys.executable)} -m server",
        help="the server command, without --host/--port (default: this interpreter's "
        "`-m server`, which serves the checkout it runs in)",
    )
    parser.add_argument(
        "--server-cwd",
        type=Path,
        default=ROOT,
        help="the server's working directory (default: this checkout), e.g. another checkout "
        "to compare with",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        print("error: this needs os.sched_setaffinity (Linux)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pagedserve-contention-") as tmp:
        points = measure(args, Path(tmp))
    head = f"{cpu_name()}, {len(os.sched_getaffinity(0))} CPUs, commit {commit(args.server_cwd)}"
    print(f"\n{head}; target: busy/alone <= {TARGET_RATIO}")
    for p in points:
        print(format_point(p))
    if args.json:
        out: dict[str, Any] = {
            "machine": head,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "points": [
                {**{k: getattr(p, k) for k in p.__dataclass_fields__}, "ratio": p.ratio}
                for p in points
            ],
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(p.ratio is not None and p.ratio <= TARGET_RATIO for p in points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
