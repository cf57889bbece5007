"""Decode speed when another process wants a core.

    python -m benchmarks.contention                          # concurrency 1 and 16
    python -m benchmarks.contention --concurrency 1 --num-requests 16 --json out.json
    python -m benchmarks.contention --offline                # engine steps, no HTTP

Servers share hosts and run in containers with CPU quotas. This starts pagedserve's server
(a subprocess on 127.0.0.1, ``loadtest.launcher``) and, at each concurrency, drives it with
the HTTP load generator (``loadtest.run``) twice: alone, and beside one busy process
(``python3 -c 'while True: pass'``) pinned to one of the CPUs the server may use. It prints
TPOT p50 for each and their ratio; the target is a ratio of at most 2.2 (a 2-thread server
next to one busy process should lose about half its speed, not most of it).

The quiet and busy runs of a point follow each other on the same server, with prompts no
earlier run sent (a prefix cache would skip their prefills). Other load on the machine moves
both; the ratio is only as steady as the machine is.

``--offline`` leaves the HTTP layer and the load generator out: the default model in this
process (the C++ CPU kernels' fused stack), decode-only steps of batch 1 and 16 timed with
``LLM.engine.step()``, the median of ``--steps`` steps, alone and beside the busy process in
alternating rounds, for each team mode: ``adapt`` (the default: the team narrows to the CPUs
other processes leave free, kernels/cpu/csrc/contention.h), ``team`` (always the whole team)
and ``solo`` (thread 0 alone). It also prints, per run, the step thread's CPU time a step
(solo: what a step costs one CPU, a figure other load moves far less than wall time), how
long it sat runnable without a CPU (``/proc/self/task/<tid>/schedstat``) and where it ran.

``--offline --prefill`` times prefill steps instead: one fresh prompt of each
``--prefill-tokens`` length a step (no prefix-cache hits), ``--steps`` of them a run, in the
same alternating rounds and team modes. A prefill step is larger than the team's 16 rows, so
it runs torch's and the kernels' own parallel regions unless the stack narrows it (adapt,
solo); ``team`` is a prefill as before the narrowing reached such steps. It prints the
median step, prompt tokens a second, and the process's CPU time a step (both threads: a
counted figure for what a step costs the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from benchmarks.provenance import git_commit
from loadtest.config import LoadTestConfig
from loadtest.launcher import ServerProcess, build_command, free_port
from loadtest.run import run_sweep
from planner.cpu import cpu_model_name

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

RunT = TypeVar("RunT")

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
    # CPUs this process (the load generator) used during the quiet run: to the server a
    # neighbour like any other (kernels/cpu/csrc/contention.h narrows the team from 0.5)
    client_cpus: float = 0.0
    load: float = 0.0  # 1-minute load average when the point ended

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
            cpu0, wall0 = time.process_time(), time.perf_counter()
            quiet = run_sweep(_salted(config, f"quiet-c{c}")).points[0].summary
            client_cpus = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
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
                client_cpus=client_cpus,
                load=os.getloadavg()[0],
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
        f"(output {p.quiet_tok_s:.0f} -> {p.busy_tok_s:.0f} tok/s; load generator "
        f"{p.client_cpus:.2f} CPUs; load average {p.load:.1f})"
    )


OFFLINE_MODES = ("adapt", "team", "solo")
WARM_STEPS = 400  # at most, before a run's timed steps (0.6 s of them at most)


@dataclass(frozen=True, slots=True)
class OfflineRun:
    batch: int
    mode: str
    busy: bool
    step_s: float  # median decode step
    thread_cpu_s: float  # per step: CPU time of the step thread (thread 0 of the team)
    run_delay_s: float  # per step: the step thread runnable but not running
    on_busy_cpu: float  # share of steps after which the step thread was on the busy CPU
    active: int  # team threads the last step ran (0: the whole team, never narrowed)
    foreign_cpus: float  # CPUs other processes took in the last sampling period
    load: float  # 1-minute load average at the end


def _thread_sched() -> tuple[int, int]:
    """(the calling thread's run delay in ns, the CPU it last ran on); (0, -1) off Linux."""
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
            delay = int(f.read().split()[1])
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return 0, -1
    return delay, cpu


def _offline_engine(args: argparse.Namespace) -> tuple[Any, LLMEngine, int, int]:
    """What both offline comparisons step: (the C++ ops, an engine on them, the team's
    threads, the CPU the busy process is pinned to)."""
    import torch  # before the engine, as the server does

    from engine.llm import LLM
    from kernels import cpu as cpu_kernels

    ops = cpu_kernels.load()
    if ops is None:
        raise SystemExit("error: --offline needs the C++ CPU kernels")
    llm = LLM(args.model, attention_backend="cpu", device="cpu", dtype="float32")
    return ops, llm.engine, torch.get_num_threads(), sorted(os.sched_getaffinity(0))[-1]


def _mode_threads(mode: str, threads: int) -> int:
    """set_stack_active_threads' argument for an OFFLINE_MODES mode (0: contention.h decides)."""
    return {"team": threads, "solo": 1}.get(mode, 0)


def _alternate(
    args: argparse.Namespace,
    sizes: list[int],
    one: Callable[[int, str, bool], RunT],
    describe: Callable[[RunT], str],
) -> list[RunT]:
    """args.rounds rounds of every size x mode, alone then beside the busy process, each run
    printed as it ends: alternating, so a drift in the machine's load falls on every mode."""
    runs = []
    for _ in range(args.rounds):
        for size in sizes:
            for mode in args.modes:
                for busy in (False, True):
                    run = one(size, mode, busy)
                    print(describe(run), flush=True)
                    runs.append(run)
    return runs


def offline(args: argparse.Namespace) -> list[OfflineRun]:
    """Alternating rounds of decode steps in this process (module docstring)."""
    from scheduler.request import SamplingParams

    ops, engine, threads, busy_cpu = _offline_engine(args)
    vocab = engine.model_config.vocab_size
    serial = 0

    def set_mode(mode: str) -> None:
        ops.set_stack_active_threads(_mode_threads(mode, threads))

    def one(batch: int, mode: str, busy: bool) -> OfflineRun:
        nonlocal serial
        # Enough tokens for the warm-up (at most WARM_STEPS) and the timed steps.
        params = SamplingParams(
            max_tokens=WARM_STEPS + args.steps + 8, temperature=0.0, ignore_eos=True
        )
        ids = []
        for _ in range(batch):
            serial += 1
            prompt = [(1000 + 7 * j + 13 * serial) % vocab for j in range(args.prompt_tokens)]
            ids.append(f"offline-{serial}")
            engine.add_request(ids[-1], prompt, params)
        while True:  # the prefills, until a step decodes only
            engine.step()
            stats = engine.last_step_stats
            if stats is not None and stats.num_prefill_tokens == 0:
                break
        set_mode(mode)
        times = []
        cpus = []
        with busy_process(busy_cpu) if busy else contextlib.nullcontext():
            # Long enough for contention.h to take two samples (200 ms apart) and settle.
            warm_until = time.perf_counter() + 0.6
            for _ in range(WARM_STEPS):
                engine.step()
                if time.perf_counter() >= warm_until:
                    break
            delay0, _ = _thread_sched()
            cpu0 = time.thread_time()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
                cpus.append(_thread_sched()[1])
            thread_cpu = (time.thread_time() - cpu0) / args.steps
            delay1, _ = _thread_sched()
            active, foreign, _, _ = ops.stack_contention_read().tolist()
        set_mode("adapt")
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        return OfflineRun(
            batch=batch,
            mode=mode,
            busy=busy,
            step_s=statistics.median(times),
            thread_cpu_s=thread_cpu,
            run_delay_s=(delay1 - delay0) * 1e-9 / args.steps,
            on_busy_cpu=sum(c == busy_cpu for c in cpus) / len(cpus),
            active=int(active),
            foreign_cpus=foreign,
            load=os.getloadavg()[0],
        )

    return _alternate(args, args.batches, one, lambda run: format_offline(run, busy_cpu))


@dataclass(frozen=True, slots=True)
class PrefillRun:
    tokens: int  # prompt tokens a step
    mode: str
    busy: bool
    step_s: float  # median prefill step
    process_cpu_s: float  # per step: this process's CPU time (every thread)
    thread_cpu_s: float  # per step: the step thread's
    active: int  # threads the last step ran (contention.h; 0: none asked yet)
    foreign_cpus: float  # CPUs other processes took in the last sampling period
    load: float  # 1-minute load average at the end

    @property
    def tok_s(self) -> float:
        return self.tokens / self.step_s


def offline_prefill(args: argparse.Namespace) -> list[PrefillRun]:
    """Alternating rounds of prefill steps in this process (module docstring)."""
    from scheduler.request import SamplingParams

    ops, engine, threads, busy_cpu = _offline_engine(args)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    serial = 0

    def prefill(tokens: int) -> float:
        """One prompt's prefill (its one step); the step's wall time."""
        nonlocal serial
        serial += 1
        prompt = [(1000 + 7 * j + 13 * serial) % vocab for j in range(tokens)]
        engine.add_request(f"prefill-{serial}", prompt, params)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        while engine.has_unfinished_requests():  # a prompt over the step's token budget
            engine.step()
        return elapsed

    def one(tokens: int, mode: str, busy: bool) -> PrefillRun:
        ops.set_stack_active_threads(_mode_threads(mode, threads))
        times = []
        with busy_process(busy_cpu) if busy else contextlib.nullcontext():
            # contention.h samples every 200 ms of steps, at a step's start: at least two
            # steps (the second's sample spans the first, here) before the timed ones.
            warm_until = time.perf_counter() + 0.6
            for warm in itertools.count():
                if warm >= 2 and time.perf_counter() >= warm_until:
                    break
                prefill(tokens)
            cpu0, thread0 = time.process_time(), time.thread_time()
            for _ in range(args.steps):
                times.append(prefill(tokens))
            process_cpu = (time.process_time() - cpu0) / args.steps
            thread_cpu = (time.thread_time() - thread0) / args.steps
            active, foreign, _, _ = ops.stack_contention_read().tolist()
        ops.set_stack_active_threads(0)
        return PrefillRun(
            tokens=tokens,
            mode=mode,
            busy=busy,
            step_s=statistics.median(times),
            process_cpu_s=process_cpu,
            thread_cpu_s=thread_cpu,
            active=int(active),
            foreign_cpus=foreign,
            load=os.getloadavg()[0],
        )

    return _alternate(args, args.prefill_tokens, one, lambda run: format_prefill(run, busy_cpu))


def format_prefill(r: PrefillRun, busy_cpu: int) -> str:
    where = f"beside a busy process on CPU {busy_cpu}" if r.busy else "alone"
    return (
        f"prefill {r.tokens:<4} {r.mode:<6} {where:<34} step {r.step_s * 1e3:7.1f} ms "
        f"({r.tok_s:6.0f} tok/s)  process CPU {r.process_cpu_s * 1e3:7.1f} ms/step  "
        f"thread 0 CPU {r.thread_cpu_s * 1e3:7.1f} ms/step  team threads {r.active or 'all'}  "
        f"others {r.foreign_cpus:.2f} CPUs  load {r.load:.1f}"
    )


def prefill_summary(runs: list[PrefillRun]) -> list[str]:
    """Per prompt length and mode: the median step alone and beside the busy process, and
    the throughput each gives."""
    lines = []
    for tokens in dict.fromkeys(r.tokens for r in runs):
        for mode in dict.fromkeys(r.mode for r in runs):
            alone = [r for r in runs if (r.tokens, r.mode, r.busy) == (tokens, mode, False)]
            busy = [r for r in runs if (r.tokens, r.mode, r.busy) == (tokens, mode, True)]
            if not alone or not busy:
                continue
            a = statistics.median(r.step_s for r in alone)
            b = statistics.median(r.step_s for r in busy)
            cpu_a = statistics.median(r.process_cpu_s for r in alone)
            cpu_b = statistics.median(r.process_cpu_s for r in busy)
            lines.append(
                f"prefill {tokens:<4} {mode:<6} alone {a * 1e3:7.1f} ms ({tokens / a:5.0f} tok/s), "
                f"beside a busy process {b * 1e3:7.1f} ms ({tokens / b:5.0f} tok/s): {b / a:.2f}x  "
                f"(process CPU ms/step {cpu_a * 1e3:.1f} / {cpu_b * 1e3:.1f})"
            )
    return lines


def format_offline(r: OfflineRun, busy_cpu: int) -> str:
    where = f"beside a busy process on CPU {busy_cpu}" if r.busy else "alone"
    return (
        f"batch {r.batch:<3} {r.mode:<6} {where:<34} step {r.step_s * 1e3:7.2f} ms  "
        f"thread 0 CPU {r.thread_cpu_s * 1e3:6.2f} ms/step  "
        f"run delay {r.run_delay_s * 1e3:6.2f} ms/step  on CPU {busy_cpu} {r.on_busy_cpu:4.0%}  "
        f"team threads {r.active or 'all'}  others {r.foreign_cpus:.2f} CPUs  load {r.load:.1f}"
    )


def offline_summary(runs: list[OfflineRun]) -> list[str]:
    """Per batch and mode: the median step alone and beside the busy process, and the ratio."""
    lines = []
    for batch in dict.fromkeys(r.batch for r in runs):
        for mode in dict.fromkeys(r.mode for r in runs):
            alone = [r.step_s for r in runs if (r.batch, r.mode, r.busy) == (batch, mode, False)]
            busy = [r.step_s for r in runs if (r.batch, r.mode, r.busy) == (batch, mode, True)]
            if not alone or not busy:
                continue
            a, b = statistics.median(alone), statistics.median(busy)
            lines.append(
                f"batch {batch:<3} {mode:<6} step alone {a * 1e3:7.2f} ms, beside a busy process "
                f"{b * 1e3:7.2f} ms: {b / a:.2f}x  (runs: "
                + " ".join(f"{x * 1e3:.2f}" for x in alone)
                + " / "
                + " ".join(f"{x * 1e3:.2f}" for x in busy)
                + ")"
            )
    return lines


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
    offline_args = parser.add_argument_group("--offline: engine steps in this process")
    offline_args.add_argument("--offline", action="store_true")
    offline_args.add_argument("--model", default="default")
    offline_args.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    offline_args.add_argument(
        "--modes", nargs="+", choices=OFFLINE_MODES, default=list(OFFLINE_MODES)
    )
    offline_args.add_argument("--rounds", type=int, default=3)
    offline_args.add_argument(
        "--steps", type=int, help="timed steps a run (default 40; with --prefill 5)"
    )
    offline_args.add_argument(
        "--prefill", action="store_true", help="time prefill steps, not decode steps"
    )
    offline_args.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="+",
        default=[128, 512],
        help="--prefill: prompt lengths (default 128 512)",
    )
    args = parser.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        print("error: this needs os.sched_setaffinity (Linux)", file=sys.stderr)
        return 2
    if args.steps is None:
        args.steps = 5 if args.prefill else 40
    if args.offline and args.prefill:
        prefill_runs = offline_prefill(args)
        print(f"\n{cpu_model_name()}, {len(os.sched_getaffinity(0))} CPUs, commit {git_commit()}")
        for line in prefill_summary(prefill_runs):
            print(line)
        if args.json:
            record = {
                "machine": cpu_model_name(),
                "prefill_runs": [asdict(r) for r in prefill_runs],
            }
            args.json.write_text(json.dumps(record, indent=2) + "\n")
        return 0
    if args.offline:
        runs = offline(args)
        print(f"\n{cpu_model_name()}, {len(os.sched_getaffinity(0))} CPUs, commit {git_commit()}")
        for line in offline_summary(runs):
            print(line)
        if args.json:
            record = {"machine": cpu_model_name(), "runs": [asdict(r) for r in runs]}
            args.json.write_text(json.dumps(record, indent=2) + "\n")
        return 0
    with tempfile.TemporaryDirectory(prefix="pagedserve-contention-") as tmp:
        points = measure(args, Path(tmp))
    cpus = len(os.sched_getaffinity(0))
    head = f"{cpu_model_name()}, {cpus} CPUs, commit {git_commit(args.server_cwd)}"
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
