"""The step-time predictor offline: record real steps once, replay them through the
predictor in seconds, and split its misses into the machine's noise and the model's error.

    python -m benchmarks.step_replay record --out results/steps      # in-process, see below
    python -m benchmarks.step_replay replay results/steps/*.jsonl    # seconds

**record** runs the default model in this process (``LLM``, no HTTP) through the loads of
``benchmarks.latency_targets``, once without a target and once with ``--target-itl-ms``
(default 3 x the untargeted run's median decode-only step at concurrency 64), each engine
writing a step trace (engine/step_trace.py, ``PAGEDSERVE_STEP_TRACE``):

1. closed loop, ``--concurrency`` (64) requests of 128 prompt tokens, 64 output tokens;
2. closed loop at half that concurrency, ``--capacity-requests`` mixed requests (prompts
   uniform 64-1,024 tokens, 64 output tokens): its request rate is the capacity;
3. Poisson arrivals at ``--load`` (80%) of that capacity, ``--poisson-requests`` mixed
   requests (the targeted run reuses the untargeted run's rate).

On the shared 2-core machine at a load average of 7 the two engines took 10 and 6 minutes
(a c=64 decode step 0.5-1 s); a quiet machine runs them about ten times faster.

A server writes the same trace when started with ``PAGEDSERVE_STEP_TRACE`` set (or through
``python -m benchmarks.latency_targets --trace-dir DIR``), HTTP threads and all.

**replay** feeds each trace's steps, in order, to a fresh ``StepTimePredictor`` built from the
trace's header, as the engine does: predict the step from its shape, then observe its
measured time. After ``--warmup`` steps it counts the steps predicted within +-20%, by kind
(decode-only, mixed, prefill-only; small: at most ``SMALL_TOKENS`` tokens, else large), and
prints beside it:

* **noise floor**: the share of steps within +-20% of the median of the other steps of the
  same shape close to them in the trace (same rows, tokens and context to a few percent,
  within ``NOISE_WINDOW`` steps): what even a predictor that knew each shape's typical time
  would miss, because the same work took a different time. Only steps with at least two
  such neighbours count (the "n same" column);
* **bias**: the median measured / predicted ratio (1.00: no systematic error), and the
  median absolute error;
* **live**: where the trace has the live predictor's figures (a targeted engine), the share
  within +-20% of those (same predictor, same steps, so it equals the replay's unless the
  predictor changed since the trace was taken).

The predictor's misses beyond the noise floor are the model's error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.step_predictor import StepShape, StepTimePredictor
from engine.step_trace import ENV as TRACE_ENV
from engine.step_trace import Trace, TracedStep, read_trace
from loadtest.stats import percentile

WITHIN = 0.2
# Steps at the start of a trace not counted (the predictor's warm-up).
WARMUP = 20
SMALL_TOKENS = 32
# Noise floor: steps of the same shape (rows, decode rows equal; tokens and context within
# SHAPE_TOLERANCE) within NOISE_WINDOW steps of each other.
NOISE_WINDOW = 64
SHAPE_TOLERANCE = 0.05
KINDS = ("decode small", "decode large", "mixed small", "mixed large", "prefill small",
         "prefill large")  # fmt: skip


def kind(shape: StepShape) -> str:
    size = "small" if shape.num_tokens <= SMALL_TOKENS else "large"
    if shape.num_prefill_tokens == 0:
        return f"decode {size}"
    if shape.num_decode_rows == 0:
        return f"prefill {size}"
    return f"mixed {size}"


def within(ratio: float) -> bool:
    return abs(ratio - 1.0) <= WITHIN


# ---- replay ---------------------------------------------------------------------------------


def replay(
    trace: Trace,
    make_predictor: Callable[[Trace], Any] | None = None,
) -> list[float | None]:
    """measured / predicted of every step (None where the predictor had nothing yet), the
    predictor seeing the steps in order exactly as the engine feeds it."""
    predictor = (
        make_predictor(trace)
        if make_predictor is not None
        else StepTimePredictor(trace.cost_model, trace.kv_bytes_per_token)
    )
    ratios: list[float | None] = []
    for step in trace.steps:
        features = predictor.shape_features(step.shape)
        predicted = predictor.predict_features(features)
        ratios.append(step.step_s / predicted if predicted else None)
        predictor.observe(features, step.step_s)
    return ratios


def _similar(a: StepShape, b: StepShape) -> bool:
    if a.num_rows != b.num_rows or a.num_decode_rows != b.num_decode_rows:
        return False
    for x, y in ((a.num_tokens, b.num_tokens), (a.num_kv_tokens, b.num_kv_tokens)):
        if abs(x - y) > SHAPE_TOLERANCE * max(x, y):
            return False
    return True


def noise_ratios(steps: Sequence[TracedStep]) -> list[float | None]:
    """Per step: measured / the median measured time of the other steps of its shape within
    ``NOISE_WINDOW`` steps, None with fewer than two such steps."""
    out: list[float | None] = []
    for i, step in enumerate(steps):
        lo, hi = max(0, i - NOISE_WINDOW), min(len(steps), i + NOISE_WINDOW + 1)
        same = [
            steps[j].step_s
            for j in range(lo, hi)
            if j != i and _similar(step.shape, steps[j].shape)
        ]
        out.append(step.step_s / statistics.median(same) if len(same) >= 2 else None)
    return out


@dataclass
class KindFigures:
    steps: int = 0
    predicted: list[float] = field(default_factory=list)
    noise: list[float] = field(default_factory=list)
    live: list[float] = field(default_factory=list)

    def row(self, name: str) -> str:
        def share(values: list[float]) -> str:
            return f"{sum(map(within, values)) / len(values):>7.2f}" if values else f"{'-':>7}"

        bias = f"{statistics.median(self.predicted):>6.2f}" if self.predicted else f"{'-':>6}"
        err = (
            f"{statistics.median(abs(r - 1) for r in self.predicted):>8.2f}"
            if self.predicted
            else f"{'-':>8}"
        )
        return (
            f"{name:<15}{self.steps:>6}{share(self.predicted)}{share(self.live)}"
            f"{share(self.noise)}{len(self.noise):>7}{bias}{err}"
        )


def figures(
    trace: Trace, warmup: int, make_predictor: Callable[[Trace], Any] | None = None
) -> dict[str, KindFigures]:
    """Per kind (and "all"): the replayed, live and noise-floor ratios after ``warmup``."""
    ratios = replay(trace, make_predictor)
    noise = noise_ratios(trace.steps)
    out = {name: KindFigures() for name in ("all", *KINDS)}
    for i, step in enumerate(trace.steps):
        if i < warmup:
            continue
        for name in ("all", kind(step.shape)):
            fig = out[name]
            fig.steps += 1
            if ratios[i] is not None:
                fig.predicted.append(ratios[i])  # type: ignore[arg-type]
            if noise[i] is not None:
                fig.noise.append(noise[i])  # type: ignore[arg-type]
            if step.predicted_s:
                fig.live.append(step.step_s / step.predicted_s)
    return out


def report(path: Path, warmup: int, make_predictor: Callable[[Trace], Any] | None = None) -> str:
    trace = read_trace(path)
    steps = trace.steps
    median_ms = statistics.median(s.step_s for s in steps) * 1000 if steps else math.nan
    lines = [
        f"{path}: {len(steps)} steps (median {median_ms:.1f} ms), first {warmup} not counted",
        f"{'kind':<15}{'steps':>6}{'+-20%':>7}{'live':>7}{'noise':>7}{'n same':>7}"
        f"{'bias':>6}{'med err':>8}",
    ]
    for name, fig in figures(trace, warmup, make_predictor).items():
        if fig.steps:
            lines.append(fig.row(name))
    lines.extend(replay_rows(steps))
    return "\n".join(lines)


def replay_rows(steps: Sequence[TracedStep]) -> list[str]:
    """How each way of running the forward pass (a trace's ``replay`` field: decode graph,
    whole graph, graph pieces, eager) did: its steps, their median and p99 time, and their
    prefill tokens. None for a trace that does not say."""
    ways: dict[str, list[TracedStep]] = {}
    for step in steps:
        if step.replay:
            ways.setdefault(step.replay, []).append(step)
    if not ways:
        return []
    rows = [f"{'replay':<15}{'steps':>6}{'p50 ms':>9}{'p99 ms':>9}{'prefill tok':>12}"]
    for way, group in sorted(ways.items(), key=lambda item: -len(item[1])):
        times = [s.step_s for s in group]
        prefill = statistics.mean(s.shape.num_prefill_tokens for s in group)
        rows.append(
            f"{way:<15}{len(group):>6}{percentile(times, 50) * 1e3:>9.2f}"
            f"{percentile(times, 99) * 1e3:>9.2f}{prefill:>12.0f}"
        )
    return rows


# ---- record ---------------------------------------------------------------------------------


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Random ids, distinct per request: no prefix-cache hits between requests.
    return [rng.randrange(100, vocab) for _ in range(n)]


def closed_loop(engine: Any, prompts: list[list[int]], concurrency: int, output: int) -> float:
    """Run ``prompts`` with at most ``concurrency`` in flight; return requests per second."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"c{i}-{t0}", prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
    return len(prompts) / (time.perf_counter() - t0)


def poisson(engine: Any, prompts: list[list[int]], rate: float, output: int, seed: int) -> None:
    """Requests arriving at Poisson times of ``rate`` per second; step until all finish."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        arrivals.append(t)
    next_i = 0
    while next_i < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while next_i < len(prompts) and arrivals[next_i] <= now:
            engine.add_request(f"p{next_i}-{t0}", prompts[next_i], params)
            next_i += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif next_i < len(prompts):
            time.sleep(min(0.05, max(0.0, arrivals[next_i] - now)))


def record_run(
    out: Path, name: str, args: argparse.Namespace, target_itl_ms: float | None, rate: float | None
) -> dict[str, Any]:
    """One engine (traced to ``out/name.jsonl``) through the three loads."""
    from engine.llm import LLM

    path = out / f"{name}.jsonl"
    os.environ[TRACE_ENV] = str(path)
    try:
        llm = LLM(args.model, target_itl_ms=target_itl_ms, seed=0)
    finally:
        del os.environ[TRACE_ENV]
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(1)
    result: dict[str, Any] = {"trace": str(path)}
    t0 = time.perf_counter()
    # Warm-up (not part of any load, as the HTTP benchmark's warm-up requests).
    closed_loop(engine, [_prompt(rng, 128, vocab) for _ in range(2)], 2, 8)
    first = len(read_trace(path).steps)
    closed_loop(engine, [_prompt(rng, 128, vocab) for _ in range(args.concurrency)],
                args.concurrency, 64)  # fmt: skip
    c64 = read_trace(path).steps[first:]
    decode = sorted(s.step_s for s in c64 if s.shape.num_prefill_tokens == 0)
    result["c64_decode_step_s"] = decode[len(decode) // 2] if decode else None

    def mixed(n: int) -> list[list[int]]:
        return [_prompt(rng, rng.randint(64, 1024), vocab) for _ in range(n)]

    if rate is None:
        capacity = closed_loop(engine, mixed(args.capacity_requests),
                               max(1, args.concurrency // 2), 64)  # fmt: skip
        result["capacity_rate"] = capacity
        rate = args.load * capacity
    result["poisson_rate"] = rate
    poisson(engine, mixed(args.poisson_requests), rate, 64, seed=1)
    engine.shutdown()
    result["steps"] = len(read_trace(path).steps)
    result["seconds"] = time.perf_counter() - t0
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def record(args: argparse.Namespace) -> int:
    from engine.threads import configure_threads

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    threads, source = configure_threads(args.num_threads)
    print(f"{threads} compute threads ({source})", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)
    base = record_run(out, "untargeted", args, None, None)
    target = args.target_itl_ms
    if target is None:
        target = round(3 * base["c64_decode_step_s"] * 1000)
    print(f"target ITL {target} ms", flush=True)
    targeted = record_run(out, "targeted", args, target, base["poisson_rate"])
    summary = {"untargeted": base, "targeted": targeted, "target_itl_ms": target,
               "loadavg_after": os.getloadavg()}  # fmt: skip
    (out / "record.json").write_text(json.dumps(summary, indent=2))
    print(f"load average {os.getloadavg()}", flush=True)
    for name in ("untargeted", "targeted"):
        print(report(out / f"{name}.jsonl", args.warmup))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay traces through the predictor")
    rp.add_argument("traces", nargs="+", type=Path)
    rec = sub.add_parser("record", help="record traces in-process, then replay them")
    rec.add_argument("--out", type=Path, default=Path("results/steps"))
    rec.add_argument("--model", default="default")
    rec.add_argument("--target-itl-ms", type=float, default=None)
    rec.add_argument("--concurrency", type=int, default=64)
    rec.add_argument("--capacity-requests", type=int, default=32)
    rec.add_argument("--poisson-requests", type=int, default=24)
    rec.add_argument("--load", type=float, default=0.8, help="Poisson rate / capacity")
    rec.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="compute threads, as the server's flag (default: the CPUs this process may use)",
    )
    for sp in (rp, rec):
        sp.add_argument("--warmup", type=int, default=WARMUP, help="steps not counted at the start")
    args = p.parse_args(argv)
    if args.command == "record":
        if args.target_itl_ms is not None and not args.target_itl_ms > 0:
            p.error("--target-itl-ms must be positive")
        return record(args)
    for path in args.traces:
        try:
            print(report(path, args.warmup))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
