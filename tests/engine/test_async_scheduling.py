"""Asynchronous scheduling (``--async-scheduling``, engine/llm_engine.py): each step is
scheduled and launched before the one in flight is read, its decodes fed that step's picks on
the device. On the CPU the device work is done when ``launch`` returns, so these tests check
the bookkeeping, not the overlap: every request gets the tokens, logprobs and finish reason
a synchronous engine gives it, the pool stays consistent at every step, and the steps that
cannot overlap (penalties) do not.

transformers parity with preemption, chunked prompts and stop tokens is checked in
tests/engine/test_batching_modes.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kvpool.config import KVPoolConfig
from scheduler import SchedulerConfig, SchedulerOutput
from scheduler.request import PENDING_TOKEN
from tests.engine.parity import random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = {"device": "cpu", "dtype": "float32"}
POOL = {"block_size": 4, "num_kv_blocks": 96, "max_num_seqs": 6, "max_num_batched_tokens": 48}


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    return random_prompts(seed, tuple(range(5, 5 + 7 * n, 7)))


def _engines(model: Path, **overrides: object) -> tuple[LLM, LLM]:
    kwargs = {**POOL, **DEVICE, **overrides}
    return (
        LLM(str(model), **kwargs),  # type: ignore[arg-type]
        LLM(str(model), async_scheduling=True, **kwargs),  # type: ignore[arg-type]
    )


class _Collected:
    """A step loop's outputs, per request: its tokens and finish reason. An output after a
    request's final one, or a pending token among them, fails the test."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str | None] = {}

    def __call__(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.reasons, f"{out.request_id} emitted after it finished"
            assert PENDING_TOKEN not in out.new_token_ids
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.reasons[out.request_id] = out.finish_reason


def _count_pending_inputs(engine: LLMEngine, on_plan: Callable[[int], None]) -> None:
    """Call ``on_plan(number of rows fed a pending token)`` after every ``schedule()``."""
    schedule = engine.scheduler.schedule

    def counting(*args: object, **kwargs: object) -> SchedulerOutput:
        engine.scheduler.check_integrity()
        out = schedule(*args, **kwargs)  # type: ignore[arg-type]
        on_plan(sum(1 for s in out.scheduled if s.token_ids[0] == PENDING_TOKEN))
        return out

    engine.scheduler.schedule = counting  # type: ignore[method-assign]


def test_sampling_and_logprobs_match_synchronous_steps(tiny_llama_gqa: Path) -> None:
    """Greedy, seeded and unseeded random rows with top-k / top-p / min-p, and logprobs with
    alternatives: the same tokens and the same logprob values as synchronous steps (the same
    plans run, so even the shared generator's draws line up)."""
    prompts = _prompts(8)
    params = [
        SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **kw)  # type: ignore[arg-type]
        for i, kw in enumerate(
            [
                {"temperature": 0.0},
                {"temperature": 0.8, "seed": 7},
                {"temperature": 1.0, "top_k": 20, "seed": 3, "logprobs": 3},
                {"temperature": 0.7, "top_p": 0.9},
                {"temperature": 0.0, "logprobs": 0},
                {"temperature": 1.2, "min_p": 0.05, "seed": 11},
                {"temperature": 0.0, "logprobs": 2},
                {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "seed": 5, "logprobs": 1},
            ]
        )
    ]
    sync, overlapped = _engines(tiny_llama_gqa)
    pending = []
    _count_pending_inputs(overlapped.engine, pending.append)
    expected = sync.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    for i, (want, ours) in enumerate(zip(expected, got, strict=True)):
        assert ours.token_ids == want.token_ids, i
        assert ours.finish_reason == want.finish_reason == "length", i
        assert ours.logprobs == want.logprobs, i
        assert PENDING_TOKEN not in ours.token_ids
    assert sum(pending) > 0
    engine = overlapped.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.check_integrity()


def test_penalised_requests_overlap_with_the_tokens_they_read(tiny_llama_gqa: Path) -> None:
    """A penalty reads the request's tokens on the host: a step's picks are queued after
    the step before it is read, so a penalised request decodes asynchronously too and gets
    the synchronous engine's tokens."""
    prompts = _prompts(4, seed=9)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
        frequency_penalty=0.5, presence_penalty=0.4,
    )  # fmt: skip
    seeded = SamplingParams(
        max_tokens=12, temperature=0.9, seed=4, ignore_eos=True, frequency_penalty=1.0
    )
    sync, overlapped = _engines(tiny_llama_gqa)
    engine = overlapped.engine
    pending_penalised = 0

    def count(plan_pending: int) -> None:
        nonlocal pending_penalised
        pending_penalised += plan_pending

    schedule = engine.scheduler.schedule

    def watching(*args: object, **kwargs: object) -> SchedulerOutput:
        out = schedule(*args, **kwargs)  # type: ignore[arg-type]
        rows = [s for s in out.scheduled if s.request_id.startswith("pen")]
        count(sum(1 for s in rows if s.token_ids[0] == PENDING_TOKEN))
        return out

    engine.scheduler.schedule = watching  # type: ignore[method-assign]

    def run(llm: LLM) -> dict[str, list[int]]:
        e = llm.engine
        collect = _Collected()
        for i, prompt in enumerate(prompts[:2]):
            e.add_request(f"r{i}", prompt, plain)
        for _ in range(4):  # the plain requests decode on their own first
            collect(e.step())
        e.add_request("pen0", prompts[2], penalised)
        e.add_request("pen1", prompts[3], seeded)
        while e.has_unfinished_requests():
            collect(e.step())
        return collect.tokens

    assert run(overlapped) == run(sync)
    assert pending_penalised > 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_abort_while_a_step_is_in_flight(tiny_llama_gqa: Path) -> None:
    """A request aborted while its token is on the device gets its abort output at once and
    nothing after it; the others finish with the synchronous engine's tokens."""
    prompts = _prompts(3, seed=13)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sync, overlapped = _engines(tiny_llama_gqa)
    expected = {f"r{i}": o.token_ids for i, o in enumerate(sync.generate(prompts, params))}
    engine = overlapped.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    collect = _Collected()
    tokens, finished = collect.tokens, collect.reasons
    for _ in range(4):
        collect(engine.step())
        engine.check_integrity()
    (aborted,) = engine.abort_request(["r1"])
    collect([aborted])
    assert finished["r1"] == "abort"
    # Its token on the device is never emitted, so never counted.
    assert aborted.num_output_tokens == len(tokens["r1"])
    while engine.has_unfinished_requests():
        collect(engine.step())
        engine.check_integrity()
    assert tokens["r1"] == expected["r1"][: len(tokens["r1"])]
    assert len(tokens["r1"]) < len(expected["r1"])
    for rid in ("r0", "r2"):
        assert tokens[rid] == expected[rid] and finished[rid] == "length"
    assert engine.num_free_blocks == engine.num_total_blocks


def test_prefix_cache_registers_only_known_tokens(tiny_llama_gqa: Path) -> None:
    """A decode whose input is still on the device fills its block with a token the host
    does not know yet: the block is hashed only once the token is read. A second request
    that continues the first one's text then hits exactly the blocks a synchronous engine
    finds, and generates the same tokens."""
    (prompt,) = _prompts(1, seed=17)
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    results = []
    for llm in _engines(tiny_llama_gqa):
        first = llm.generate([prompt], params)[0]
        follow = prompt + first.token_ids[:15]
        second = llm.generate([follow], params)[0]
        stats = llm.engine.kv_manager.stats()
        results.append((first.token_ids, second.token_ids, stats.prefix_cache_hits))
        llm.engine.check_integrity()
    (sync_first, sync_second, sync_hits), (first, second, hits) = results
    assert first == sync_first and second == sync_second
    assert hits == sync_hits > len(prompt)


def test_unsupported_combinations_are_refused(tiny_llama_gqa: Path) -> None:
    with pytest.raises(ValueError, match="continuous"):
        LLMEngine(
            EngineConfig(model=str(tiny_llama_gqa), async_scheduling=True, **DEVICE),
            KVPoolConfig(num_blocks=16),
            SchedulerConfig(batching="static"),
        )


def test_random_traffic_matches_synchronous_steps(tiny_llama_gqa: Path) -> None:
    """Random arrivals, lengths, stop tokens, seeded sampling, an occasional penalised
    request and aborts, over a pool small enough to preempt: replayed step by step on a
    synchronous and an asynchronous engine, every request that was not aborted gets the same
    tokens and finish reason from both, an aborted one a prefix of them, and both pools end
    free and consistent."""
    rng = torch.Generator().manual_seed(23)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=rng))

    schedule: list[tuple[int, str, list[int], SamplingParams]] = []  # (step, id, prompt, params)
    aborts: dict[int, str] = {}
    for i in range(28):
        prompt = torch.randint(3, 256, (randint(1, 40),), generator=rng).tolist()
        kind = randint(0, 10)
        params = SamplingParams(
            max_tokens=randint(1, 20),
            temperature=0.0 if kind < 6 else 0.9,
            seed=None if kind < 6 else i,
            stop_token_ids=tuple(randint(3, 256) for _ in range(randint(0, 3))),
            repetition_penalty=1.2 if kind == 9 else 1.0,
            logprobs=1 if kind == 8 else None,
        )
        schedule.append((randint(0, 40), f"q{i}", prompt, params))
        if kind == 7:
            aborts[randint(1, 50)] = f"q{i}"

    def replay(llm: LLM) -> dict[str, tuple[list[int], str | None]]:
        engine = llm.engine
        collect = _Collected()
        tokens, reasons = collect.tokens, collect.reasons
        added: set[str] = set()
        step = 0
        while step < 60 or engine.has_unfinished_requests():
            for at, rid, prompt, params in schedule:
                if at == step:
                    engine.add_request(rid, prompt, params)
                    added.add(rid)
            if step in aborts and aborts[step] in added:
                collect(engine.abort_request([aborts[step]]))
            collect(engine.step())
            engine.check_integrity()
            step += 1
            assert step < 2000, "the engine did not finish"
        assert engine.num_free_blocks == engine.num_total_blocks
        return {rid: (tokens.get(rid, []), reasons.get(rid)) for rid in added}

    small_pool = {"num_kv_blocks": 40}
    sync, overlapped = _engines(tiny_llama_gqa, **small_pool)
    expected, got = replay(sync), replay(overlapped)
    assert sync.engine.scheduler.num_preemptions_total > 0
    assert set(expected) == set(got)
    for rid, (want, want_reason) in expected.items():
        ours, reason = got[rid]
        if "abort" in (reason, want_reason):  # aborted at a different point of its output
            short, long = sorted((ours, want), key=len)
            assert long[: len(short)] == short, rid
        else:
            assert (ours, reason) == (want, want_reason), rid


def test_requests_that_stop_on_a_token_leave_no_sampling_state(tiny_llama_gqa: Path) -> None:
    """A seeded request that ends on a stop token still has a row in the step launched
    before its token was read; that row's pick is dropped, and nothing of the request may
    outlive it: a request that reuses the id starts from its seed again (seeded noise keeps
    no per-request state, being a function of seed and position; the engine's integrity
    check covers the state others keep)."""
    prompts = _prompts(4, seed=29)
    free = [
        SamplingParams(max_tokens=10, temperature=0.9, seed=40 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    sync, overlapped = _engines(tiny_llama_gqa)
    # Each request stops on the token it samples fourth (or earlier, where it repeats).
    params = [
        dataclasses.replace(p, stop_token_ids=(out.token_ids[3],))
        for p, out in zip(free, sync.generate(prompts, free), strict=True)
    ]

    def run(llm: LLM) -> list[dict[str, tuple[list[int], str | None]]]:
        engine = llm.engine
        rounds = []
        for _ in range(2):  # the second round reuses the first one's ids
            collect = _Collected()
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                engine.add_request(f"s{i}", prompt, p)
            while engine.has_unfinished_requests():
                collect(engine.step())
                engine.check_integrity()  # no generator of a finished request is left
            tokens, reasons = collect.tokens, collect.reasons
            rounds.append({rid: (tokens[rid], reasons[rid]) for rid in tokens})
        return rounds

    expected = run(sync)
    assert expected[0] == expected[1]
    assert all(reason == "stop" for _, reason in expected[0].values())
    assert run(overlapped) == expected


class _FailingRead:
    """A launched step whose read raises, as a device fault would."""

    def __init__(self, launched: object) -> None:
        self._launched = launched

    def __getattr__(self, name: str) -> object:
        return getattr(self._launched, name)

    def result(self) -> None:
        raise RuntimeError("injected: the device failed")


def test_a_failed_read_leaves_nothing_behind_once_its_requests_are_aborted(
    tiny_llama_gqa: Path,
) -> None:
    """When reading a step's tokens raises, the server's engine loop aborts every request
    it has in flight and checks the engine's integrity before serving on. A request that
    finished by length at that step's launch is out of the scheduler, so no abort reaches
    it: its sampling state must go all the same, or the check fails and the loop dies."""
    (prompt,) = _prompts(1, seed=31)
    short = SamplingParams(max_tokens=3, temperature=0.9, seed=1, ignore_eos=True)
    long = SamplingParams(max_tokens=10, temperature=0.9, seed=2, ignore_eos=True)
    sync, overlapped = _engines(tiny_llama_gqa)
    expected = sync.generate([prompt], long)[0].token_ids
    engine = overlapped.engine
    engine.add_request("short", prompt, short)
    engine.add_request("long", prompt, long)
    for _ in range(3):
        engine.step()
    in_flight = engine._in_flight
    assert in_flight is not None
    assert [r.request_id for r in in_flight.update.finished] == ["short"]
    in_flight.launched = _FailingRead(in_flight.launched)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    # What the server's engine loop does then (server/engine_client.py, _fail_active).
    assert [o.request_id for o in engine.abort_request(["short", "long"])] == ["long"]
    engine.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.add_request("again", prompt, long)  # and the engine serves on
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert tokens == expected


def test_an_id_is_in_use_until_its_final_output(tiny_llama_gqa: Path) -> None:
    """A request that reaches max_tokens at a step's launch is finished, but its last token
    and final output come once that step is read: an abort meanwhile has nothing to abort,
    and the id stays in use until the final output is out (a new request under it would
    get the old one's final output)."""
    (prompt,) = _prompts(1, seed=37)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _, overlapped = _engines(tiny_llama_gqa)
    engine = overlapped.engine
    engine.add_request("a", prompt, params)
    outputs = engine.step() + engine.step()  # its prompt's step, then its last decode
    assert [len(o.new_token_ids) for o in outputs] == [1] and not outputs[0].finished
    assert engine.abort_request(["a"]) == []
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", prompt, params)
    (last,) = engine.step()
    assert (last.request_id, last.finished, last.finish_reason) == ("a", True, "length")
    engine.add_request("a", prompt, params)  # free again
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_a_steps_figures_are_recorded_when_it_is_read(tiny_llama_gqa: Path) -> None:
    """The step figures (metrics, latency targets, the step trace) describe the step whose
    tokens the call returns, timed from the read before it: a call that only launches
    records nothing, and the one that reads the prefill records the prefill's shape."""
    _, overlapped = _engines(tiny_llama_gqa)
    engine = overlapped.engine
    engine.last_step_stats = None
    prompt = _prompts(1, seed=29)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.step() == [] and engine.last_step_stats is None  # the prefill, launched
    shapes = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        stats = engine.last_step_stats
        assert stats is not None and stats.step_time_s > 0
        shapes.append((stats.num_prefill_tokens, stats.num_decode_tokens, len(outputs)))
    assert shapes == [(len(prompt), 0, 1), (0, 1, 1), (0, 1, 1), (0, 1, 1)]


def test_a_steps_preemptions_and_prefix_hits_are_its_own(tiny_llama_gqa: Path) -> None:
    """The per-step counters (preemptions, prefix-cache lookups and hits) belong to the step
    whose figures carry them: asynchronous steps run the synchronous steps' plans here (no
    stop tokens, so no step waits for a token to be read), so each step's figures must be
    the synchronous step's, not those of the step scheduled after it."""
    (shared,) = _prompts(1, seed=41)  # a block and a token: the later requests hit a block
    prompts = [shared + q for q in _prompts(6, seed=43)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    tiny = {"num_kv_blocks": 26, "max_num_seqs": 6, "max_num_batched_tokens": 64}

    def figures(llm: LLM) -> list[tuple[int, int, int, int, int]]:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, params)
        seen, rows = None, []
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.last_step_stats
            if stats is not None and stats is not seen:
                seen = stats
                rows.append((
                    stats.num_prefill_tokens, stats.num_decode_tokens, stats.num_preemptions,
                    stats.prefix_cache_queries, stats.prefix_cache_hits,
                ))  # fmt: skip
        assert sum(r[2] for r in rows) == engine.scheduler.num_preemptions_total > 0
        kv = engine.kv_manager.stats()
        assert sum(r[3] for r in rows) == kv.prefix_cache_queries
        assert sum(r[4] for r in rows) == kv.prefix_cache_hits > 0
        return rows

    sync, overlapped = _engines(tiny_llama_gqa, **tiny)
    assert figures(overlapped) == figures(sync)
