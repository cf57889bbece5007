"""Start an OpenAI-compatible server, drive it at each concurrency, read its metrics.

The same load generator (``loadtest.run.run_sweep``, HTTP only) drives pagedserve and vLLM,
one sweep per concurrency so that each point's metrics are "after the point minus before it".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.config import LoadTestConfig
from loadtest.launcher import ServerProcess, build_command, free_port
from loadtest.run import run_sweep
from planner.measured import Histogram

_PHASE_LABEL = re.compile(r'phase="([^"]*)"')


def phase_seconds(metrics: Mapping[str, float]) -> dict[str, float]:
    """Seconds per step phase from a scrape: ``{"forward": ..., "schedule": ..., ...}``.

    Accepts a counter (``*_total``) or a histogram's ``*_sum`` whose name contains "phase"
    and that carries a ``phase`` label; buckets, counts and ``_created`` stamps are skipped.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = key.split("{", 1)[0]
        if "phase" not in name or not name.endswith(("_total", "_sum")):
            continue
        match = _PHASE_LABEL.search(key)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def overhead_fraction(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> float | None:
    """Fraction of engine step time spent outside the model forward between two scrapes.

    Returns:
        None when the server exports no per-phase step time (or no step ran).
    """
    if not before or not after:
        return None
    start, end = phase_seconds(before), phase_seconds(after)
    delta = {phase: end[phase] - start.get(phase, 0.0) for phase in end}
    total = sum(delta.values())
    if "forward" not in delta or total <= 0:
        return None
    return 1.0 - delta["forward"] / total


def server_mbu(
    after: Mapping[str, float] | None, during: Sequence[Mapping[str, float]] = ()
) -> float | None:
    """The server's own MBU gauge (its last step's figure) as a dashboard shows it over the
    point: the median of the scrapes taken during the point, or the one after it when there
    were fewer than 3. A single read is one step, the point's last, which shares the cores
    with the end of every stream, and reads well below what the point's TPOT implies."""

    def gauge(metrics: Mapping[str, float] | None) -> float | None:
        for key, value in (metrics or {}).items():
            name = key.split("{", 1)[0].lower()
            if "mbu" in name and "smooth" not in name:
                return value
        return None

    values = sorted(v for v in map(gauge, during) if v is not None)
    if len(values) >= 3:
        return values[len(values) // 2]
    return gauge(after)


def _series(metrics: Mapping[str, float] | None, name: str) -> float | None:
    """The value of the first series of metric ``name`` in a scrape, or None."""
    for key, value in (metrics or {}).items():
        if key.split("{", 1)[0] == name:
            return value
    return None


def server_peak_bandwidth(metrics: Mapping[str, float] | None) -> float | None:
    """The peak bandwidth (bytes/s) the server's MBU gauge divides by, if it exports it."""
    return _series(metrics, "pagedserve_peak_bandwidth_bytes_per_second")


ITL_METRIC = "pagedserve_inter_token_latency_seconds"
TTFT_METRIC = "pagedserve_time_to_first_token_seconds"


def server_histogram_quantile(
    before: Mapping[str, float] | None,
    after: Mapping[str, float] | None,
    name: str,
    q: float,
) -> float | None:
    """The ``q`` quantile of histogram ``name`` over what was observed between two scrapes
    (PromQL's ``histogram_quantile``, ``planner.measured.Histogram``); None when nothing was
    observed (or the server does not export it)."""
    end = Histogram.from_samples(after, name)
    return end.minus(Histogram.from_samples(before, name)).quantile(q) if end else None


def server_decode_bytes(metrics: Mapping[str, float] | None) -> float | None:
    """Weight bytes the server says a one-token decode step reads, if it exports that."""
    return _series(metrics, "pagedserve_decode_step_weight_bytes")


# The concurrency-1 point is run again (at most this many times in all) while the bandwidth
# probed right before and right after it differs by more than STEADY_SPREAD: the machine's
# bandwidth can move between a slow and a fast level (the fast one nearly twice the slow)
# from one minute to the next, and a point that straddles a change has no single floor to be
# judged by. Either probe alone would flatter or wrong it.
STEADY_ATTEMPTS = 3
STEADY_SPREAD = 0.15


def steady(probes: Sequence[float]) -> bool:
    """Whether bandwidth probes agree within STEADY_SPREAD of the higher one."""
    return bool(probes) and min(probes) >= (1 - STEADY_SPREAD) * max(probes)


def measure_server(
    name: str,
    cmd: str,
    model_dir: Path,
    concurrencies: list[int],
    prompt_tokens: int,
    output_tokens: int,
    num_requests: int,
    log_dir: Path,
    startup_timeout_s: float,
    probe_bandwidth: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Launch ``cmd`` on a free port of 127.0.0.1 and run one closed-loop point per concurrency.

    Args:
        probe_bandwidth: if given, the memory bandwidth is probed with it (bytes/s) right
            before and right after the concurrency-1 point, while the server idles: the
            bandwidth this machine gives moves by tens of percent from minute to minute
            (other tenants), so the batch-1 floor is read beside the point it judges. A
            point whose two probes disagree (``steady``) is run again, up to
            ``STEADY_ATTEMPTS`` times in all; the last run is kept.

    Returns:
        ``{"startup_s": ..., "points": {"<c>": row}}``; a row holds the latency percentiles,
        throughput and token counts of the point, and the server's MBU and step overhead
        when its ``/metrics`` has them; the concurrency-1 row also ``bandwidth_probes_bytes_s``
        (before, after), ``bandwidth_bytes_s`` (the higher), ``bandwidth_steady`` (whether
        they agree) and ``bandwidth_attempts`` (runs of the point) when probed.
    """
    port = free_port()
    argv = build_command(cmd, port=port, host="127.0.0.1", model_dir=str(model_dir))
    server = ServerProcess(argv, port, log_dir / f"{name}.log")
    print(f"starting {name}: {' '.join(argv)} (log: {server.log_path})", flush=True)
    server.start()
    try:
        startup_s = server.wait_healthy(timeout_s=startup_timeout_s)
        print(f"{name} healthy after {startup_s:.0f}s", flush=True)
        points: dict[str, Any] = {}
        for c in concurrencies:
            probe = probe_bandwidth if c == 1 else None
            config = LoadTestConfig(
                base_url=server.base_url,
                concurrencies=(c,),
                num_requests=max(num_requests, 2 * c),
                prompt_len=f"fixed:{prompt_tokens}",
                output_len=f"fixed:{output_tokens}",
                ignore_eos=True,
                temperature=0.0,
                progress=False,
                warmup_requests=2,
                # The MBU gauge is one step's figure, read by each scrape: at the load
                # generator's 2 s a c=1 point of a few seconds gets 3 scrapes, and their
                # median swung widely between runs of the same code at the same TPOT.
                metrics_interval_s=0.5,
            )
            attempts = STEADY_ATTEMPTS if probe is not None else 1
            for attempt in range(1, attempts + 1):
                probes = [probe()] if probe is not None else []
                # Prompts no earlier point or attempt sent to this server: a prefix cache
                # would answer repeated ones without their prefills, and TTFT would measure
                # cache hits.
                sweep = run_sweep(replace(config, prompt_salt=f"c{c}-attempt{attempt}"))
                if probe is not None:
                    probes.append(probe())
                if not probes or steady(probes):
                    break
                moved = " -> ".join(f"{b / 1e9:.1f}" for b in probes)
                again = "; measuring it again" if attempt < STEADY_ATTEMPTS else "; keeping it"
                print(
                    f"{name} c={c}: bandwidth moved during the point ({moved} GB/s){again}",
                    flush=True,
                )
            point = sweep.points[0]
            s = point.summary
            if s.num_errors:
                print(f"WARNING: {name} c={c}: {s.num_errors} requests failed", flush=True)
            points[str(c)] = {
                "ttft_p50_s": s.ttft_p50_s,
                "tpot_p50_s": s.tpot_p50_s,
                "itl_p50_s": s.itl_p50_s,
                "itl_p99_s": s.itl_p99_s,
                # The server's own inter-token histogram: token arrivals from the engine,
                # before the detokenizer holds any back (random weights pick many tokens that
                # are not text on their own, so client-side gaps then span several steps).
                "server_itl_p50_s": server_histogram_quantile(
                    sweep.metrics_before, point.server_metrics_after, ITL_METRIC, 0.5
                ),
                "server_itl_p99_s": server_histogram_quantile(
                    sweep.metrics_before, point.server_metrics_after, ITL_METRIC, 0.99
                ),
                # ... and its time to first token, arrival to the first token from the
                # engine: what the client's TTFT adds to it is the HTTP path's and its own.
                "server_ttft_p50_s": server_histogram_quantile(
                    sweep.metrics_before, point.server_metrics_after, TTFT_METRIC, 0.5
                ),
                "output_tok_s": s.output_throughput_tok_s,
                "num_completed": s.num_completed,
                "num_errors": s.num_errors,
                "duration_s": s.duration_s,
                "mean_prompt_tokens": s.mean_prompt_tokens,
                "mean_output_tokens": s.mean_output_tokens,
                "server_mbu": server_mbu(point.server_metrics_after, point.server_metrics_during),
                "server_peak_bandwidth_bytes_s": server_peak_bandwidth(point.server_metrics_after),
                "decode_weight_bytes": server_decode_bytes(point.server_metrics_after),
                "overhead_fraction": overhead_fraction(
                    sweep.metrics_before, point.server_metrics_after
                ),
            }
            if probes:
                points[str(c)]["bandwidth_probes_bytes_s"] = probes
                points[str(c)]["bandwidth_bytes_s"] = max(probes)
                points[str(c)]["bandwidth_steady"] = steady(probes)
                points[str(c)]["bandwidth_attempts"] = attempt
            beside = f" (bandwidth beside it {max(probes) / 1e9:.1f} GB/s)" if probes else ""
            print(f"{name} c={c}: {s.output_throughput_tok_s:.1f} tok/s{beside}", flush=True)
        return {"startup_s": startup_s, "points": points}
    finally:
        server.stop()
