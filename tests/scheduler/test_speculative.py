"""Speculative rows in the scheduler: k + 1 query tokens, accepted prefixes, rollback of the
rejected drafts' slots, stop conditions inside an accepted run, no preemption for drafts.

A fake verifier stands in for the model: the *true* continuation of a request is
``next_token`` of its context (tests/scheduler/fake_runner.py), drafts are right for the
first ``num_right`` tokens, and the row emits what verification would: the right drafts and
then the true next token.
"""

from __future__ import annotations

from kvpool.manager import KVCacheManager
from scheduler import SchedulerOutput
from scheduler.config import SchedulerConfig
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from tests.scheduler.fake_runner import make_scheduler, next_token, req


def true_continuation(tokens: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(tokens + out))
    return out


def verify(out: SchedulerOutput, num_right: int) -> dict[str, int | list[int]]:
    """What the runner would return: plain rows their true token; speculative rows their
    first ``num_right`` drafts (when right) and the true token after them."""
    result: dict[str, int | list[int]] = {}
    for item in out.scheduled:
        request = item.request
        known = request.token_ids(0, request.num_tokens)
        if not item.draft_token_ids:
            if item.samples:
                result[request.request_id] = next_token(known)
            continue
        truth = true_continuation(known, len(item.draft_token_ids) + 1)
        emitted = []
        for draft, right in zip(item.draft_token_ids, truth, strict=False):
            if draft != right:
                break
            emitted.append(draft)
        emitted.append(truth[len(emitted)])
        result[request.request_id] = emitted
    return result


def drafts_for(sched, k: int, num_right: int) -> dict[str, list[int]]:
    drafts = {}
    for request in sched.running:
        if request.num_tokens - request.num_computed_tokens == 1:
            truth = true_continuation(request.token_ids(0, request.num_tokens), k)
            drafts[request.request_id] = truth[:num_right] + [7] * (k - num_right)
    return drafts


def run(sched, k: int, num_right: int) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished():
        out = sched.schedule(draft_token_ids=drafts_for(sched, k, num_right))
        sched.check_integrity()
        update = sched.update_from_output(out, verify(out, num_right))
        sched.check_integrity()
        for request, token in update.new_tokens:
            outputs.setdefault(request.request_id, []).append(token)
    return outputs


def test_speculative_rows_emit_the_plain_tokens_and_free_every_block() -> None:
    plain = make_scheduler()
    for r in [req("a", 20, 30), req("b", 33, 17)]:
        plain.add_request(r)
    expected = run(plain, 0, 0)
    for k, num_right in [(1, 1), (4, 2), (8, 8), (8, 0)]:
        sched = make_scheduler()
        for r in [req("a", 20, 30), req("b", 33, 17)]:
            sched.add_request(r)
        assert run(sched, k, num_right) == expected, (k, num_right)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_speculative_row_is_k_plus_one_tokens_and_rolls_back_rejected_slots() -> None:
    sched = make_scheduler(block_size=4, num_blocks=16)
    sched.add_request(req("a", 7, 20))
    out = sched.schedule()
    sched.update_from_output(out, verify(out, 0))  # prefill: 7 tokens, 1 output
    request = sched.running[0]
    assert (request.num_tokens, request.num_computed_tokens) == (8, 7)
    assert len(sched.kv.block_ids("a")) == 2
    free_before = sched.kv.num_free_blocks
    # 6 drafts: positions 7..13 need blocks up to 14 tokens -> 4 blocks (2 new).
    out = sched.schedule(draft_token_ids=drafts_for(sched, 6, 1))
    (item,) = out.scheduled
    assert item.num_tokens == 7 and len(item.draft_token_ids) == 6
    assert len(sched.kv.block_ids("a")) == 4
    sched.update_from_output(out, verify(out, 1))
    sched.check_integrity()
    # One draft accepted: 7 + 1 + 1 = 9 computed tokens, which 3 blocks of 4 hold; the
    # fourth block held only rejected slots and is back in the pool.
    assert request.num_computed_tokens == 9
    assert request.num_tokens == 10
    assert len(sched.kv.block_ids("a")) == 3
    assert sched.kv.num_free_blocks == free_before - 1


def test_max_tokens_and_stop_tokens_cut_an_accepted_run() -> None:
    sched = make_scheduler()
    sched.add_request(req("a", 10, 3))
    outputs = run(sched, 8, 8)
    assert len(outputs["a"]) == 3  # never more than max_tokens, all drafts right
    # A stop token inside the accepted run ends the request there.
    sched = make_scheduler()
    sched.add_request(req("b", 10, 20))
    out = sched.schedule()
    sched.update_from_output(out, verify(out, 0))
    (request,) = sched.running
    truth = true_continuation(request.token_ids(0, request.num_tokens), 5)
    stop = truth[1]
    sched = make_scheduler()
    sched.add_request(req("b", 10, 20, stop_token_ids=(stop,)))
    outputs = run(sched, 5, 5)
    assert outputs["b"][-1] == stop and stop not in outputs["b"][:-1]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_drafts_never_preempt_and_tiny_pools_stay_exact() -> None:
    plain = make_scheduler(num_blocks=12, block_size=4)
    for r in [req("a", 9, 12), req("b", 9, 12), req("c", 9, 12)]:
        plain.add_request(r)
    expected = run(plain, 0, 0)
    preempted_plain = plain.num_preemptions_total
    sched = make_scheduler(num_blocks=12, block_size=4)
    for r in [req("a", 9, 12), req("b", 9, 12), req("c", 9, 12)]:
        sched.add_request(r)
    assert run(sched, 4, 2) == expected
    assert preempted_plain > 0  # the pool is small enough to force preemption
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_rollback_slots_returns_only_blocks_past_the_kept_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", 6)
    kv.commit_computed("a", 6, lambda s, e: [])
    kv.allocate_slots("a", 6 + 9)  # 4 blocks: 9 speculative slots
    assert kv.num_free_blocks == 4
    assert kv.rollback_slots("a", 8) == 2
    assert kv.num_free_blocks == 6 and len(kv.block_ids("a")) == 2
    kv.check_integrity()
    # A reservation is kept: min_blocks holds the table at its size before the step.
    kv.allocate_slots("a", 16)
    assert kv.rollback_slots("a", 9, min_blocks=4) == 0
    assert len(kv.block_ids("a")) == 4
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_blocks_filled_by_accepted_drafts_are_cached_under_their_tokens() -> None:
    """A block that accepted drafts fill is hashed from the known tokens and the accepted
    drafts at its positions (``token_source``): a later request whose prompt is the whole
    first request finds every full block cached, as after plain decoding."""
    hits = {}
    for k, num_right in [(0, 0), (3, 1), (5, 5), (6, 0)]:
        kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
        sched = Scheduler(SchedulerConfig(), kv, 4096)
        first = req("a", 9, 23)
        sched.add_request(first)
        run(sched, k, num_right)
        tokens = first.token_ids(0, first.num_tokens)
        sched.add_request(Request("b", tokens + [5], SamplingParams(max_tokens=1)))
        out = sched.schedule()
        (item,) = out.scheduled
        hits[(k, num_right)] = item.start
    # The last output token is never computed: 31 of the 32 tokens are, 7 full blocks.
    assert set(hits.values()) == {(9 + 23 - 1) // 4 * 4}, hits
