"""Latency targets in the scheduler (scheduler/latency_targets.py), with a linear fake
step-time model in place of the engine's calibrated one: the cap on prompt tokens per step,
the minimum chunk under a target the decodes alone exceed, the TPOT credit, the engine
loop's gap, and the TTFT boost and conflict."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from kvpool.manager import KVCacheManager
from scheduler import Scheduler, SchedulerConfig
from scheduler.latency_targets import DecodeLoad, LatencyTargets
from tests.scheduler.fake_runner import FakeClock, FakeRunner, make_scheduler, req, run_all, step


@dataclass
class LinearPredictor:
    """t = fixed + per_row * decode rows + per_token * prompt tokens (seconds)."""

    fixed: float = 0.010
    per_row: float = 0.001
    per_token: float = 0.001
    loads: list[DecodeLoad] = field(default_factory=list)

    def predict(self, load: DecodeLoad, num_prefill_tokens: int) -> float:
        return self.fixed + self.per_row * load.num_rows + self.per_token * num_prefill_tokens

    def prefill_tokens_within(self, load: DecodeLoad, budget_s: float, max_tokens: int) -> int:
        self.loads.append(load)
        room = budget_s - self.predict(load, 0)
        return max(0, min(max_tokens, int(room / self.per_token + 1e-9)))


def targeted(predictor: LinearPredictor, *, clock: FakeClock | None = None, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks=256, block_size=16)
    return Scheduler(
        SchedulerConfig(**config),
        kv,
        4096,
        clock=clock or FakeClock(),
        step_time_predictor=predictor,
    )


def prompt_tokens(s) -> int:
    return sum(x.num_tokens for x in s.out.scheduled if x.num_tokens > 1)


def start_decoders(sched: Scheduler, runner: FakeRunner, n: int) -> None:
    for i in range(n):
        sched.add_request(req(f"d{i}", 4, 40))
    step(sched, runner)  # all prompts in one step (no decodes yet: no cap)
    assert all(r.num_output_tokens == 1 for r in sched.running)


def prefill_long_prompt(sched: Scheduler, runner: FakeRunner, num_tokens: int) -> list:
    """Queue a ``num_tokens`` prompt named "long" and step until it has its first token;
    the steps taken."""
    sched.add_request(req("long", num_tokens, 2))
    steps = []

    def prefilling() -> bool:
        return any(r.request_id == "long" for r in sched.waiting) or any(
            r.request_id == "long" and r.num_output_tokens == 0 for r in sched.running
        )

    while prefilling():
        steps.append(step(sched, runner))
    return steps


def test_a_target_that_never_binds_plans_exactly_as_without_one() -> None:
    def batches(sched: Scheduler) -> list[list[tuple[str, int]]]:
        runner = FakeRunner(16)
        for i, n in enumerate([40, 300, 7, 130, 64, 900, 3]):
            sched.add_request(req(f"r{i}", n, 12))
        out = []
        while sched.has_unfinished():
            out.append(step(sched, runner).batch)
        return out

    kw = {"max_num_batched_tokens": 256, "prefill_chunk_tokens": 64}
    plain = batches(make_scheduler(num_blocks=256, **kw))
    loose = batches(targeted(LinearPredictor(), target_itl_ms=1e6, target_tpot_ms=1e6, **kw))
    assert plain == loose


def test_the_itl_target_sizes_each_steps_prompt_tokens_beside_the_decodes() -> None:
    predictor = LinearPredictor()
    sched = targeted(predictor, target_itl_ms=50, min_prefill_chunk_tokens=8)
    runner = FakeRunner(16)
    start_decoders(sched, runner, 8)
    steps = prefill_long_prompt(sched, runner, 200)
    for s in steps:
        assert len([x for x in s.out.scheduled if x.num_tokens == 1]) == 8  # decodes never capped
        assert s.out.target is not None and s.out.target.budget_s == pytest.approx(0.050)
        assert s.out.target.sized
    chunks = [prompt_tokens(s) for s in steps]
    # 50 ms - 10 ms fixed - 8 decode rows x 1 ms = 32 ms: 32 prompt tokens a step.
    assert chunks == [32] * 6 + [8]
    assert predictor.loads[-1].num_rows == 8
    # The decodes' context as the last step saw it: what each has computed since.
    decoders = [r for r in sched.running if r.request_id != "long"]
    assert predictor.loads[-1].num_context_tokens == sum(r.num_computed_tokens for r in decoders)


def test_a_step_without_decodes_is_not_capped() -> None:
    sched = targeted(LinearPredictor(), target_itl_ms=20, max_num_batched_tokens=512,
                     prefill_chunk_tokens=512)  # fmt: skip
    s = step(sched, FakeRunner(16)) if sched.add_request(req("a", 300, 2)) is None else None
    assert s is not None and s.batch == [("a", 300)]
    assert s.out.target is not None and s.out.target.prefill_cap == 512
    assert not s.out.target.sized  # the targets chose nothing: no chunk is reported


def test_an_impossible_target_still_moves_prefill_by_the_minimum_chunk() -> None:
    """The decodes alone take 10 + 8 = 18 ms against a 1 ms target: every step still takes
    the minimum chunk of prompt tokens, so every request finishes with its own tokens."""
    sched = targeted(LinearPredictor(), target_itl_ms=1, min_prefill_chunk_tokens=8)
    runner = FakeRunner(16)
    start_decoders(sched, runner, 8)
    late = [req("x", 50, 3), req("y", 20, 3)]
    seen: list[int] = []

    def on_step(i: int, s) -> None:
        if prompt_tokens(s):
            seen.append(prompt_tokens(s))

    outputs = run_all(sched, runner, late, on_step=on_step)
    assert seen == [8] * 8 + [6]  # 70 prompt tokens, 8 a step, FCFS
    for request in late:
        assert outputs[request.request_id] == _alone(request)


def _alone(request) -> list[int]:
    from tests.scheduler.fake_runner import run_alone

    return run_alone(request)


def test_the_tpot_target_is_an_average_with_bounded_credit() -> None:
    predictor = LinearPredictor()
    targets = LatencyTargets(SchedulerConfig(target_tpot_ms=50), predictor)
    load = DecodeLoad(num_rows=8, num_context_tokens=100)
    assert targets.decide(load, 1000, [], [], 0.0).budget_s == pytest.approx(0.050)
    for _ in range(10):  # fast decode steps earn credit, at most 3 targets' worth
        targets.observe(0.010, None, had_decodes=True)
    decision = targets.decide(load, 1000, [], [], 0.0)
    assert decision.budget_s == pytest.approx(0.200)
    assert decision.prefill_cap == 182  # 200 - 10 - 8 ms
    targets.observe(0.150, None, had_decodes=True)  # a long step spends 100 ms of it
    assert targets.decide(load, 1000, [], [], 0.0).budget_s == pytest.approx(0.100)
    targets.observe(0.010, None, had_decodes=False)  # prefill-only: earns nothing
    assert targets.decide(load, 1000, [], [], 0.0).budget_s == pytest.approx(0.100)


def test_the_engine_loops_gap_comes_off_the_budget() -> None:
    targets = LatencyTargets(
        SchedulerConfig(target_itl_ms=50, min_prefill_chunk_tokens=4), LinearPredictor()
    )
    load = DecodeLoad(num_rows=8, num_context_tokens=100)
    assert targets.decide(load, 1000, [], [], 0.0).prefill_cap == 32
    for _ in range(50):
        targets.observe(0.040, 0.010, had_decodes=True)
    assert targets.gap_s == pytest.approx(0.010, rel=1e-3)
    assert targets.decide(load, 1000, [], [], 0.0).prefill_cap == 22


def test_the_ttft_target_grows_the_prefill_share_up_to_the_itl_target() -> None:
    """TPOT 30 ms leaves 12 prompt tokens a step beside 8 decodes; ITL 100 ms leaves 82.
    Three 100-token prompts queued since t=0 with TTFT 2 s: at 12 a step (30 ms) the third
    gets its first token after 25 steps, 0.75 s: in time, no boost. With TTFT 0.5 s it would
    miss, so the step takes the ITL share; at 82 a step (100 ms) it needs 4 steps, 0.4 s."""
    clock = FakeClock(0.0)
    for ttft_ms, boosted in ((2000, False), (500, True)):
        sched = targeted(LinearPredictor(), clock=clock, target_tpot_ms=30, target_itl_ms=100,
                         target_ttft_ms=ttft_ms, min_prefill_chunk_tokens=4)  # fmt: skip
        runner = FakeRunner(16)
        start_decoders(sched, runner, 8)
        for name in "abc":
            sched.add_request(req(name, 100, 2))
        s = step(sched, runner)
        assert s.out.target is not None
        assert s.out.target.ttft_boost is boosted and not s.out.target.conflict
        assert prompt_tokens(s) == (82 if boosted else 12)


def test_a_ttft_target_out_of_reach_is_a_conflict_logged_at_most_every_10_s(caplog) -> None:
    clock = FakeClock(0.0)
    sched = targeted(LinearPredictor(), clock=clock, target_itl_ms=40, target_ttft_ms=100)
    runner = FakeRunner(16)
    start_decoders(sched, runner, 8)
    for name in "abcd":
        sched.add_request(req(name, 200, 2))
    with caplog.at_level(logging.WARNING, logger="scheduler.latency_targets"):
        decisions = []
        for t in (0.0, 1.0, 11.0):
            clock.now = t
            decisions.append(step(sched, runner).out.target)
    assert all(d is not None and d.conflict for d in decisions)
    assert sched.targets is not None and sched.targets.num_conflicts == 3
    lines = [r.getMessage() for r in caplog.records if "conflict" in r.getMessage()]
    assert len(lines) == 2 and "100 ms TTFT target" in lines[0]


def test_the_relative_itl_target_sizes_prompt_tokens_to_a_multiple_of_the_decodes_step() -> None:
    """8 decodes alone: 10 ms fixed + 8 x 1 ms = 18 ms. At 2x, a step may take 36 ms: 18
    prompt tokens beside them. The budget follows the decodes: with 4 of them it is 28 ms."""
    predictor = LinearPredictor()
    sched = targeted(predictor, target_itl_ratio=2.0, min_prefill_chunk_tokens=4)
    runner = FakeRunner(16)
    start_decoders(sched, runner, 8)
    steps = prefill_long_prompt(sched, runner, 100)
    for s in steps:
        assert s.out.target is not None and s.out.target.sized
        assert s.out.target.budget_s == pytest.approx(0.036)
    assert [prompt_tokens(s) for s in steps] == [18] * 5 + [10]
    targets = LatencyTargets(
        SchedulerConfig(target_itl_ratio=2.0, min_prefill_chunk_tokens=4), predictor
    )
    decision = targets.decide(DecodeLoad(4, 100), 1000, [], [], 0.0)
    assert decision.budget_s == pytest.approx(0.028) and decision.prefill_cap == 14


def test_the_relative_itl_target_counts_the_gap_and_yields_to_a_tighter_absolute_one() -> None:
    targets = LatencyTargets(
        SchedulerConfig(target_itl_ratio=2.0, min_prefill_chunk_tokens=4), LinearPredictor()
    )
    load = DecodeLoad(num_rows=8, num_context_tokens=100)
    for _ in range(200):  # the gap's moving average settles on 2 ms
        targets.observe(0.018, 0.002, had_decodes=True)
    # (18 + 2 ms) x 2 = 40 ms for the iteration; less the 2 ms gap, 38 ms for the step.
    decision = targets.decide(load, 1000, [], [], 0.0)
    assert decision.budget_s == pytest.approx(0.040, rel=1e-3) and decision.prefill_cap == 20
    both = LatencyTargets(
        SchedulerConfig(target_itl_ratio=2.0, target_itl_ms=30), LinearPredictor()
    )
    assert both.decide(load, 1000, [], [], 0.0).budget_s == pytest.approx(0.030)
    looser = LatencyTargets(
        SchedulerConfig(target_itl_ratio=2.0, target_itl_ms=90), LinearPredictor()
    )
    assert looser.decide(load, 1000, [], [], 0.0).budget_s == pytest.approx(0.036)


def test_a_relative_target_sizes_nothing_before_the_first_prediction() -> None:
    """Before the engine's predictor has seen a step there is nothing to be relative to: the
    step takes the whole prompt budget, and is not reported as sized."""

    class Unseen(LinearPredictor):
        def predict(self, load: DecodeLoad, num_prefill_tokens: int) -> float | None:  # type: ignore[override]
            return None

    targets = LatencyTargets(SchedulerConfig(target_itl_ratio=2.0), Unseen())
    decision = targets.decide(DecodeLoad(8, 100), 512, [], [], 0.0)
    assert decision.prefill_cap == 512 and not decision.sized


def test_the_ttft_target_grows_the_share_up_to_the_relative_itl_bound() -> None:
    """TPOT 30 ms leaves 12 prompt tokens a step beside 8 decodes (18 ms alone); a 5x
    relative ITL bound (90 ms) leaves 72. Queued prompts that would miss TTFT get that."""
    clock = FakeClock(0.0)
    sched = targeted(LinearPredictor(), clock=clock, target_tpot_ms=30, target_itl_ratio=5.0,
                     target_ttft_ms=500, min_prefill_chunk_tokens=4)  # fmt: skip
    runner = FakeRunner(16)
    start_decoders(sched, runner, 8)
    for name in "abc":
        sched.add_request(req(name, 100, 2))
    s = step(sched, runner)
    assert s.out.target is not None and s.out.target.ttft_boost
    assert s.out.target.budget_s == pytest.approx(0.090) and prompt_tokens(s) == 72


def test_targets_need_the_engines_predictor() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="predictor"):
        Scheduler(SchedulerConfig(target_itl_ms=100), kv, 512)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"target_itl_ms": 0}, "target_itl_ms must be a positive number"),
        ({"target_tpot_ms": -1.0}, "target_tpot_ms must be a positive number"),
        ({"target_itl_ms": float("inf")}, "target_itl_ms must be a positive number"),
        ({"target_ttft_ms": 100}, "needs target_itl_ms, target_itl_ratio or target_tpot_ms"),
        ({"target_itl_ratio": 1.0}, "target_itl_ratio must be a number above 1"),
        ({"target_itl_ratio": float("nan")}, "target_itl_ratio must be a number above 1"),
    ],
)
def test_target_values_are_checked(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)
