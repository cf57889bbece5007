"""The host's share of a decode step: the engine's Python work per phase, the forward stubbed.

    python -m benchmarks.host_overhead                              # batch 1, 64, 256; CPU
    python -m benchmarks.host_overhead --device cuda                # the same on a GPU
    python -m benchmarks.host_overhead --batch 64 --context 1536 --steps 200 --clock cpu
    python -m benchmarks.host_overhead --sampling penalties --context 1536   # penalised rows
    python -m benchmarks.host_overhead --model smollm2-135m --batch 1,64     # its vocabulary
    python -m benchmarks.host_overhead --speculative 4 --context 1536        # n-gram search

On a GPU a decode step replayed from a CUDA graph costs the device a few milliseconds, and
whatever the host does around it (schedule, build the step's inputs, copy them into the
graph's buffers, sample, update the scheduler, build outputs, record stats) adds to every
step unless it overlaps the device. This benchmark isolates that host work on any machine:
it builds the real ``LLMEngine`` on the tiny-llama shape (``--model``: another shape preset,
whose vocabulary sizes the logits the sampler works on) with dummy weights and the torch
attention backend, then replaces the model's forward with a stub that returns fixed logits
of the right shape without computing anything, behind the decode graphs' persistent buffers
(``DecodeGraphs`` with ``capture=False``: the same copies, bucketing and padding as a
replay, the stub in place of ``graph.replay()``). What is left in a step is the engine's own
work; on CUDA, the sampler's small argmax and its one read of the tokens too.

Each batch size gets ``--batch`` requests of ``--context`` random prompt tokens (no shared
prefix), prefilled, decoded ``--warmup-steps`` steps, then timed over ``--steps`` decode
steps. Per step it prints the mean microseconds of each phase (each timed around the
engine's own call of it) and of the whole ``step()``:

- schedule: ``Scheduler.schedule``;
- prepare: ``ModelRunner.prepare`` (the step's input tensors);
- forward: the decode graphs' ``run`` (buffer copies, padding) plus the stub's return;
- sample: the sampler (greedy rows here: the argmax and the read of the tokens);
- update: ``Scheduler.update_from_output``;
- outputs: the engine's ``RequestOutput`` list;
- stats: the step's ``StepStats``;
- other: the rest of ``step()``.

``--sampling penalties`` gives every request repetition, frequency and presence penalties
(greedy still): the sample phase then includes the penalties' per-step work (bringing each
request's token counts up to date and applying them, engine/penalties.py), which grows with
the number of new tokens a step, not with the context.

``--speculative K`` turns on n-gram speculation with K drafts for every request at every
step (no acceptance-aware pauses, no auto-disable), and adds a "propose" phase: the search
of each request's tokens for its drafts, at its full cost. The stub's tokens then vary from
step to step, as a model's do.

``--clock cpu`` measures the thread's CPU time instead of wall time: steadier where other
processes share the cores (the host work is single-threaded; on CUDA a sync's spin-wait
counts as CPU time).

``--json PATH`` writes the figures, for A/B comparisons between two checkouts run in turn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, default_graph_sizes
from engine.input_batch import InputBatch
from engine.llm_engine import LLMEngine
from engine.presets import PRESETS, preset
from engine.spec_decode.config import SpeculativeConfig
from kvpool.config import KVPoolConfig
from scheduler.config import SchedulerConfig
from scheduler.request import SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "update", "outputs", "stats")
SPEC_PHASES = ("propose",)  # with --speculative: the drafts, before the schedule
MODEL = "tiny-llama"


class StubForward:
    """The model's forward without the model: fixed random logits, one row per logits row
    the batch asks for (a sampling row's argmax is then the same token every step).

    ``vary``: each call takes other rows of the table instead (a request's tokens then
    vary from step to step, as a model's do: an n-gram search does not find its match at
    once in a run of one repeated token)."""

    def __init__(
        self, max_rows: int, vocab: int, device: torch.device, *, vary: bool = False
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab, generator=g).to(device)  # [max_rows, vocab]
        self.vary = vary
        self.calls = 0

    def __call__(self, batch: InputBatch, key_caches: Any, value_caches: Any) -> torch.Tensor:
        rows = batch.logits_indices.shape[0]
        if not self.vary:
            return self.logits[:rows]
        self.calls += 1
        max_rows = self.logits.shape[0]
        picks = (torch.arange(rows) * 7919 + self.calls * 104729) % max_rows
        return self.logits[picks.to(self.logits.device)]


class PhaseTimer:
    """Accumulates time per phase over the timed steps; ``wrap`` times one callable."""

    def __init__(self, clock: Callable[[], float], phases: tuple[str, ...] = PHASES) -> None:
        self.clock = clock
        self.phases = phases
        self.totals = dict.fromkeys(phases, 0.0)
        self.on = False

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, totals = self.clock, self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[phase] += clock() - t0

        return timed


class _TimedSampler:
    """The runner queues its picks through its sampler (``Sampler.pick``) and reads them
    after (``Picked.read``): both are timed as "sample"; every other attribute passes
    through."""

    def __init__(self, sampler: Any, timer: PhaseTimer) -> None:
        self._sampler = sampler
        self._timer = timer

    def pick(self, *args: Any, **kwargs: Any) -> Any:
        picked = self._timer.wrap("sample", self._sampler.pick)(*args, **kwargs)
        picked.read = self._timer.wrap("sample", picked.read)
        return picked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


# Tokens per step while the prompts are prefilled (a CUDA engine's default chunking: the
# whole budget), and the decode steps the first requests take meanwhile.
STEP_TOKENS = 8192


def max_output_tokens(batch: int, context: int, steps: int, per_step: int = 1) -> int:
    """Output tokens a request of ``batch`` needs: the decodes it runs while later prompts
    are prefilled, then ``steps`` (warm-up and timed) of up to ``per_step`` tokens each
    (1 + the drafts, speculating), so none finishes early."""
    return -(-batch * context // STEP_TOKENS) + steps * per_step + 2


def build_engine(
    device: str,
    max_batch: int,
    context: int,
    steps: int,
    model: str = MODEL,
    speculative_tokens: int = 0,
) -> LLMEngine:
    """``speculative_tokens`` > 0: n-gram speculation proposing that many drafts for every
    request at every step (no acceptance-aware pauses, no auto-disable), so that each step
    searches every request's context: what the search costs at its most."""
    per_step = 1 + speculative_tokens
    max_len = context + max_output_tokens(max_batch, context, steps, per_step)
    speculative = None
    if speculative_tokens:
        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=speculative_tokens,
            row_cost=0.0,
            max_step_tokens=max_batch * per_step,
        )
    per_request = -(-(max_len + 16) // KVPoolConfig().block_size)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            load_format="dummy",
            device=device,
            dtype="float32",
            attention_backend="torch",
            enforce_eager=True,  # the stand-in below takes the graphs' place
            max_model_len=max_len + 16,
            # The synchronous step's phases, one after another (the CUDA default overlaps
            # them with the device's step, which the stand-in does not have).
            async_scheduling=False,
            speculative=speculative,
        ),
        KVPoolConfig(num_blocks=max_batch * per_request + 8, enable_prefix_caching=False),
        SchedulerConfig(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(STEP_TOKENS, max_batch),
            prefill_chunk_tokens=max(STEP_TOKENS, max_batch),
        ),
    )
    dev = engine.device
    # Logits rows: a step's sampling rows, at most its requests padded to a graph's size.
    graph_sizes = default_graph_sizes(max_batch)
    # Speculative rows take logits at each of their 1 + k positions.
    stub = StubForward(
        max(*graph_sizes, max_batch) * per_step,
        engine.model_config.vocab_size,
        dev,
        vary=speculative is not None,
    )
    engine.runner.model = stub
    engine.runner.prefill_graphs = None  # steps with prompt tokens run the stub eagerly
    engine.runner.graphs = DecodeGraphs(
        stub,  # type: ignore[arg-type]
        engine.storage,
        graph_sizes,
        -(-engine.max_model_len // engine.storage.block_size),
        dev,
        capture=False,
    )
    return engine


def instrument(engine: LLMEngine, timer: PhaseTimer) -> None:
    """Time each phase around the engine's own call of it (instance attributes shadow the
    methods, so nothing else changes)."""
    runner, scheduler = engine.runner, engine.scheduler
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)  # type: ignore[method-assign]
    scheduler.update_from_output = timer.wrap(  # type: ignore[method-assign]
        "update", scheduler.update_from_output
    )
    runner.prepare = timer.wrap("prepare", runner.prepare)
    runner.graphs.run = timer.wrap("forward", runner.graphs.run)
    runner.model = timer.wrap("forward", runner.model)  # eager steps only (none timed)
    runner.sampler = _TimedSampler(runner.sampler, timer)
    engine._make_outputs = timer.wrap("outputs", engine._make_outputs)  # type: ignore[method-assign]
    engine._record_stats = timer.wrap("stats", engine._record_stats)  # type: ignore[method-assign]
    if engine.speculator is not None:
        speculator = engine.speculator
        speculator.propose = timer.wrap("propose", speculator.propose)  # type: ignore[method-assign]


def _is_decode_only(engine: LLMEngine) -> bool:
    return all(r.num_tokens - r.num_computed_tokens == 1 for r in engine.scheduler.running) and (
        not engine.scheduler.waiting
    )


SAMPLING = {
    "greedy": {},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2},
}


def run_batch(
    engine: LLMEngine,
    timer: PhaseTimer,
    batch: int,
    context: int,
    warmup: int,
    steps: int,
    sampling: str = "greedy",
) -> dict[str, float]:
    """Mean microseconds per decode step, per phase plus "other" and "step", at ``batch``."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(
        max_tokens=max_output_tokens(batch, context, warmup + steps, _tokens_per_step(engine)),
        temperature=0,
        ignore_eos=True,
        **SAMPLING[sampling],
    )
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(3, vocab, (context,), generator=g).tolist()
        engine.add_request(request_id, prompt, params)
    while not _is_decode_only(engine):  # prefill, in chunks
        engine.step()
    for _ in range(warmup):
        engine.step()
    for phase in timer.phases:
        timer.totals[phase] = 0.0
    clock = timer.clock
    total = 0.0
    timer.on = True
    for _ in range(steps):
        assert len(engine.scheduler.running) == batch and _is_decode_only(engine)
        t0 = clock()
        engine.step()
        total += clock() - t0
    timer.on = False
    engine.abort_request(ids)
    engine.check_integrity()
    per_step = {phase: timer.totals[phase] / steps * 1e6 for phase in timer.phases}
    per_step["other"] = total / steps * 1e6 - sum(per_step.values())
    per_step["step"] = total / steps * 1e6
    return per_step


def _tokens_per_step(engine: LLMEngine) -> int:
    """The most tokens a request gains in a step: 1, plus its drafts when speculating."""
    spec = engine.speculator
    return 1 + (spec.config.num_speculative_tokens if spec is not None else 0)


def format_table(results: dict[int, dict[str, float]], clock: str) -> str:
    batches = sorted(results)
    rows = list(results[batches[0]])  # the phases, "other", "step"
    head = f"{'us/step (' + clock + ')':<20}" + "".join(f"{f'batch {b}':>12}" for b in batches)
    lines = [head]
    for row in rows:
        lines.append(f"{row:<20}" + "".join(f"{results[b][row]:>12.1f}" for b in batches))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.host_overhead", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--batch", default="1,64,256", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per batch")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    ap.add_argument(
        "--model",
        default=MODEL,
        choices=sorted(PRESETS),
        help="the shape preset (dummy weights; its vocabulary sizes the logits the sampler "
        "works on)",
    )
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument(
        "--sampling",
        choices=tuple(SAMPLING),
        default="greedy",
        help="greedy rows, or greedy rows with repetition, frequency and presence penalties",
    )
    ap.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="n-gram speculation, K drafts for every request at every step (a 'propose' "
        "phase: the search over each context); 0: off",
    )
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    try:
        args.batches = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if not args.batches or min(args.batches) < 1:
        ap.error(f"--batch must list positive batch sizes, got {args.batch!r}")
    if args.context < 1 or args.steps < 1 or args.warmup_steps < 0:
        ap.error("--context and --steps must be positive, --warmup-steps not negative")
    steps = args.warmup_steps + args.steps
    if args.speculative < 0:
        ap.error(f"--speculative must be 0 or more drafts, got {args.speculative}")
    needed = args.context + max_output_tokens(
        max(args.batches), args.context, steps, 1 + args.speculative
    )
    positions = preset(args.model)["max_position_embeddings"]  # type: ignore[index]
    if needed > positions:
        ap.error(
            f"--context {args.context} with {steps} steps needs {needed} positions; "
            f"{args.model} has {positions}"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if not args.device.startswith("cuda"):
        # The host work is one thread's; the stub's logits are small, and a pool of threads
        # for the sampler's argmax would only add other processes' noise.
        torch.set_num_threads(1)
    engine = build_engine(
        args.device,
        max(args.batches),
        args.context,
        args.warmup_steps + args.steps,
        args.model,
        args.speculative,
    )
    timer = PhaseTimer(clock, PHASES + SPEC_PHASES if args.speculative else PHASES)
    instrument(engine, timer)
    results = {
        b: run_batch(engine, timer, b, args.context, args.warmup_steps, args.steps, args.sampling)
        for b in args.batches
    }
    print(
        f"host time per decode step, {args.model} shape with a stubbed forward on {engine.device}, "
        f"context {args.context}, {args.sampling} sampling"
        + (f", {args.speculative} n-gram drafts a request" if args.speculative else "")
        + f", {args.steps} steps (mean)"
    )
    print(format_table(results, args.clock))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": str(engine.device),
                    "model": args.model,
                    "clock": args.clock,
                    "context": args.context,
                    "sampling": args.sampling,
                    "speculative": args.speculative,
                    "steps": args.steps,
                    "us_per_step": {str(b): r for b, r in results.items()},
                },
                f,
                indent=1,
            )
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
