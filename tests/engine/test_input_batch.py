"""build_input_batch (engine/input_batch.py): the decode-only array path and the packed host
staging give exactly the tensors of a plain per-request construction, for every kind of row."""

from __future__ import annotations

import random

import pytest
import torch

from engine.input_batch import MIN_ARRAY_ROWS, HostStaging, InputBatch, build_input_batch
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, SamplingParams

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _row(
    rng: random.Random,
    start: int,
    num_tokens: int,
    *,
    samples: bool = True,
    padding: bool = False,
    drafts: tuple[int, ...] = (),
) -> ScheduledRequest:
    request = Request(f"r{rng.random()}", [rng.randrange(100) for _ in range(start + num_tokens)],
                      SamplingParams())  # fmt: skip
    num_blocks = -(-(start + num_tokens) // BLOCK_SIZE) + rng.randrange(2)  # some hold spare
    return ScheduledRequest(
        request=request,
        start=start,
        num_tokens=num_tokens,
        token_ids=[rng.randrange(100) for _ in range(num_tokens)],
        block_ids=tuple(rng.sample(range(1000), num_blocks)),
        samples=samples,
        padding=padding,
        draft_token_ids=drafts,
    )


def _expected(rows: list[ScheduledRequest]) -> dict[str, object]:
    """The batch built one request at a time, as the layout in engine/input_batch.py says."""
    ordered = [r for r in rows if r.num_tokens == 1] + [r for r in rows if r.num_tokens != 1]
    ids, positions, slots, starts = [], [], [], [0]
    sampled, verified, padded = [], [], []
    for r in ordered:
        for j in range(r.num_tokens):
            p = r.start + j
            ids.append(r.token_ids[j])
            positions.append(p)
            if not r.padding:
                slots.append(r.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        if r.padding:
            slots.append(-1)
        last = len(ids) - 1
        if r.padding:
            padded.append(last)
        elif r.draft_token_ids:
            verified.extend(range(last - r.num_tokens + 1, last + 1))
        elif r.samples:
            sampled.append(last)
        starts.append(len(ids))
    width = max(len(r.block_ids) for r in ordered)
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "logits_indices": sampled + verified + padded,
        "seq_lens": [r.start + r.num_tokens for r in ordered],
        "query_start_loc": starts,
        "block_tables": [list(r.block_ids) + [0] * (width - len(r.block_ids)) for r in ordered],
        "num_decodes": sum(r.num_tokens == 1 for r in rows),
        "max_seq_len": max(r.start + r.num_tokens for r in rows),
        "all_rows": sampled + verified + padded == list(range(len(ids))),
    }


def _check(batch: InputBatch, rows: list[ScheduledRequest]) -> None:
    want = _expected(rows)
    got = {
        "input_ids": batch.input_ids,
        "positions": batch.positions,
        "slot_mapping": batch.slot_mapping,
        "logits_indices": batch.logits_indices,
        "seq_lens": batch.attn.seq_lens,
        "query_start_loc": batch.attn.query_start_loc,
        "block_tables": batch.attn.block_tables,
    }
    for name, tensor in got.items():
        int32 = name in ("seq_lens", "query_start_loc", "block_tables")
        assert tensor.dtype == (torch.int32 if int32 else torch.int64), name
        assert tensor.is_contiguous(), name
        assert tensor.tolist() == want[name], name
    assert batch.attn.num_decodes == want["num_decodes"]
    assert batch.attn.max_seq_len == want["max_seq_len"]
    assert batch.logits_are_all_rows == want["all_rows"]
    expected_sampling = [r for r in rows if r.num_tokens == 1 and r.samples and not r.padding]
    expected_sampling += [
        r for r in rows if r.num_tokens != 1 and r.samples and not r.draft_token_ids
    ]
    assert [id(r) for r in batch.sampling] == [id(r) for r in expected_sampling]


def _plans(rng: random.Random) -> list[list[ScheduledRequest]]:
    # Past MIN_ARRAY_ROWS, so the array path runs without staging too.
    decodes = [_row(rng, rng.randrange(40), 1) for _ in range(MIN_ARRAY_ROWS + 4)]
    even = [_row(rng, 8 + i, 1) for i in range(3)]  # equal tables: 3 blocks each, no spare
    even = [
        ScheduledRequest(r.request, r.start, 1, r.token_ids, r.block_ids[:3], True) for r in even
    ]
    return [
        [_row(rng, 0, 1)],
        decodes,
        even,
        # A one-token chunk that does not reach the prompt's end samples nothing.
        [*decodes[:3], _row(rng, 5, 1, samples=False), decodes[3]],
        [*decodes, _row(rng, 5, 1, samples=False), _row(rng, 30, 1)],
        # Mixed: prefill chunks (one not sampling), padding, a speculative row.
        [
            decodes[0],
            _row(rng, 0, 7),
            _row(rng, 12, 5, samples=False),
            _row(rng, 20, 1, samples=False, padding=True),
            _row(rng, 9, 4, drafts=(3, 4, 5)),
            decodes[1],
        ],
    ]


@pytest.mark.parametrize("staged", [False, True])
def test_every_plan_gives_the_per_request_tensors(staged: bool) -> None:
    rng = random.Random(3)
    # A small buffer, so a larger step makes it grow.
    staging = HostStaging(CPU, num_bytes=64) if staged else None
    batches = []
    for rows in _plans(rng) * 2:
        batch = build_input_batch(SchedulerOutput(scheduled=rows), BLOCK_SIZE, CPU, staging)
        _check(batch, rows)
        batches.append((batch, rows))
    # A staged batch owns its tensors: later steps reuse the buffer, not the batch's memory.
    for batch, rows in batches:
        _check(batch, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_on_cuda_gives_the_same_tensors() -> None:
    """The runner's CUDA staging: one pinned buffer, one copy, views of one device tensor;
    refilled for the next step only after this one's copy is done."""
    rng = random.Random(5)
    cuda = torch.device("cuda")
    staging = HostStaging(cuda, num_bytes=64)
    batches = []
    for rows in _plans(rng) * 3:
        batch = build_input_batch(SchedulerOutput(scheduled=rows), BLOCK_SIZE, cuda, staging)
        assert batch.input_ids.device.type == "cuda"
        batches.append((batch, rows))
    torch.cuda.synchronize()
    for batch, rows in batches:
        _check(batch, rows)
