"""The scheduler with prefix caching, over a real KVCacheManager and the fake runner.

The fake runner reads every sampling request's whole context back from its fake KV cache and
checks each slot holds the request's own token at the right position, so a cache hit on the
wrong block, a stale block or a missing copy-on-write fails loudly. Outputs must equal the
request run alone without caching; ``check_integrity()`` runs after every schedule and
update; every run ends with every block free or evictable.
"""

from __future__ import annotations

from kvpool.manager import KVCacheManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from tests.scheduler.fake_runner import EOS, FakeRunner, run_all, run_alone, step

SYSTEM = [100 + (i * 37) % 800 for i in range(48)]  # a 3-block "system prompt" (block 16)


class CopyingRunner(FakeRunner):
    """The fake runner plus copy-on-write: copies queued blocks before the step computes."""

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        # Gather every source before writing any destination, as KVCacheStorage does.
        copied = [
            [self.cache.get(src * bs + offset) for offset in range(bs)]
            for src, _ in out.blocks_to_copy
        ]
        for (_, dst), rows in zip(out.blocks_to_copy, copied, strict=True):
            for offset, row in enumerate(rows):
                if row is None:
                    self.cache.pop(dst * bs + offset, None)
                else:
                    self.cache[dst * bs + offset] = row
        self.num_copies = getattr(self, "num_copies", 0) + len(out.blocks_to_copy)
        return super().execute(out)


def make(num_blocks: int = 64, block_size: int = 16, **config: object) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(**config), kv, 4096)  # type: ignore[arg-type]


def request(request_id: str, prompt: list[int], max_tokens: int = 6) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        eos_token_id=EOS,
    )


def suffix(seed: int, n: int) -> list[int]:
    return [200 + (seed * 53 + i * 7) % 700 for i in range(n)]


def all_idle(sched: Scheduler) -> bool:
    pool = sched.kv.pool
    return pool.num_free + pool.num_evictable == pool.num_blocks


def test_a_later_request_prefills_only_what_is_not_cached() -> None:
    sched, runner = make(), CopyingRunner(16)
    a = request("a", SYSTEM + suffix(1, 5))
    assert run_all(sched, runner, [a]) == {"a": run_alone(a)}
    b = request("b", SYSTEM + suffix(2, 7))
    sched.add_request(b)
    s = step(sched, runner)
    assert s.batch == [("b", 7)]  # 48 cached tokens count as computed
    assert s.out.scheduled[0].start == 48
    # b shares the blocks a computed and left cached (evictable) when it finished.
    probe = sched.kv.get_cached_prefix("probe", 48, lambda i, j: SYSTEM[i:j])
    assert sched.kv.block_ids("b")[:3] == probe.block_ids
    assert [sched.kv.pool.ref_count(b) for b in probe.block_ids] == [1, 1, 1]
    run_all(sched, runner)
    assert b.output_token_ids == run_alone(b)
    assert (sched.kv.prefix_cache_queries, sched.kv.prefix_cache_hits) == (53 + 55, 48)
    assert all_idle(sched) and sched.kv.pool.num_evictable > 0


def test_requests_submitted_together_compute_the_shared_prompt_once() -> None:
    # n = 3 choices of one 40-token prompt (2 full blocks + 8): b and c wait one step for a
    # to fill the blocks, then compute only their last 8 tokens.
    sched, runner = make(), CopyingRunner(16)
    prompt = SYSTEM[:40]
    reqs = [request(name, prompt) for name in "abc"]
    batches = []
    outputs = run_all(sched, runner, reqs, on_step=lambda i, s: batches.append(s.batch))
    assert batches[:2] == [[("a", 40)], [("a", 1), ("b", 8), ("c", 8)]]
    assert runner.num_forward_tokens == 40 + 2 * 8 + 3 * 5  # prefills, then 5 decodes each
    expected = run_alone(reqs[0])
    assert outputs == {"a": expected, "b": expected, "c": expected}
    assert all_idle(sched)


def test_a_fully_cached_prompt_recomputes_one_token_into_a_copied_block() -> None:
    sched, runner = make(), CopyingRunner(16)
    prompt = SYSTEM[:32]  # block-aligned: every token of b and c is cached after a's step
    reqs = [request(name, prompt) for name in "abc"]
    for r in reqs:
        sched.add_request(r)
    assert step(sched, runner).batch == [("a", 32)]
    s = step(sched, runner)
    assert s.batch == [("a", 1), ("b", 1), ("c", 1)]
    a_blocks, b_blocks, c_blocks = (sched.kv.block_ids(r) for r in "abc")
    # b and c share a's block 0 and each write position 31 into a private copy of block 1.
    assert b_blocks[0] == c_blocks[0] == a_blocks[0]
    assert s.out.blocks_to_copy == [(a_blocks[1], b_blocks[1]), (a_blocks[1], c_blocks[1])]
    assert len({a_blocks[1], b_blocks[1], c_blocks[1]}) == 3
    outputs = run_all(sched, runner)
    expected = run_alone(reqs[0])
    assert [r.output_token_ids for r in reqs] == [expected] * 3
    assert outputs == {"a": expected[2:], "b": expected[1:], "c": expected[1:]}
    assert runner.num_copies == 2
    assert all_idle(sched)


def test_a_request_waiting_for_a_prefix_does_not_block_the_queue() -> None:
    sched, runner = make(), CopyingRunner(16)
    a, b = request("a", SYSTEM + suffix(1, 3)), request("b", SYSTEM + suffix(2, 3))
    c = request("c", suffix(3, 20))
    for r in (a, b, c):
        sched.add_request(r)
    s0 = step(sched, runner)
    assert s0.batch == [("a", 51), ("c", 20)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert step(sched, runner).batch == [("a", 1), ("c", 1), ("b", 3)]
    run_all(sched, runner)
    assert [r.output_token_ids for r in (a, b, c)] == [run_alone(r) for r in (a, b, c)]


def test_static_batches_do_not_wait_for_a_prefix() -> None:
    # A static batch is admitted at once; waiting for a cache fill would cost the whole
    # batch, so same-prompt members each compute the prompt.
    sched, runner = make(batching="static", max_num_seqs=2), CopyingRunner(16)
    reqs = [request(name, SYSTEM[:40], 4) for name in "ab"]
    batches = []
    outputs = run_all(sched, runner, reqs, on_step=lambda i, s: batches.append(s.batch))
    assert batches[0] == [("a", 40), ("b", 40)]
    assert outputs["a"] == outputs["b"] == run_alone(reqs[0])
    assert all_idle(sched)


def test_preemption_and_abort_release_shared_blocks_exactly() -> None:
    # 4-token blocks and a pool far smaller than the load: requests sharing a 12-token
    # prefix preempt each other, come back with hits on whatever is still cached, and one
    # is aborted mid-run. Every output must still be exactly its own.
    sched, runner = make(num_blocks=14, block_size=4, max_num_seqs=4), CopyingRunner(4)
    prefix = SYSTEM[:12]
    reqs = [request(f"r{i}", prefix + suffix(i, 1 + 3 * i), 10) for i in range(6)]
    expected = {r.request_id: run_alone(r, block_size=4) for r in reqs}
    for r in reqs:
        sched.add_request(r)
    for i in range(10_000):
        if not sched.has_unfinished():
            break
        step(sched, runner)
        if i == 6:
            (aborted,) = sched.abort_requests(["r1"])
            sched.check_integrity()
    else:
        raise AssertionError("did not finish")
    assert sched.num_preemptions_total >= 3
    assert aborted.finish_reason == "abort"
    for r in reqs:
        if r is not aborted:
            assert r.output_token_ids == expected[r.request_id], r.request_id
    assert sched.kv.prefix_cache_hits > 0
    assert all_idle(sched) and sched.kv.stats().num_used_blocks == 0
