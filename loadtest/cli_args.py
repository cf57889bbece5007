"""The argument parser of ``python -m loadtest {run,compare,report}``: every flag, its
default and its help, and the small value parsers they use. ``loadtest/cli.py`` turns the
parsed namespace into a run, a comparison or a report.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NoReturn

from loadtest.compare import DEFAULT_MODES, DEFAULT_SERVER_CMD

# The value parsers raise ArgumentTypeError with the accepted form: argparse would turn a
# ValueError into "invalid _int_list value".


def _int_list(text: str) -> tuple[int, ...]:
    """``1,4,16``: positive integers (concurrency levels)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,4,16, got {text!r}"
        )
    return values


def _rate_list(text: str) -> tuple[float, ...]:
    """``0.5,1,inf``: positive request rates in requests a second (inf: all at once)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or not all(v > 0 for v in values):  # nan fails too
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive rates such as 0.5,1,inf, got {text!r}"
        )
    return values


def _optional_float(text: str) -> float | None:
    """Seconds, or none/off (no such SLO)."""
    if text.lower() in ("none", "off", ""):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or none, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object (merged into every request body)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--model",
        default=None,
        help="model name sent with requests (default: first of GET /v1/models)",
    )
    g.add_argument(
        "--prompt-len-dist",
        default="uniform:64:192",
        help="prompt tokens: N | uniform:LO:HI | exponential:MEAN[:MAX] | "
        "lognormal:MEDIAN:SIGMA[:MAX] (default %(default)s)",
    )
    g.add_argument(
        "--output-len-dist",
        default="exponential:64:384",
        help="max_tokens distribution, same syntax (default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject it)",
    )
    g.add_argument(
        "--duration-limit",
        type=float,
        default=300.0,
        help="seconds per point after which no new request is sent",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds in-flight requests may run past the duration limit",
    )
    s = p.add_argument_group("SLOs for goodput ('none' disables one)")
    s.add_argument("--slo-ttft", type=_optional_float, default=2.0, help="seconds (default 2)")
    s.add_argument("--slo-tpot", type=_optional_float, default=0.2, help="seconds (default 0.2)")
    s.add_argument("--slo-e2e", type=_optional_float, default=None, help="seconds (default none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class _OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line naming it and where ``--help`` is, not the
    usage block above it. The subcommands' parsers are of this class too (argparse makes
    them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help says more)\n")


def build_parser(prog: str = "python -m loadtest") -> argparse.ArgumentParser:
    """The parser; ``prog`` is the command the usage lines name (``pagedserve bench`` when
    run through the console script)."""
    parser = _OneLineParser(
        prog=prog,
        description="Load generator for OpenAI-compatible servers (HTTP only).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="sweep concurrency or request rate against a server")
    run.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root")
    mode = run.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=_int_list, help="closed loop, e.g. 1,4,16")
    mode.add_argument(
        "--request-rate",
        type=_rate_list,
        help="open loop in req/s, e.g. 0.5,1,2 (inf: all at once)",
    )
    mode.add_argument(
        "--trace", help="replay a JSONL trace (arrival_s, prompt|prompt_len, max_tokens)"
    )
    run.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier",
    )
    run.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="client-side cap on in-flight requests in open loop",
    )
    run.add_argument(
        "--trace-time-scale", type=float, default=1.0, help="replay speed-up (2 = twice as fast)"
    )
    run.add_argument("--num-requests", type=int, default=100, help="requests per point")
    run.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of a shared system prompt in front of every prompt",
    )
    run.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    run.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.0,
        help="fraction of requests abandoned mid-stream",
    )
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        help="JSON object merged into every request body",
    )
    run.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    run.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a connection or the next chunk",
    )
    run.add_argument(
        "--warmup-requests", type=int, default=1, help="unrecorded short requests before the sweep"
    )
    run.add_argument(
        "--no-tokenize",
        action="store_true",
        help="do not calibrate prompt length with the server's /tokenize",
    )
    run.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    run.add_argument(
        "--metrics-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="also scrape /metrics every S seconds during a point (0: only before and after)",
    )
    run.add_argument("--out", default=None, help="result JSON path (plots go beside it)")
    run.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    _add_workload_args(run)
    run.add_argument(
        "--workload",
        choices=("synthetic", "grounded"),
        default="synthetic",
        help="synthetic: random words of --prompt-len-dist tokens; grounded: copy a passage "
        "of Python's documentation (output repeats the prompt: speculative decoding's "
        "prompt-lookup case)",
    )

    cmp = sub.add_parser("compare", help="start a server in each batching mode and compare")
    cmp.add_argument(
        "--server-cmd",
        default=DEFAULT_SERVER_CMD,
        help="launch template; placeholders {host} {port} {max_num_seqs} "
        "{mode_args} {batch_wait_ms} (default: %(default)s)",
    )
    cmp.add_argument(
        "--modes",
        default=None,
        help="comma list of mode names to run (default: "
        + ",".join(m.name for m in DEFAULT_MODES)
        + ")",
    )
    cmp.add_argument(
        "--mode",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="define a mode: ARGS fill {mode_args} (repeatable)",
    )
    cmp.add_argument("--baseline", default="static", help="mode ratios are taken against")
    cmp.add_argument("--max-num-seqs", type=int, default=16)
    cmp.add_argument("--batch-wait-ms", type=float, default=100.0)
    cmp.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed-loop concurrency (default: --max-num-seqs)",
    )
    cmp.add_argument(
        "--num-requests",
        type=int,
        default=64,
        help="requests in the closed-loop and at-capacity scenarios",
    )
    cmp.add_argument("--low-load-num-requests", type=int, default=16)
    cmp.add_argument(
        "--load",
        type=float,
        default=1.0,
        help="open-loop rate as a multiple of the baseline's capacity",
    )
    cmp.add_argument(
        "--low-load",
        type=float,
        default=0.2,
        help="low-load rate as a multiple of the baseline's capacity",
    )
    cmp.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="explicit open-loop rate (req/s) instead of --load",
    )
    cmp.add_argument(
        "--low-request-rate",
        type=float,
        default=None,
        help="explicit low-load rate (req/s) instead of --low-load",
    )
    cmp.add_argument("--warmup-requests", type=int, default=2, help="per server start")
    cmp.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds a server may take to answer /health",
    )
    cmp.add_argument("--out", default=None, help="result JSON (default results/compare-*.json)")
    _add_workload_args(cmp)

    rep = sub.add_parser("report", help="print the table of a saved result JSON")
    rep.add_argument("path")
    return parser
