"""Speculative decoding's host reads: a verify step reads the device once, whatever its
number of rows, and a draft model's proposal reads it once, whatever its number of rows and
drafts (issue 35: no per-request read on the device path); and the batched computations
choose what the row-by-row ones did.

Reads are counted on the CPU by wrapping every tensor-to-Python conversion
(``item``, ``tolist``, ``int()``, ``float()``, ``bool()``, ``operator.index``) of
``torch.Tensor``. On the CPU ``truncated_probs`` (engine/sampler.py) reads its top-k width
from a host tensor it builds (no device wait), so top-k is left out of the counted steps.

Exactness against the row-by-row forms: ``_reference_verify_row`` and
``_reference_draft`` are the per-row code these batched paths replaced; a seeded request,
which draws from its own generators only, gets the same tokens from both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from engine.penalties import TokenCounts
from engine.sampler import truncated_probs
from engine.spec_decode import verify
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.verify import accept_greedy, verify_rows
from scheduler.output import ScheduledRequest
from scheduler.request import Request, SamplingParams
from tests.engine.penalty_reference import reference_penalties

VOCAB = 50
CPU = torch.device("cpu")
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def counting_reads() -> Iterator[list[str]]:
    """Count tensor-to-host conversions while the block runs (the list of their names)."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, original: Callable[..., object]) -> Callable[..., object]:
        def counted(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            calls.append(name)
            return original(self, *args, **kwargs)

        return counted

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


# ---- verification ------------------------------------------------------------------------


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def _reference_accept_sampled(probs, draft_ids, draft_probs, generator):
    """Row-by-row rejection sampling, as verify.py did it before batching."""
    k = len(draft_ids)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist()
    rows = torch.arange(k, device=probs.device)
    drafts = torch.tensor(draft_ids, device=probs.device)
    p_draft = probs[rows, drafts].tolist()
    q_draft = [1.0] * k if draft_probs is None else draft_probs[rows, drafts].tolist()
    emitted: list[int] = []

    def draw(weights: torch.Tensor) -> int:
        noise = torch.empty_like(weights).exponential_(generator=generator)
        return int((weights / noise).argmax())

    for j, token in enumerate(draft_ids):
        if uniforms[j] * q_draft[j] < p_draft[j]:
            emitted.append(token)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[token] = 0.0
        else:
            residual = (probs[j] - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = probs[j]
        emitted.append(draw(residual))
        return emitted
    emitted.append(draw(probs[k]))
    return emitted


def _reference_verify_row(logits, item, generator, draft_probs):
    """One row verified on its own, as the speculator did before batching: tokens, and per
    emitted token its chosen logprob and top alternatives."""
    params = item.request.sampling_params
    drafts = list(item.draft_token_ids)
    k = len(drafts)
    scores = logits
    if params.needs_penalties:
        request = item.request
        scores = torch.stack([
            reference_penalties(logits[j], request.prompt_token_ids,
                                request.output_token_ids + drafts[:j], params)
            for j in range(k + 1)
        ])  # fmt: skip
    if params.greedy:
        emitted = accept_greedy([int(scores[j].argmax()) for j in range(k + 1)], drafts)
    else:
        probs = truncated_probs(scores, [params] * (k + 1))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        emitted = _reference_accept_sampled(probs, drafts, draft_probs, generator)
    logprobs = None
    if params.logprobs is not None:
        raw = torch.log_softmax(logits[: len(emitted)], dim=-1)
        chosen = raw.gather(1, torch.tensor(emitted)[:, None]).squeeze(1).tolist()
        values, indices = raw.topk(max(params.logprobs, 1), dim=-1)
        logprobs = [
            (token, chosen[j], indices[j, : params.logprobs].tolist(),
             values[j, : params.logprobs].tolist())
            for j, token in enumerate(emitted)
        ]  # fmt: skip
    return emitted, logprobs


# Sampling parameters of the mixed batches: greedy, penalised, sampled with every
# truncation, logprobs; the sampled ones seeded (their own generators).
MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2),
    SamplingParams(temperature=0.8, top_k=20, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, seed=2, logprobs=0),
    SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5, seed=3, logprobs=3),
    SamplingParams(temperature=1.2, frequency_penalty=0.3, seed=4),
]


def _step(
    rng: random.Random, params: list[SamplingParams], with_q: list[bool]
) -> tuple[torch.Tensor, list[ScheduledRequest], list[torch.Tensor | None]]:
    """A verify step: per request a row of 1..5 drafts (mostly the target's likely tokens,
    so that drafts are kept and rejected), peaked logits, and, where ``with_q``, the
    drafts' distribution with the drafts drawn from it."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    items, blocks, draft_probs = [], [], []
    for n, (p, q_too) in enumerate(zip(params, with_q, strict=True)):
        k = rng.randrange(1, 6)
        logits = torch.randn(k + 1, VOCAB, generator=gen) * 3
        q = None
        if q_too:
            q = torch.softmax(torch.randn(k, VOCAB, generator=gen) * 2, dim=-1)
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        else:
            drafts = [
                int(logits[j].argmax()) if rng.random() < 0.7 else rng.randrange(VOCAB)
                for j in range(k)
            ]
        request = Request(f"r{n}", [rng.randrange(VOCAB) for _ in range(6)], p)
        request.output_token_ids = [rng.randrange(VOCAB) for _ in range(3)]
        items.append(
            ScheduledRequest(
                request,
                9,
                k + 1,
                [request.output_token_ids[-1], *drafts],
                (0,),
                True,
                draft_token_ids=tuple(drafts),
            )  # fmt: skip
        )
        blocks.append(logits)
        draft_probs.append(q)
    return torch.cat(blocks), items, draft_probs


def _generators(items: list[ScheduledRequest]) -> dict[str, torch.Generator]:
    """A seeded request's own stream; the unseeded ones share one."""
    shared = torch.Generator().manual_seed(99)
    return {
        item.request_id: (
            torch.Generator().manual_seed(item.request.sampling_params.seed)
            if item.request.sampling_params.seed is not None
            else shared
        )
        for item in items
    }


# The sampled requests verified one by one (the CPU's way), or all together (the others').
GROUPINGS = {"per request": None, "all together": lambda device, sampled: [sampled]}


@pytest.fixture(params=list(GROUPINGS))
def grouping(request, monkeypatch) -> None:
    if GROUPINGS[request.param] is not None:
        monkeypatch.setattr(verify, "sampled_groups", GROUPINGS[request.param])


@pytest.mark.usefixtures("grouping")
def test_batched_verification_chooses_what_row_by_row_verification_did():
    """Mixed steps (greedy, penalised, every truncation, point masses and draft
    distributions, logprobs): each seeded or greedy request's tokens, logprobs and
    alternatives equal the row-by-row verification's."""
    rng = random.Random(0)
    kept = rejected = 0
    for _ in range(40):
        params = rng.sample(MIXED, rng.randrange(1, len(MIXED) + 1))
        with_q = [not p.greedy and rng.random() < 0.5 for p in params]
        logits, items, draft_probs = _step(rng, params, with_q)
        gens = _generators(items)
        results = verify_rows(logits, items, argmax=_argmax, penalties=TokenCounts(CPU),
                              generator=lambda r, g=gens: g[r.request_id],
                              draft_probs=draft_probs)  # fmt: skip
        gens = _generators(items)
        offset = 0
        for item, q, result in zip(items, draft_probs, results, strict=True):
            rows = logits[offset : offset + item.num_tokens]
            offset += item.num_tokens
            tokens, logprobs = _reference_verify_row(rows, item, gens[item.request_id], q)
            assert result.token_ids == tokens, item.request.sampling_params
            assert result.num_drafts == len(item.draft_token_ids)
            kept += result.num_accepted
            rejected += result.num_accepted < result.num_drafts
            if logprobs is None:
                assert result.logprobs is None
                continue
            assert result.logprobs is not None
            for ours, (token, chosen, top_ids, top_values) in zip(
                result.logprobs, logprobs, strict=True
            ):
                assert ours.token_id == token
                assert ours.logprob == pytest.approx(chosen, abs=1e-6)
                assert [t for t, _ in ours.top] == top_ids
                assert [v for _, v in ours.top] == pytest.approx(top_values, abs=1e-6)
    assert kept > 20 and rejected > 20, (kept, rejected)


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0)],
        [SamplingParams(temperature=0.8, top_p=0.9)],
        [SamplingParams(temperature=0.8, seed=7)],
        [p for p in MIXED if p.top_k == 0],
    ],
    ids=["greedy", "sampled", "seeded", "mixed with penalties and logprobs"],
)
@pytest.mark.usefixtures("grouping")
def test_a_verify_step_reads_the_device_once_at_any_batch_size(params):
    counts = []
    for batch in (1, 8):
        rng = random.Random(batch)
        step_params = [params[i % len(params)] for i in range(batch)]
        with_q = [not p.greedy and i % 2 == 1 for i, p in enumerate(step_params)]
        logits, items, draft_probs = _step(rng, step_params, with_q)
        gens = _generators(items)
        with counting_reads() as reads:
            verify_rows(logits, items, argmax=_argmax, penalties=TokenCounts(CPU),
                        generator=lambda r, g=gens: g[r.request_id],
                        draft_probs=draft_probs)  # fmt: skip
        counts.append(reads)
    assert counts[0] == counts[1] == ["tolist"], counts


def test_the_speculator_verifies_a_step_with_one_read():
    """Through ``SpeculativeDecoder.verify`` (its generators, its draft distributions)."""
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.speculator import SpeculativeDecoder

    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram"), 64, seed=0,
                                 device=torch.device("cpu"), argmax=_argmax,
                                 penalties=TokenCounts(torch.device("cpu")))  # fmt: skip
    for batch in (1, 8):
        params = [p for p in MIXED if p.top_k == 0]
        logits, items, _ = _step(random.Random(batch), [params[i % 5] for i in range(batch)],
                                 [False] * batch)  # fmt: skip
        with counting_reads() as reads:
            results = decoder.verify(logits, items)
        assert reads == ["tolist"]
        assert [len(r.token_ids) >= 1 for r in results] == [True] * batch


# ---- draft-model proposals ---------------------------------------------------------------


class _ChainForward:
    """A draft model whose logits at a position depend on that position's input token only
    (a fixed random table), so the drafts a request should get follow from its last token."""

    def __init__(self) -> None:
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
        self.inputs: list[torch.Tensor] = []  # every pass's input tokens (checked after)

    def __call__(self, batch, key_caches, value_caches) -> torch.Tensor:
        self.inputs.append(batch.input_ids.clone())
        return self.table[batch.input_ids.index_select(0, batch.logits_indices)]


def _proposer() -> DraftModelProposer:
    storage = SimpleNamespace(num_blocks=256, block_size=4, key_caches=[], value_caches=[])
    return DraftModelProposer(_ChainForward(), storage, torch.device("cpu"), _argmax)  # type: ignore[arg-type]


def _reference_draft(table: torch.Tensor, last: int, k: int, params, gen) -> list[int]:
    """A request's drafts row by row, as the proposer drew them before batching."""
    drafts = []
    for _ in range(k):
        logits = table[last]
        if params.greedy:
            last = int(logits.argmax())
        else:
            q = truncated_probs(logits[None].float(), [params])[0]
            q = q / q.sum()
            noise = torch.empty_like(q).exponential_(generator=gen)
            last = int((q / noise).argmax())
        drafts.append(last)
    return drafts


DRAFT_PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=0.6, top_p=0.8, seed=12),
    SamplingParams(temperature=1.0),
]


def _requests(batch: int) -> tuple[list[Request], dict[str, int]]:
    rng = random.Random(batch)
    requests = [
        Request(
            f"d{i}",
            [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 9))],
            DRAFT_PARAMS[i % len(DRAFT_PARAMS)],
        )  # fmt: skip
        for i in range(batch)
    ]
    return requests, {r.request_id: 1 + i % 4 for i, r in enumerate(requests)}


def test_draft_proposals_feed_their_picks_on_the_device_and_match_row_by_row_drafts():
    proposer = _proposer()
    requests, num_tokens = _requests(8)
    gens = {r.request_id: torch.Generator().manual_seed(r.sampling_params.seed or 0)
            for r in requests}  # fmt: skip
    proposals = proposer.propose(requests, num_tokens, lambda r: gens[r.request_id])
    table = proposer.forward.table  # type: ignore[attr-defined]
    inputs = torch.cat(proposer.forward.inputs)  # type: ignore[attr-defined]
    assert bool((inputs >= 0).all()), "a pending draft input was not fed"
    for request in requests:
        proposal = proposals[request.request_id]
        k, params = num_tokens[request.request_id], request.sampling_params
        assert len(proposal.token_ids) == k
        if params.greedy:
            assert proposal.probs is None
        else:
            assert proposal.probs is not None and proposal.probs.shape == (k, VOCAB)
            assert torch.allclose(proposal.probs.sum(dim=-1), torch.ones(k))
        if params.seed is None and not params.greedy:
            continue  # the shared stream: its draws depend on the batch
        gen = torch.Generator().manual_seed(params.seed or 0)
        last = request.prompt_token_ids[-1]
        assert proposal.token_ids == _reference_draft(table, last, k, params, gen), params


def test_a_draft_proposal_reads_the_device_once_at_any_batch_size():
    counts = []
    for batch in (1, 8):
        proposer = _proposer()
        requests, num_tokens = _requests(batch)
        num_tokens = {request_id: 4 for request_id in num_tokens}
        shared = torch.Generator().manual_seed(0)
        with counting_reads() as reads:
            proposals = proposer.propose(requests, num_tokens, lambda r, g=shared: g)
        assert len(proposals) == batch
        counts.append(reads)
    assert counts[0] == counts[1] == ["tolist"], counts
