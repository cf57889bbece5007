"""Each batching policy's defining behaviour, step by step, with a fake runner.

- continuous admits and retires every step;
- static takes a batch when none is running and never admits mid-batch; with
  ``static_finished="compute"`` early finishers stay as padding rows until the batch ends;
- dynamic waits for ``max_num_seqs`` requests or the ``batch_wait_ms`` window;
- reserve block allocation never preempts; optimistic preempts and still finishes every request
  with its solo tokens.

``check_integrity()`` runs after every schedule and update (tests/scheduler/fake_runner.py).
"""

from __future__ import annotations

import pytest

from scheduler import Request, RequestStatus, Scheduler
from tests.scheduler.fake_runner import (
    FakeClock,
    FakeRunner,
    Step,
    make_scheduler,
    req,
    run_all,
    run_alone,
    step,
)

Trace = tuple[list[list[tuple[str, int]]], list[list[str]], list[list[str]]]


def _trace(sched: Scheduler, runner: FakeRunner, max_steps: int = 50) -> Trace:
    """Step to the end; per step: live rows (the batch), padding ids, finished ids."""
    batches: list[list[tuple[str, int]]] = []
    padding: list[list[str]] = []
    finished: list[list[str]] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        s = step(sched, runner)
        batches.append(s.batch)
        padding.append(s.padding_ids)
        finished.append(s.finished_ids)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return batches, padding, finished


def _five() -> list[Request]:
    return [req("a", 4, 1), req("b", 4, 4), req("c", 4, 1), req("d", 4, 1), req("e", 4, 1)]


def test_continuous_admits_and_retires_every_step() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for r in _five():
        sched.add_request(r)
    batches, padding, finished = _trace(sched, FakeRunner(16))
    # Every step one request leaves and the next takes its seat at once.
    assert batches == [
        [("a", 4), ("b", 4)],
        [("b", 1), ("c", 4)],
        [("b", 1), ("d", 4)],
        [("b", 1), ("e", 4)],
    ]
    assert finished == [["a"], ["c"], ["d"], ["b", "e"]]
    assert padding == [[]] * 4


@pytest.mark.parametrize("static_finished", ["compute", "skip"])
def test_static_runs_a_batch_to_completion_before_the_next(static_finished: str) -> None:
    sched = make_scheduler(max_num_seqs=2, batching="static", static_finished=static_finished)
    runner = FakeRunner(16)
    requests = _five()
    for r in requests:
        sched.add_request(r)
    s0 = step(sched, runner)
    assert s0.batch == [("a", 4), ("b", 4)]
    # a finished in step 0: its output is delivered now, whatever happens to its row.
    assert s0.finished_ids == ["a"] and requests[0].finish_reason == "length"
    assert sched.kv.has_request("a") == (static_finished == "compute")
    assert sched.num_padding == (1 if static_finished == "compute" else 0)

    batches, padding, finished = _trace(sched, runner)
    # c waits though a's seat is free: no admission until b, the last member, finishes.
    assert batches == [[("b", 1)]] * 3 + [[("c", 4), ("d", 4)], [("e", 4)]]
    assert finished == [[], [], ["b"], ["c", "d"], ["e"]]
    pad = ["a"] if static_finished == "compute" else []
    assert padding == [pad, pad, pad, [], []]
    assert runner.num_padding_tokens == len(pad) * 3


def test_static_never_admits_mid_batch_even_with_seats_budget_and_blocks() -> None:
    first_step: dict[str, int] = {}
    for batching in ("continuous", "static"):
        sched = make_scheduler(max_num_seqs=4, batching=batching)
        runner = FakeRunner(16)
        sched.add_request(req("a", 4, 2))
        sched.add_request(req("b", 4, 5))
        step(sched, runner)
        sched.add_request(req("late", 4, 2))
        for i in range(1, 20):
            s = step(sched, runner)
            if "late" in dict(s.batch):
                first_step[batching] = i
                break
    # Continuous takes it the very next step; static only after b's fifth token.
    assert first_step == {"continuous": 1, "static": 5}


def test_static_takes_all_its_members_at_once_even_past_the_token_budget() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=6, batching="static")
    runner = FakeRunner(16)
    for name in "abc":
        sched.add_request(req(name, 4, 3))
    sched.add_request(req("d", 4, 3))
    s = step(sched, runner)
    assert s.batch == [("a", 4), ("b", 2)]
    # c joined the batch with no tokens this step: it is a member, d is not.
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]
    assert [r.request_id for r in sched.waiting] == ["d"]
    assert step(sched, runner).batch == [("a", 1), ("b", 2), ("c", 3)]
    run_all(sched, runner)


def test_padding_rows_refeed_the_last_computed_token_over_the_whole_context() -> None:
    sched = make_scheduler(max_num_seqs=2, batching="static", block_size=4)
    runner = FakeRunner(4)
    a, b = req("a", 5, 2), req("b", 5, 6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)  # a's second token: a finishes with 6 tokens computed... of 7
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_computed_tokens == 6
    s = step(sched, runner)
    (row,) = [x for x in s.out.scheduled if x.padding]
    assert row.request is a
    assert (row.start, row.num_tokens, row.seq_len, row.samples) == (5, 1, 6, False)
    assert row.token_ids == [a.output_token_ids[0]]  # position 5: a's first output token
    assert row.block_ids == sched.kv.block_ids("a") == (0, 1)
    assert s.out.num_padding_tokens == 1 and s.out.num_scheduled_tokens == 2
    assert a.output_token_ids == run_alone(req("a", 5, 2), 4)  # nothing appended to a
    # A new request may not reuse a padding request's id while it still holds blocks.
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", 3, 1))
    run_all(sched, runner)
    assert a.num_output_tokens == 2


def test_padding_takes_the_budget_live_requests_leave() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=2, batching="static")
    runner = FakeRunner(16)
    for r in [req("a", 1, 1), req("b", 1, 1), req("c", 1, 4)]:
        sched.add_request(r)
    batches, padding, _ = _trace(sched, runner)
    assert batches == [[("a", 1), ("b", 1)], [("c", 1)], [("c", 1)], [("c", 1)], [("c", 1)]]
    assert padding == [[], ["a"], ["a"], ["a"], ["a"]]


def test_aborting_the_last_running_member_ends_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2, batching="static")
    runner = FakeRunner(16)
    for r in [req("a", 20, 1), req("b", 20, 10), req("c", 5, 2)]:
        sched.add_request(r)
    step(sched, runner)
    step(sched, runner)
    assert sched.num_padding == 1 and sched.kv.num_used_blocks == 4
    sched.abort_requests(["b"])
    sched.check_integrity()
    assert sched.num_padding == 0 and sched.kv.num_used_blocks == 0
    assert step(sched, runner).batch == [("c", 5)]  # the next batch
    run_all(sched, runner)


def test_optimistic_static_releases_padding_before_preempting() -> None:
    # 4 blocks of 4 tokens: b alone needs all 4 by its end; a's padding holds one.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, batching="static")
    runner = FakeRunner(4)
    a, b = req("a", 4, 1), req("b", 4, 12)
    released_at: list[int] = []

    def watch(i: int, s: Step) -> None:
        assert not s.out.preempted_ids
        if not released_at and sched.num_padding == 0 and sched.running:
            released_at.append(i)

    outputs = run_all(sched, runner, [a, b], on_step=watch)
    # b's fourth block (position 12) comes from a's padding, at step 9 (position 4 + 8).
    assert released_at == [9]
    assert sched.num_preemptions_total == 0
    assert outputs["b"] == run_alone(req("b", 4, 12), 4)


def test_check_integrity_catches_padding_outside_a_batch() -> None:
    sched = make_scheduler()
    runner = FakeRunner(16)
    a = req("a", 3, 1)
    sched.add_request(a)
    sched.add_request(req("b", 3, 5))
    step(sched, runner)
    sched.kv.allocate_slots("a", 3)  # corrupt: a finished request keeps blocks as padding
    sched.padding.add(a)
    with pytest.raises(AssertionError, match="padding outlived its batch"):
        sched.check_integrity()


def test_dynamic_waits_for_the_window() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=3, batching="dynamic", batch_wait_ms=100.0, clock=clock)
    runner = FakeRunner(16)
    assert sched.next_admission_time() is None  # nothing waits
    sched.add_request(req("a", 4, 2, arrival_time=0.0))
    assert step(sched, runner).out.is_empty
    assert sched.next_admission_time() == pytest.approx(0.1)
    clock.now = 0.05
    sched.add_request(req("b", 4, 2, arrival_time=0.05))
    assert step(sched, runner).out.is_empty
    assert sched.next_admission_time() == pytest.approx(0.1)  # the oldest's window
    clock.now = 0.0999
    assert step(sched, runner).out.is_empty
    clock.now = 0.1
    assert sched.next_admission_time() is None  # the next schedule() admits
    assert step(sched, runner).batch == [("a", 4), ("b", 4)]
    assert sched.next_admission_time() is None  # a batch runs: its steps are the clock

    # Requests arriving mid-batch wait for the batch, whatever their window says.
    clock.now = 0.5
    sched.add_request(req("c", 4, 1, arrival_time=0.2))
    assert step(sched, runner).batch == [("a", 1), ("b", 1)]
    assert sched.next_admission_time() is None
    assert [r.request_id for r in sched.waiting] == ["c"]
    # The batch has ended and c's window (0.2 + 0.1) passed long ago: admitted at once.
    assert step(sched, runner).batch == [("c", 4)]


def test_dynamic_forms_a_batch_as_soon_as_max_num_seqs_wait() -> None:
    clock = FakeClock(now=10.0)
    sched = make_scheduler(max_num_seqs=3, batching="dynamic", batch_wait_ms=1000, clock=clock)
    runner = FakeRunner(16)
    sched.add_request(req("a", 4, 1, arrival_time=10.0))
    sched.add_request(req("b", 4, 1, arrival_time=10.0))
    assert step(sched, runner).out.is_empty
    assert sched.next_admission_time() == pytest.approx(11.0)
    sched.add_request(req("c", 4, 1, arrival_time=10.0))
    sched.add_request(req("d", 4, 1, arrival_time=10.0))
    assert sched.next_admission_time() is None
    s = step(sched, runner)  # no time passed: the size formed the batch
    assert s.batch == [("a", 4), ("b", 4), ("c", 4)]
    assert s.finished_ids == ["a", "b", "c"]
    # d is alone now, with its window still open.
    assert step(sched, runner).out.is_empty
    assert sched.next_admission_time() == pytest.approx(11.0)
    clock.now = 11.0
    assert step(sched, runner).batch == [("d", 4)]


WORKLOAD = [(6, 10), (10, 6), (3, 12), (8, 8), (12, 4), (5, 9)]  # (prompt, max_tokens)


@pytest.mark.parametrize("batching", ["continuous", "static", "dynamic"])
def test_reserve_never_preempts_and_holds_every_block_from_admission(batching: str) -> None:
    # 12 blocks of 4 tokens; every request reserves 4 (prompt + max_tokens <= 16 tokens).
    sched = make_scheduler(
        num_blocks=12, block_size=4, max_num_seqs=4, batching=batching,
        block_allocation="reserve", clock=FakeClock(now=100.0),
    )  # fmt: skip
    requests = [req(f"r{i}", p, m) for i, (p, m) in enumerate(WORKLOAD)]
    max_running: list[int] = []

    def watch(i: int, s: Step) -> None:
        assert not s.out.preempted_ids
        for r in sched.running:
            total = r.num_prompt_tokens + r.sampling_params.max_tokens
            assert len(sched.kv.block_ids(r.request_id)) == sched.kv.num_blocks_for(total)
        max_running.append(len(sched.running))

    outputs = run_all(sched, FakeRunner(4), requests, on_step=watch)
    assert sched.num_preemptions_total == 0
    assert max(max_running) == 3  # a fourth reservation never fits: 4 x 4 > 12 blocks
    assert outputs == {r.request_id: run_alone(r, 4) for r in requests}


@pytest.mark.parametrize("batching", ["continuous", "static", "dynamic"])
def test_optimistic_preempts_and_still_finishes_every_request(batching: str) -> None:
    sched = make_scheduler(
        num_blocks=12, block_size=4, max_num_seqs=4, batching=batching,
        block_allocation="optimistic", clock=FakeClock(now=100.0),
    )  # fmt: skip
    requests = [req(f"r{i}", p, m) for i, (p, m) in enumerate(WORKLOAD)]
    max_running: list[int] = []
    outputs = run_all(
        sched, FakeRunner(4), requests, on_step=lambda i, s: max_running.append(len(sched.running))
    )
    assert sched.num_preemptions_total > 0
    assert max(max_running) == 4  # it admits more than reserve would
    assert outputs == {r.request_id: run_alone(r, 4) for r in requests}
