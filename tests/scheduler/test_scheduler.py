"""The continuous scheduler step by step, over a real KVCacheManager and a fake runner.

``check_integrity()`` runs after every ``schedule()`` and every ``update_from_output()``
(see ``tests/scheduler/fake_runner.py``), and every run ends with all blocks free.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import RequestStatus, RequestTooLargeError
from tests.scheduler.fake_runner import (
    EOS,
    FakeRunner,
    Step,
    make_scheduler,
    req,
    run_all,
    run_alone,
    step,
)


def test_fcfs_admission_under_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(16)
    for r in [req("a", 4, 3), req("b", 4, 5), req("c", 4, 2), req("d", 4, 2)]:
        sched.add_request(r)
    batches, finished = [], []
    while sched.has_unfinished():
        s = step(sched, runner)
        batches.append(s.batch)
        finished.append(s.finished_ids)
    assert batches == [
        [("a", 4), ("b", 4)],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1)],  # a finishes here; c can only join next step
        [("b", 1), ("c", 4)],
        [("b", 1), ("c", 1)],
        [("d", 4)],
        [("d", 1)],
    ]
    assert finished == [[], [], ["a"], [], ["b", "c"], [], ["d"]]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_admission_under_the_token_budget_chunks_the_last_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=25)
    runner = FakeRunner(16)
    for r in [req("a", 10), req("b", 10), req("c", 10)]:
        sched.add_request(r)
    s0 = step(sched, runner)
    assert s0.batch == [("a", 10), ("b", 10), ("c", 5)]
    assert [x.samples for x in s0.out.scheduled] == [True, True, False]
    assert [r.request_id for r, _ in s0.update.new_tokens] == ["a", "b"]
    s1 = step(sched, runner)
    assert s1.batch == [("a", 1), ("b", 1), ("c", 5)]
    assert [r.request_id for r, _ in s1.update.new_tokens] == ["a", "b", "c"]
    assert step(sched, runner).batch == [("a", 1), ("b", 1), ("c", 1)]


def test_admission_waits_for_free_blocks_and_nobody_jumps_the_queue() -> None:
    sched = make_scheduler(num_blocks=4, block_size=16)
    runner = FakeRunner(16)
    for r in [req("a", 40, 4), req("b", 30, 2), req("c", 5, 2)]:
        sched.add_request(r)
    s = step(sched, runner)
    # a takes 3 of 4 blocks; b needs 2 and waits; c would fit in 1 but is behind b (FCFS).
    assert s.batch == [("a", 40)]
    assert sched.kv.block_ids("a") == (0, 1, 2)
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert [step(sched, runner).batch for _ in range(3)] == [[("a", 1)]] * 3
    assert sched.kv.num_free_blocks == 4  # a finished in the last step and freed at once
    assert step(sched, runner).batch == [("b", 30), ("c", 5)]
    run_all(sched, runner)


def test_chunked_prefill_alone_splits_32_32_32_4() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(16)
    sched.add_request(req("long", 100, 3))
    chunks = []
    while sched.has_unfinished():
        s = step(sched, runner)
        (item,) = s.out.scheduled
        chunks.append((item.start, item.num_tokens, item.samples, len(s.update.new_tokens)))
    assert chunks == [
        (0, 32, False, 0),
        (32, 32, False, 0),
        (64, 32, False, 0),
        (96, 4, True, 1),
        (100, 1, True, 1),
        (101, 1, True, 1),
    ]


def test_chunked_prefill_never_stalls_running_decodes() -> None:
    # Budget 34 = two decodes + a 32-token chunk.
    sched = make_scheduler(max_num_batched_tokens=34)
    runner = FakeRunner(16)
    sched.add_request(req("d1", 3, 20))
    sched.add_request(req("d2", 3, 20))
    assert step(sched, runner).batch == [("d1", 3), ("d2", 3)]
    long = req("long", 100, 2)
    sched.add_request(long)
    batches = [step(sched, runner).batch for _ in range(5)]
    assert batches == [
        [("d1", 1), ("d2", 1), ("long", 32)],
        [("d1", 1), ("d2", 1), ("long", 32)],
        [("d1", 1), ("d2", 1), ("long", 32)],
        [("d1", 1), ("d2", 1), ("long", 4)],
        [("d1", 1), ("d2", 1), ("long", 1)],
    ]
    assert long.num_output_tokens == 2 and long.finish_reason == "length"
    outputs = run_all(sched, runner)
    assert len(outputs["d1"]) == 20 - 6


def test_a_burst_that_fits_the_budget_is_prefilled_in_one_step() -> None:
    # 4 x 16 = 64 prompt tokens fit the 64-token budget: one step, past the 16-token chunk
    # size, so the four then decode together.
    sched = make_scheduler(max_num_batched_tokens=64, prefill_chunk_tokens=16)
    runner = FakeRunner(16)
    for name in "abcd":
        sched.add_request(req(name, 16, 3))
    assert step(sched, runner).batch == [("a", 16), ("b", 16), ("c", 16), ("d", 16)]
    assert step(sched, runner).batch == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_a_queue_deeper_than_one_step_drains_in_prefill_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, prefill_chunk_tokens=16)
    runner = FakeRunner(16)
    for name in "abcde":
        sched.add_request(req(name, 16, 8))
    batches = [step(sched, runner).batch for _ in range(3)]
    assert batches == [
        [("a", 16)],  # 80 tokens waiting > 64: one 16-token chunk
        [("a", 1), ("b", 16)],  # 1 decode + 64 waiting > 64: still chunked
        [("a", 1), ("b", 1), ("c", 16), ("d", 16), ("e", 16)],  # 50 fits: all at once
    ]


def test_prefill_chunks_never_cap_the_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, prefill_chunk_tokens=8)
    runner = FakeRunner(16)
    decoders = [req(f"d{i}", 2, 20) for i in range(12)]
    for r in decoders:
        sched.add_request(r)
    assert len(step(sched, runner).batch) == 12  # 24 tokens: one step
    sched.add_request(req("long", 100, 2))
    # 12 decodes + 100 prompt tokens > 64: the 12 decodes, then an 8-token chunk.
    for start in range(0, 24, 8):
        s = step(sched, runner)
        assert s.batch == [(r.request_id, 1) for r in decoders] + [("long", 8)]
        assert s.out.scheduled[-1].start == start


def test_prefill_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        make_scheduler(prefill_chunk_tokens=0)


def test_preemption_takes_the_newest_requeues_it_first_and_recomputes() -> None:
    # block size 4, 6 blocks: a, b, c (6-token prompts) fill the pool after their prefill.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3)
    runner = FakeRunner(4)
    requests = [req(name, 6, 10) for name in "abcd"]
    expected = {r.request_id: run_alone(r, block_size=4) for r in requests}
    for r in requests:
        sched.add_request(r)
    streamed: dict[str, list[int]] = {}

    def collect(s_: Step) -> None:
        for r, t in s_.update.new_tokens:
            streamed.setdefault(r.request_id, []).append(t)

    for _ in range(3):
        s = step(sched, runner)
        collect(s)
        assert not s.out.preempted_ids
    assert sched.kv.num_free_blocks == 0
    # Step 4: a and b each need a third block (position 8); c, admitted last, is preempted.
    s = step(sched, runner)
    collect(s)
    assert s.out.preempted_ids == ["c"]
    assert s.batch == [("a", 1), ("b", 1)]
    c = requests[2]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 3 and c.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # front of the queue
    assert not sched.kv.has_request("c")

    # Run on; when c comes back it recomputes prompt + its 3 output tokens in one chunk.
    readmission = []
    while sched.has_unfinished():
        s = step(sched, runner)
        collect(s)
        readmission += [x for x in s.out.scheduled if x.request_id == "c" and x.start == 0]
    (item,) = readmission
    assert item.num_tokens == 9 and item.token_ids == c.prompt_token_ids + expected["c"][:3]
    assert streamed == expected
    assert sched.kv.num_free_blocks == 6


def test_a_request_that_must_preempt_itself_stops_the_step() -> None:
    # One request alone can always finish; two that both grow past the pool cannot coexist.
    sched = make_scheduler(num_blocks=2, block_size=4, max_num_seqs=2)
    runner = FakeRunner(4)
    a, b = req("a", 4, 4), req("b", 3, 4)
    step_preempted: list[list[str]] = []
    outputs = run_all(
        sched, runner, [a, b], on_step=lambda i, s: step_preempted.append(s.out.preempted_ids)
    )
    assert ["b"] in step_preempted
    assert outputs == {"a": run_alone(a, 4), "b": run_alone(b, 4)}


@pytest.mark.parametrize(
    ("script", "params", "expected_tokens", "reason"),
    [
        ([50, EOS, 60], {}, [50, EOS], "stop"),
        ([50, EOS, 60, 61], {"ignore_eos": True}, [50, EOS, 60, 61], "length"),
        ([50, 77, 60], {"stop_token_ids": (77, 78)}, [50, 77], "stop"),
        ([50, 51, 78], {"stop_token_ids": (77, 78)}, [50, 51, 78], "stop"),
        ([50, 51, 52, 53, 54], {}, [50, 51, 52, 53], "length"),
    ],
)
def test_stop_conditions(
    script: list[int], params: dict[str, Any], expected_tokens: list[int], reason: str
) -> None:
    sched = make_scheduler()
    runner = FakeRunner(16, script={"a": script})
    a = req("a", 5, 4, **params)
    outputs = run_all(sched, runner, [a, req("other", 5, 6)])
    assert outputs["a"] == expected_tokens
    assert a.output_token_ids == expected_tokens
    assert a.finish_reason == reason
    assert len(outputs["other"]) == 6


def test_stop_at_max_model_len() -> None:
    sched = make_scheduler(max_model_len=20)
    a = req("a", 12, 8)
    run_all(sched, FakeRunner(16), [a])
    assert a.num_tokens == 20 and a.finish_reason == "length"


def test_requests_too_large_are_refused_at_add_time() -> None:
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=100)
    with pytest.raises(RequestTooLargeError, match="whole pool"):
        sched.add_request(req("pool", 60, 5))  # 65 tokens > 64 slots
    with pytest.raises(RequestTooLargeError, match="context length of 100"):
        sched.add_request(req("ctx", 95, 6))
    assert not sched.has_unfinished() and not sched.waiting
    sched.check_integrity()
    sched.add_request(req("fits", 60, 4))  # exactly 64
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("fits", 1, 1))
    outputs = run_all(sched, FakeRunner(16))
    assert len(outputs["fits"]) == 4


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=2)
    runner = FakeRunner(16)
    for r in [req("a", 20, 50), req("b", 20, 50), req("c", 20, 50)]:
        sched.add_request(r)
    step(sched, runner)
    assert sched.kv.num_used_blocks == 4
    (a,) = sched.abort_requests(["a"])
    sched.check_integrity()
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert sched.kv.num_used_blocks == 2 and not sched.kv.has_request("a")
    # Waiting requests can be aborted too; unknown and already-finished ids are ignored.
    assert [r.request_id for r in sched.abort_requests(["c", "nope", "a"])] == ["c"]
    sched.check_integrity()
    assert [r.request_id for r in sched.waiting] == []
    assert step(sched, runner).batch == [("b", 1)]


def test_abort_between_schedule_and_update() -> None:
    sched = make_scheduler()
    runner = FakeRunner(16)
    for r in [req("a", 5, 5), req("b", 5, 5)]:
        sched.add_request(r)
    out = sched.schedule()
    sampled = runner.execute(out)
    sched.abort_requests(["a"])
    update = sched.update_from_output(out, sampled)
    sched.check_integrity()
    assert [r.request_id for r, _ in update.new_tokens] == ["b"]
    assert not sched.kv.has_request("a")
    run_all(sched, runner)


def test_abort_of_a_preempted_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    runner = FakeRunner(4)
    for r in [req("a", 8, 8), req("b", 7, 8)]:
        sched.add_request(r)
    for _ in range(10):
        if step(sched, runner).out.preempted_ids == ["b"]:
            break
    assert sched.waiting[0].request_id == "b"
    assert sched.waiting[0].status == RequestStatus.PREEMPTED
    (b,) = sched.abort_requests(["b"])
    sched.check_integrity()
    assert b.finish_reason == "abort"
    assert set(run_all(sched, runner)) == {"a"}


def test_many_preemptions_every_request_finishes_with_its_solo_tokens() -> None:
    # 12 requests through a 24-block pool of 4-token blocks (96 tokens), arriving over time.
    lens = [(1, 30), (70, 12), (9, 25), (33, 3), (17, 17), (5, 40), (48, 9), (2, 2),
            (26, 21), (60, 5), (13, 28), (40, 16)]  # fmt: skip
    requests = [req(f"r{i}", p, m) for i, (p, m) in enumerate(lens)]
    expected = {r.request_id: run_alone(r, 4) for r in requests}
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=24)
    runner = FakeRunner(4)
    for r in requests[:6]:
        sched.add_request(r)
    late = iter(requests[6:])
    streamed: dict[str, list[int]] = {}
    running_before: list[str] = []
    num_steps = 0
    while sched.has_unfinished():
        running_before = [r.request_id for r in sched.running]
        s = step(sched, runner)
        num_steps += 1
        if s.out.preempted_ids:
            # The victims are the most recently admitted, newest first.
            k = len(s.out.preempted_ids)
            assert s.out.preempted_ids == running_before[::-1][:k]
            assert [r.request_id for r in list(sched.waiting)[:k]] == s.out.preempted_ids[::-1]
        assert s.out.num_scheduled_tokens <= 24
        assert len(sched.running) <= 8
        for r, t in s.update.new_tokens:
            streamed.setdefault(r.request_id, []).append(t)
        if num_steps % 3 == 0:
            nxt = next(late, None)
            if nxt is not None:
                sched.add_request(nxt)
    assert sched.num_preemptions_total >= 5
    assert streamed == expected
    assert sched.kv.num_free_blocks == 24
    sched.check_integrity()
