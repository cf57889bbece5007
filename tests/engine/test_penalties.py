"""Penalties (engine/penalties.py): the batched rule against a per-row reference, and the
per-request token counts the sampler keeps against counts rebuilt from the token lists, step
after step (new requests, growing outputs, speculative drafts, pending tokens, preemption,
forgotten and reused ids, growth past the rows allocated), and an engine that forgets them
when its requests end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.penalties import (
    MIN_CAPACITY,
    TokenCounts,
    _penalise_all,
    _penalise_seen,
    apply_penalties,
)
from scheduler.request import PENDING_TOKEN, Request, SamplingParams
from tests.engine.penalty_reference import reference_penalties

VOCAB = 50
CPU = torch.device("cpu")


def _request(request_id: str, prompt: list[int], output: list[int] = (), **params) -> Request:  # type: ignore[assignment]
    request = Request(request_id, list(prompt), SamplingParams(**params))
    request.output_token_ids.extend(output)
    return request


def _assert_rows(counts: TokenCounts, requests: list[Request], vocab: int = VOCAB) -> None:
    """The gathered rows equal what the token lists give now."""
    seen = counts.seen(requests, vocab)
    for row, r in enumerate(requests):
        output = torch.tensor(r.output_token_ids, dtype=torch.long)
        expected = torch.bincount(output, minlength=vocab)
        assert torch.equal(seen.output_counts[row].long(), expected), r.request_id
        tokens = torch.zeros(vocab, dtype=torch.bool)
        tokens[r.prompt_token_ids + r.output_token_ids] = True
        assert torch.equal(seen.seen[row], tokens), r.request_id


def test_penalties_match_the_per_row_rule() -> None:
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4),
    ]
    requests = [
        _request("a", [1, 4, 4], [7, 7, 9]),
        _request("b", [2], [3, 3, 3, 11]),
        _request("c", [5, 6], []),
    ]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    batched = apply_penalties(logits, TokenCounts(CPU).seen(requests, VOCAB), params)
    for row, (r, p) in enumerate(zip(requests, params, strict=True)):
        expected = reference_penalties(logits[row], r.prompt_token_ids, r.output_token_ids, p)
        torch.testing.assert_close(batched[row], expected)


@pytest.mark.parametrize("seed", range(4))
def test_the_cpu_and_gpu_forms_agree_exactly(seed: int) -> None:
    """The CPU's form (the seen entries only) and the GPU's (every entry) give the same bits,
    on rows mixing every penalty, none, and a repetition penalty below 1, over logits with
    zeros and negative zeros, and on a non-contiguous input."""
    rng = random.Random(seed)
    choices = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, presence_penalty=-0.5),
        SamplingParams(frequency_penalty=0.45, presence_penalty=0.2),
        SamplingParams(repetition_penalty=1.05, frequency_penalty=-1.5, presence_penalty=2.0),
        SamplingParams(),
    ]
    params = [rng.choice(choices) for _ in range(9)]
    requests = [
        _request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))],
                 [rng.randrange(VOCAB) for _ in range(rng.randint(0, 25))])
        for i in range(len(params))
    ]  # fmt: skip
    seen = TokenCounts(CPU).seen(requests, VOCAB)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), VOCAB, generator=g).round(decimals=1)
    logits[:, :5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 1e-30])
    for x in (logits, logits.t().contiguous().t()):
        assert torch.equal(_penalise_seen(x, seen, params), _penalise_all(x, seen, params))
    for row, (r, p) in enumerate(zip(requests, params, strict=True)):
        expected = reference_penalties(logits[row], r.prompt_token_ids, r.output_token_ids, p)
        torch.testing.assert_close(apply_penalties(logits, seen, params)[row], expected)


def test_counts_follow_the_outputs_step_after_step() -> None:
    """A random schedule of requests joining, growing by one or several tokens (speculative
    steps), sitting out steps (preempted: their outputs kept) and ending; the rows equal the
    token lists' counts at every step, and ended requests' rows are reused."""
    rng = random.Random(0)
    counts = TokenCounts(CPU)
    live: list[Request] = []
    next_id = 0
    for _ in range(60):
        if len(live) < 12 and rng.random() < 0.5:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
            output = [rng.randrange(VOCAB) for _ in range(rng.choice((0, 0, 3)))]  # 3: recomputed
            live.append(_request(f"r{next_id}", prompt, output))
            next_id += 1
        for r in live:
            r.output_token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice((1, 1, 4)))]
        if live and rng.random() < 0.3:
            ended = live.pop(rng.randrange(len(live)))
            counts.forget(ended.request_id)
        stepping = [r for r in live if rng.random() < 0.8]
        rng.shuffle(stepping)
        if stepping:
            _assert_rows(counts, stepping)
    assert len(counts) <= 12 + 1
    assert counts.capacity <= 16, "ended requests' rows are reused"


def test_growing_past_the_rows_allocated_keeps_every_row() -> None:
    counts = TokenCounts(CPU)
    requests = [_request(f"r{i}", [i % VOCAB], [i % 7, 1]) for i in range(3 * MIN_CAPACITY + 1)]
    _assert_rows(counts, requests[:MIN_CAPACITY])
    for r in requests[:MIN_CAPACITY]:
        r.output_token_ids.append(9)
    _assert_rows(counts, requests)
    assert counts.capacity == 4 * MIN_CAPACITY


def test_a_reused_request_id_starts_afresh() -> None:
    """An id that names a new request (the old one forgotten, or not yet: a pipelined step
    may sample the old one's row once more) never reads the old one's counts."""
    counts = TokenCounts(CPU)
    old = _request("x", [1, 2], [3, 3, 4])
    _assert_rows(counts, [old])
    new = _request("x", [5], [6])
    _assert_rows(counts, [new])
    counts.forget("x")
    counts.forget("x")  # idempotent
    assert len(counts) == 0
    _assert_rows(counts, [_request("x", [7], [])])


def test_pending_tokens_are_counted_once_resolved() -> None:
    counts = TokenCounts(CPU)
    r = _request("p", [1], [2, 3, PENDING_TOKEN])
    seen = counts.seen([r], VOCAB)
    assert int(seen.output_counts.sum()) == 2
    r.output_token_ids[-1] = 8
    r.output_token_ids.append(8)
    _assert_rows(counts, [r])


def test_a_new_vocabulary_width_recounts() -> None:
    counts = TokenCounts(CPU)
    r = _request("v", [1, 2], [3])
    _assert_rows(counts, [r])
    r.output_token_ids.append(60)
    _assert_rows(counts, [r], vocab=64)


def test_draft_rows_count_the_drafts_before_them() -> None:
    """With drafts, request i has k_i + 1 rows; row j counts its first j drafts as output,
    as plain decoding would have at that position."""
    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.7, presence_penalty=0.3)
    requests = [_request("a", [1, 2], [3, 3]), _request("b", [4], []), _request("c", [9], [9])]
    drafts = [(5, 3, 5), (), (9, 9)]
    counts = TokenCounts(CPU)
    _assert_rows(counts, requests)  # counted once before: drafts never enter the stored counts
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3))
    seen = counts.seen(requests, VOCAB, drafts=drafts)
    batched = apply_penalties(logits, seen, [p] * rows)
    row = 0
    for r, d in zip(requests, drafts, strict=True):
        for j in range(len(d) + 1):
            expected = reference_penalties(
                logits[row], r.prompt_token_ids, r.output_token_ids + list(d[:j]), p
            )
            torch.testing.assert_close(batched[row], expected)
            row += 1
    _assert_rows(counts, requests)


@pytest.mark.parametrize("mode", ["sync", "async", "ngram"])
def test_the_engine_forgets_every_request_it_penalised(tiny_llama_gqa: Path, mode: str) -> None:
    """Stopped, length-limited and aborted penalised requests leave no counts behind, in
    synchronous and asynchronous steps and with speculative decoding (whose verification
    reads the same counts)."""
    extra: dict[str, object] = {"async_scheduling": mode == "async"}
    if mode == "ngram":
        extra.update(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1)
    llm = LLM(str(tiny_llama_gqa), num_kv_blocks=64, device="cpu", dtype="float32", **extra)
    engine = llm.engine
    rng = random.Random(5)
    for i in range(6):
        prompt = [rng.randrange(1, 200) for _ in range(rng.randint(4, 30))]
        # Every third request may also stop on a token: in asynchronous steps its row in
        # the step launched before the read makes counts again, which must go too.
        stop = tuple(range(1, 512, 5)) if i % 3 == 2 else ()
        params = SamplingParams(
            max_tokens=rng.randint(3, 12), temperature=0.0 if i % 2 else 0.8, seed=i,
            ignore_eos=True, repetition_penalty=1.1, frequency_penalty=0.3,
            stop_token_ids=stop,
        )  # fmt: skip
        engine.add_request(f"r{i}", prompt, params)
    reasons = {}
    for _ in range(3):
        reasons.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
        engine.check_integrity()
    assert len(engine.sampler.penalties) > 0
    engine.abort_request(["r0", "r3"])
    while engine.has_unfinished_requests():
        reasons.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
        engine.check_integrity()
    assert len(engine.sampler.penalties) == 0
    assert "stop" in reasons.values() and "length" in reasons.values(), reasons


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counts_and_penalties_equal_the_cpus() -> None:
    """The counts kept on a GPU, over steps and drafts, and the every-entry form applied
    there, give the CPU's logits."""
    rng = random.Random(7)
    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.1)
    requests = [
        _request(f"r{i}", [rng.randrange(VOCAB) for _ in range(30)], [rng.randrange(VOCAB)])
        for i in range(5)
    ]
    cpu, cuda = TokenCounts(CPU), TokenCounts(torch.device("cuda"))
    logits = torch.randn(13, VOCAB, generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        for r in requests:
            r.output_token_ids.append(rng.randrange(VOCAB))
        drafts = [tuple(rng.randrange(VOCAB) for _ in range(i % 3)) for i in range(5)]
        rows = sum(len(d) + 1 for d in drafts)
        expected = apply_penalties(logits[:rows], cpu.seen(requests, VOCAB, drafts), [p] * rows)
        got = apply_penalties(logits[:rows].cuda(), cuda.seen(requests, VOCAB, drafts), [p] * rows)
        torch.testing.assert_close(got.cpu(), expected)
