"""The batching-mode comparison: one seeded workload against a server in each mode.

For each mode, ``compare`` starts the server itself on 127.0.0.1 (``--server-cmd``, a
template), waits for ``GET /health`` to answer 200, runs the scenarios, and stops it. The
baseline mode (static by default) runs first, because its measured capacity sets the open-loop
rates every mode then receives:

1. ``closed-c{C}``: closed loop at concurrency C (default ``max_num_seqs``): capacity.
2. ``poisson-capacity``: Poisson arrivals at ``load`` x the baseline's closed-loop request
   throughput (default 1.0: right at static's capacity, where queueing shows).
3. ``poisson-low``: Poisson arrivals at ``low_load`` x that capacity (default 0.2): the light
   load where a short dynamic-batching window costs little.

Every figure is compared with the baseline: output-token throughput (x higher), p50 TTFT
(x lower) and goodput (x higher). Time is bounded: each scenario stops sending after
``duration_limit_s`` and cancels what is left ``drain_timeout_s`` later, and each server gets
``startup_timeout_s`` to become healthy.
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.compare_report import compare_markdown, comparison_rows
from loadtest.config import LoadTestConfig
from loadtest.launcher import HOST, ServerProcess, build_command, free_port
from loadtest.plots import matplotlib_available, plot_compare
from loadtest.run import SCHEMA_VERSION, run_sweep, write_result
from loadtest.stats import SLO

DEFAULT_SERVER_CMD = (
    "pagedserve serve --host {host} --port {port} --max-num-seqs {max_num_seqs} {mode_args}"
)


@dataclass(frozen=True, slots=True)
class Mode:
    """A named server configuration: ``args`` fills ``{mode_args}`` of the command template
    (itself a template: ``{batch_wait_ms}`` and ``{max_num_seqs}`` are filled in)."""

    name: str
    args: str


DEFAULT_MODES: tuple[Mode, ...] = (
    Mode("static", "--batching static"),
    Mode("static-skip", "--batching static --static-finished skip"),
    Mode("dynamic", "--batching dynamic --batch-wait-ms {batch_wait_ms}"),
    Mode("continuous", "--batching continuous"),
)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    kind: str  # "concurrency" | "rate"
    num_requests: int
    concurrency: int | None = None
    request_rate: float | None = None  # None: derived from the baseline's capacity
    load: float | None = None  # the capacity multiple it was derived from

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "num_requests": self.num_requests,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "load": self.load,
        }


@dataclass(frozen=True, slots=True)
class CompareConfig:
    """Args:
    modes: the server configurations, in run order after the baseline.
    baseline: the mode every ratio is taken against; it runs first.
    server_cmd: launch template with {host} {port} {max_num_seqs} {mode_args} {batch_wait_ms}.
    max_num_seqs / batch_wait_ms: passed to the server (same for every mode).
    concurrency: the closed-loop scenario's concurrency (default: max_num_seqs).
    num_requests: requests in the closed-loop and at-capacity scenarios.
    low_load_num_requests: requests in the low-load scenario.
    load / low_load: open-loop rates as multiples of the baseline's measured capacity.
    request_rate / low_request_rate: explicit rates (req/s) instead of derived ones.
    out: result JSON path; the markdown table, plots and server logs go beside it.
    model, prompt_len, output_len, seed, slo, ignore_eos, duration_limit_s,
    drain_timeout_s, warmup_requests: as in ``LoadTestConfig``.
    startup_timeout_s: how long a server may take to answer /health with 200.
    """

    modes: tuple[Mode, ...] = DEFAULT_MODES
    baseline: str = "static"
    server_cmd: str = DEFAULT_SERVER_CMD
    max_num_seqs: int = 16
    batch_wait_ms: float = 100.0
    concurrency: int | None = None
    num_requests: int = 64
    low_load_num_requests: int = 16
    load: float = 1.0
    low_load: float = 0.2
    request_rate: float | None = None
    low_request_rate: float | None = None
    out: str = ""
    model: str | None = None
    prompt_len: str = "uniform:64:192"
    output_len: str = "exponential:64:384"
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    ignore_eos: bool = True
    duration_limit_s: float = 300.0
    drain_timeout_s: float = 60.0
    warmup_requests: int = 2
    startup_timeout_s: float = 600.0
    progress: bool = True
    invocation: str = ""  # the command line that asked for this comparison (for the report)

    def __post_init__(self) -> None:
        names = [m.name for m in self.modes]
        if len(set(names)) != len(names):
            raise ValueError(f"mode names must be unique, got {names}")
        if self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not one of the modes {names}")
        if self.load <= 0 or self.low_load <= 0:
            raise ValueError("load and low_load must be positive")

    def ordered_modes(self) -> list[Mode]:
        """Baseline first (its capacity sets the open-loop rates), then the rest in order."""
        base = [m for m in self.modes if m.name == self.baseline]
        return base + [m for m in self.modes if m.name != self.baseline]

    def scenarios(self, capacity_req_s: float | None) -> list[Scenario]:
        concurrency = self.concurrency or self.max_num_seqs

        def rate(explicit: float | None, load: float) -> float | None:
            if explicit is not None:
                return explicit
            return load * capacity_req_s if capacity_req_s else None

        return [
            Scenario(f"closed-c{concurrency}", "concurrency", self.num_requests, concurrency),
            Scenario(
                "poisson-capacity",
                "rate",
                self.num_requests,
                request_rate=rate(self.request_rate, self.load),
                load=None if self.request_rate is not None else self.load,
            ),
            Scenario(
                "poisson-low",
                "rate",
                self.low_load_num_requests,
                request_rate=rate(self.low_request_rate, self.low_load),
                load=None if self.low_request_rate is not None else self.low_load,
            ),
        ]

    def sweep_config(self, base_url: str, scenario: Scenario, warmup: int) -> LoadTestConfig:
        assert scenario.kind == "concurrency" or scenario.request_rate is not None
        return LoadTestConfig(
            base_url=base_url,
            model=self.model,
            concurrencies=(scenario.concurrency,) if scenario.concurrency else (),
            request_rates=(scenario.request_rate,) if scenario.request_rate else (),
            num_requests=scenario.num_requests,
            duration_limit_s=self.duration_limit_s,
            drain_timeout_s=self.drain_timeout_s,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            slo=self.slo,
            warmup_requests=warmup,
            progress=self.progress,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "modes": [{"name": m.name, "args": m.args} for m in self.modes],
            "baseline": self.baseline,
            "server_cmd": self.server_cmd,
            "max_num_seqs": self.max_num_seqs,
            "batch_wait_ms": self.batch_wait_ms,
            "concurrency": self.concurrency or self.max_num_seqs,
            "num_requests": self.num_requests,
            "low_load_num_requests": self.low_load_num_requests,
            "load": self.load,
            "low_load": self.low_load,
            "request_rate": self.request_rate,
            "low_request_rate": self.low_request_rate,
            "model": self.model,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "seed": self.seed,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s, "e2e_s": self.slo.e2e_s},
            "ignore_eos": self.ignore_eos,
            "duration_limit_s": self.duration_limit_s,
            "drain_timeout_s": self.drain_timeout_s,
            "warmup_requests": self.warmup_requests,
            "startup_timeout_s": self.startup_timeout_s,
            "invocation": self.invocation,
        }


def _log(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


def _run_mode(
    config: CompareConfig, mode: Mode, capacity: float | None, prefix: Path
) -> tuple[dict[str, Any], float | None]:
    """Start the server in ``mode``, run every scenario, stop it.

    Returns:
        The mode's JSON entry, and the capacity (closed-loop req/s) if this is the baseline.
    """
    port = free_port()
    values = {
        "host": HOST,
        "port": port,
        "max_num_seqs": config.max_num_seqs,
        "batch_wait_ms": config.batch_wait_ms,
    }
    mode_args = mode.args.format(**values)
    argv = build_command(config.server_cmd, mode_args=mode_args, **values)
    log_path = prefix.with_name(f"{prefix.name}-{mode.name}.log")
    entry: dict[str, Any] = {
        "name": mode.name,
        "args": mode_args,
        "command": argv,
        "log": str(log_path),
        "startup_s": None,
        "error": None,
        "runs": {},
    }
    _log(f"{mode.name}: starting {' '.join(argv)}")
    with ServerProcess(argv, port, log_path) as server:
        try:
            entry["startup_s"] = server.wait_healthy(config.startup_timeout_s)
        except RuntimeError as exc:
            entry["error"] = str(exc)
            _log(f"{mode.name}: {exc}")
            return entry, capacity
        _log(f"{mode.name}: healthy after {entry['startup_s']:.1f}s on {server.base_url}")
        warmup = config.warmup_requests  # once per server start
        for index in range(len(config.scenarios(capacity))):
            # Re-derived each time: the baseline's closed loop (scenario 0) sets the rates
            # of the open-loop scenarios that follow it in the same server session.
            scenario = config.scenarios(capacity)[index]
            if scenario.kind == "rate" and scenario.request_rate is None:
                _log(f"{mode.name}: skipping {scenario.name}: no baseline capacity measured")
                continue
            try:
                sweep = run_sweep(config.sweep_config(server.base_url, scenario, warmup))
            except (RuntimeError, ValueError, httpx.HTTPError) as exc:
                # e.g. the warm-up failed: keep the other modes' results, report this one.
                entry["error"] = f"{scenario.name}: {type(exc).__name__}: {exc}"
                _log(f"{mode.name}: {entry['error']}")
                return entry, capacity
            result = sweep.to_json()
            warmup = 0
            entry["runs"][scenario.name] = result
            summary = result["points"][0]["summary"]
            _log(
                f"{mode.name}: {scenario.name}: {summary['output_throughput_tok_s']:.1f} tok/s, "
                f"TTFT p50 {summary['ttft_p50_s'] or 0:.3f}s, "
                f"goodput {summary['goodput_req_s']:.3f} req/s, errors {summary['num_errors']}"
            )
            if mode.name == config.baseline and scenario.kind == "concurrency":
                capacity = summary["request_throughput_req_s"] or None
    return entry, capacity


def default_out() -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"results/compare-{stamp}.json"


def run_compare(config: CompareConfig) -> dict[str, Any]:
    """Run the whole comparison; writes JSON, markdown, plots and server logs.

    Returns:
        The result dict (also written to ``config.out``).
    """
    out = Path(config.out or default_out())
    prefix = out.with_suffix("")
    capacity: float | None = None
    modes: list[dict[str, Any]] = []
    for mode in config.ordered_modes():
        entry, capacity = _run_mode(config, mode, capacity, prefix)
        modes.append(entry)
        if mode.name == config.baseline and entry["error"]:
            _log("baseline failed to start; stopping the comparison")
            break
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "compare",
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config.to_json(),
        "baseline": config.baseline,
        "capacity_req_s": capacity,
        "scenarios": [s.to_json() for s in config.scenarios(capacity)],
        "modes": modes,
        "plots": [],
        "markdown": str(prefix.with_name(prefix.name + ".md")),
    }
    result["table"] = comparison_rows(result)
    if matplotlib_available():
        result["plots"] = [str(p) for p in plot_compare(result, prefix)]
    else:
        _log("matplotlib is not installed: no plots (pip install matplotlib)")
    write_result(result, out)
    Path(result["markdown"]).write_text(compare_markdown(result), encoding="utf-8")
    return result
