"""``python -m loadtest {run,compare,report}``: the load generator's command line.

``main(argv)`` returns an exit code and never calls ``sys.exit`` itself, so tests (and
``pagedserve bench``, which may delegate here) can call it directly. The flags themselves are
declared in ``loadtest/cli_args.py``; this module runs the command they select and prints
its results.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx

from loadtest.cli_args import build_parser
from loadtest.compare import DEFAULT_MODES, CompareConfig, Mode, run_compare
from loadtest.compare_report import compare_table
from loadtest.config import LoadTestConfig
from loadtest.plots import matplotlib_available, plot_sweep
from loadtest.report import sweep_table
from loadtest.run import PointResult, load_result, run_sweep, write_result
from loadtest.stats import SLO


def _slo(args: argparse.Namespace) -> SLO:
    return SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, e2e_s=args.slo_e2e)


def _run(args: argparse.Namespace) -> int:
    config = LoadTestConfig(
        base_url=args.base_url,
        model=args.model,
        concurrencies=args.concurrency or (),
        request_rates=args.request_rate or (),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        trace_path=args.trace,
        trace_time_scale=args.trace_time_scale,
        num_requests=args.num_requests,
        duration_limit_s=args.duration_limit,
        drain_timeout_s=args.drain_timeout,
        prompt_len=args.prompt_len_dist,
        output_len=args.output_len_dist,
        workload=args.workload,
        shared_prefix_len=args.shared_prefix_len,
        num_prefixes=args.num_prefixes,
        cancel_fraction=args.cancel_fraction,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        slo=_slo(args),
        warmup_requests=args.warmup_requests,
        calibrate_tokens=not args.no_tokenize,
        scrape_metrics=not args.no_metrics,
        metrics_interval_s=args.metrics_interval,
        progress=not args.no_progress,
    )

    if args.out:
        _check_writable(Path(args.out))

    def on_point(point: PointResult) -> None:
        # One line per finished point on stderr, so a long sweep shows where it is.
        s = point.summary
        ttft = "-" if s.ttft_p50_s is None else f"{s.ttft_p50_s:.3f}s"
        print(
            f"[loadtest] {point.point.label}: {s.num_completed}/{s.num_requests} ok, "
            f"{s.output_throughput_tok_s:.1f} tok/s, TTFT p50 {ttft}, errors {s.num_errors}",
            file=sys.stderr,
            flush=True,
        )

    result = run_sweep(config, on_point).to_json()
    print(sweep_table(result))
    if args.out:
        path = write_result(result, args.out)
        print(f"wrote {path}")
        if not args.no_plots:
            _plot(result, path)
    return 0


def _check_writable(path: Path) -> None:
    """Fail before a sweep, not after it, where its ``--out`` cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create its folder ({exc.strerror})") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"--out {path}: not a file this user can write")


def _plot(result: dict[str, Any], path: Path) -> None:
    if not matplotlib_available():
        print("note: matplotlib is not installed, no plots (pip install matplotlib)")
        return
    for png in plot_sweep(result, path.with_suffix("")):
        print(f"wrote {png}")


def _modes(args: argparse.Namespace) -> tuple[Mode, ...]:
    known = {m.name: m for m in DEFAULT_MODES}
    custom: list[str] = []
    for item in args.mode:
        name, sep, mode_args = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--mode takes NAME=ARGS, got {item!r}")
        known[name] = Mode(name, mode_args)
        custom.append(name)
    if args.modes:
        names = [n.strip() for n in args.modes.split(",") if n.strip()]
    else:
        names = custom or [m.name for m in DEFAULT_MODES]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; define them with --mode NAME=ARGS")
    return tuple(known[n] for n in names)


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    modes = _modes(args)
    baseline = args.baseline
    if baseline not in {m.name for m in modes}:
        # e.g. `--mode vllm=... --mode ours=...`: the first mode listed is the reference.
        baseline = modes[0].name
        print(
            f"note: baseline {args.baseline!r} is not among the modes; using {baseline!r}",
            file=sys.stderr,
        )
    config = CompareConfig(
        modes=modes,
        baseline=baseline,
        server_cmd=args.server_cmd,
        max_num_seqs=args.max_num_seqs,
        batch_wait_ms=args.batch_wait_ms,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        low_load_num_requests=args.low_load_num_requests,
        load=args.load,
        low_load=args.low_load,
        request_rate=args.request_rate,
        low_request_rate=args.low_request_rate,
        out=args.out or "",
        model=args.model,
        prompt_len=args.prompt_len_dist,
        output_len=args.output_len_dist,
        seed=args.seed,
        slo=_slo(args),
        ignore_eos=not args.no_ignore_eos,
        duration_limit_s=args.duration_limit,
        drain_timeout_s=args.drain_timeout,
        warmup_requests=args.warmup_requests,
        startup_timeout_s=args.startup_timeout,
        progress=not args.no_progress,
        invocation=shlex.join(["python", "-m", "loadtest", *argv]),
    )
    result = run_compare(config)
    print(compare_table(result))
    print(f"wrote {result['markdown']}")
    for png in result["plots"]:
        print(f"wrote {png}")  # (without matplotlib, run_compare has said so on stderr)
    failed = [m["name"] for m in result["modes"] if m["error"]]
    if failed:
        print(
            f"error: mode(s) {failed} failed; see the result JSON and their server logs",
            file=sys.stderr,
        )
        return 1
    return 0


def _report(args: argparse.Namespace) -> int:
    result = load_result(args.path)
    try:
        table = compare_table(result) if result["kind"] == "compare" else sweep_table(result)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:  # a field lost or mangled
        raise ValueError(
            f"{args.path} is not a whole {result['kind']} result "
            f"({type(exc).__name__}: {exc}): write it again with the command that made it"
        ) from None
    print(table)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m loadtest") -> int:
    """Entry point; returns the process exit code. ``prog`` names the command in usage
    lines."""
    parser = build_parser(prog)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "compare":
            return _compare(args, argv)
        return _report(args)
    except httpx.HTTPStatusError as exc:  # httpx's text adds a second line, a docs link
        response = exc.response
        hint = " (it needs an API key: --api-key KEY)" if response.status_code == 401 else ""
        status = f"HTTP {response.status_code} {response.reason_phrase}"
        print(f"error: {exc.request.method} {exc.request.url} answered {status}{hint}",
              file=sys.stderr)  # fmt: skip
        return 2
    except (ValueError, RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
