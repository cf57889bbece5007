"""The batched sampler against a per-row reference of the same rules.

The reference below is the one-row-at-a-time formulation (HF's repetition rule, OpenAI's
subtractive frequency/presence rule, then temperature, top-k, top-p, min-p): the batched
sampler must compute the same penalised logits and the same truncated distribution for every
row of a batch that mixes parameters, and draw from exactly that distribution.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, apply_penalties, truncated_probs
from scheduler.output import ScheduledRequest
from scheduler.request import Request, SamplingParams

VOCAB = 50


def _item(request_id: str, params: SamplingParams, prompt=(1, 2, 3), output=()) -> ScheduledRequest:
    request = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params)
    request.output_token_ids.extend(output)
    return ScheduledRequest(
        request, start=0, num_tokens=1, token_ids=[1], block_ids=(0,), samples=True
    )


def _ref_penalties(row: torch.Tensor, item: ScheduledRequest, p: SamplingParams) -> torch.Tensor:
    row = row.clone()
    request = item.request
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(request.prompt_token_ids + request.output_token_ids).unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if request.output_token_ids:
        out = torch.tensor(request.output_token_ids)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = row / p.temperature
    if 0 < p.top_k < logits.shape[0]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[before >= p.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=-1),
]


def test_truncation_matches_the_per_row_rule() -> None:
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    batched = truncated_probs(logits, MIXED)
    for row, p in enumerate(MIXED):
        ref = _ref_probs(logits[row], p)
        assert torch.equal(batched[row] > 0, ref > 0), f"row {row}: different support"
        torch.testing.assert_close(batched[row], ref, rtol=1e-6, atol=1e-7)


def test_penalties_match_the_per_row_rule() -> None:
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4),
    ]
    items = [
        _item("a", params[0], prompt=(1, 4, 4), output=(7, 7, 9)),
        _item("b", params[1], prompt=(2,), output=(3, 3, 3, 11)),
        _item("c", params[2], prompt=(5, 6), output=()),
    ]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    batched = apply_penalties(logits, items, params)
    for row in range(3):
        torch.testing.assert_close(
            batched[row], _ref_penalties(logits[row], items[row], params[row])
        )


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1),
    ]
    items = [_item(str(i), p) for i, p in enumerate(params)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = Sampler(0, torch.device("cpu"))(logits, items)
    argmax = logits.argmax(dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert logprobs == [None, None, None]


def test_draws_follow_the_truncated_distribution() -> None:
    """Many rows of the same logits: the empirical frequencies match the reference
    probabilities (a chi-square-sized bound), and no truncated token is ever drawn."""
    base = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    rows = 20000
    items = [_item(str(i), p) for i in range(rows)]
    tokens, _ = Sampler(7, torch.device("cpu"))(base.expand(rows, VOCAB).contiguous(), items)
    ref = _ref_probs(base, p)
    ref = ref / ref.sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / rows
    assert (counts[ref == 0] == 0).all(), "a truncated token was drawn"
    assert (counts - ref.double()).abs().max() < 0.02


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=1.0, seed=123)
    alone = Sampler(0, torch.device("cpu"))(logits[:1], [_item("s", seeded)])[0]
    others = [_item(str(i), SamplingParams(temperature=1.0)) for i in range(3)]
    batched = Sampler(99, torch.device("cpu"))(
        logits[[1, 0, 2, 3]], [others[0], _item("s", seeded), others[1], others[2]]
    )[0]
    assert batched[1] == alone[0]


@pytest.mark.parametrize("num", [0, 3])
def test_logprobs_are_the_raw_log_softmax(num: int) -> None:
    params = [SamplingParams(temperature=0, logprobs=num), SamplingParams(temperature=0)]
    items = [_item(str(i), p) for i, p in enumerate(params)]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    tokens, logprobs = Sampler(0, torch.device("cpu"))(logits, items)
    lp = torch.log_softmax(logits[0], dim=-1)
    assert logprobs[1] is None
    assert logprobs[0].token_id == tokens[0]
    assert logprobs[0].logprob == pytest.approx(float(lp[tokens[0]]))
    top = lp.topk(num) if num else None
    assert [t for t, _ in logprobs[0].top] == (top.indices.tolist() if top else [])
