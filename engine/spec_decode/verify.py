"""Verification: which proposed tokens a request keeps, from the target's logits at every
position of its speculative row.

A speculative row of ``k`` drafts gives ``k + 1`` rows of target logits: row ``j`` is the
target's distribution for the token after the known tokens and drafts ``d1 .. dj``::

    input      | t (last known) | d1 | d2 | ... | dk |
    logits row |       0        |  1 |  2 | ... |  k |
    verifies   |       d1       | d2 | d3 | ... | (the bonus token)

Greedy requests keep the longest prefix of drafts equal to the target's argmax, then the
target's argmax after it: exactly the tokens plain decoding would emit.

Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023), which
emits tokens distributed exactly as the target's (after penalties, temperature, top-k,
top-p, min-p): draft ``dj`` drawn from ``q`` is kept with probability ``min(1, p(dj) /
q(dj))``; at the first rejection the token is drawn from the residual ``max(0, p - q)``
renormalised, and the rest is dropped; if all are kept the bonus is drawn from row ``k``.
An n-gram proposal is deterministic, a point mass: ``q = one_hot(dj)``, so the draft is kept
with probability ``p(dj)`` and the residual is ``p`` with ``dj`` removed.

Penalties see the drafts before each row: row ``j`` is penalised as if ``d1 .. dj`` were
already output, as plain decoding would have them then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from engine.outputs import TokenLogprob
from engine.sampler import apply_penalties, truncated_probs
from scheduler.output import ScheduledRequest


def accept_greedy(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """Args:
        target_ids: the target's choice at each of the ``k + 1`` rows.
        draft_ids: the ``k`` drafts.
    Returns:
        The longest prefix of drafts that matches the target's choices, then the target's
        choice after it (1 to k + 1 tokens).
    """
    emitted = []
    for draft, target in zip(draft_ids, target_ids, strict=False):
        if draft != target:
            break
        emitted.append(draft)
    emitted.append(target_ids[len(emitted)])
    return emitted


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the (unnormalised, non-negative) ``probs`` ([vocab])."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def accept_sampled(
    probs: torch.Tensor,  # [k + 1, vocab] the target's normalised probabilities
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab] q, normalised; None: point masses
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling over one speculative row (module docstring).

    Args:
        probs: the target's distribution at every row.
        draft_ids: the ``k`` drafts.
        draft_probs: the distribution each draft was drawn from, or None when the drafts
            are deterministic (n-gram proposals, greedy drafts).
        generator: the request's random stream.
    Returns:
        The emitted tokens (1 to k + 1), distributed as plain sampling from the target.
    """
    k = len(draft_ids)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist()
    rows = torch.arange(k, device=probs.device)
    drafts = torch.tensor(draft_ids, device=probs.device)
    p_draft = probs[rows, drafts].tolist()
    q_draft = [1.0] * k if draft_probs is None else draft_probs[rows, drafts].tolist()
    emitted: list[int] = []
    for j, token in enumerate(draft_ids):
        # u < p / q, with q > 0 because the draft was drawn from q.
        if uniforms[j] * q_draft[j] < p_draft[j]:
            emitted.append(token)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[token] = 0.0
        else:
            residual = (probs[j] - draft_probs[j]).clamp_(min=0.0)
        # A residual with no mass means p <= q everywhere, i.e. p == q up to rounding,
        # where a rejection has probability ~0: fall back to p itself.
        if float(residual.sum()) <= 0.0:
            residual = probs[j]
        emitted.append(_draw(residual, generator))
        return emitted
    emitted.append(_draw(probs[k], generator))
    return emitted


@dataclass(slots=True)
class Verification:
    """One speculative row's result: the emitted tokens and, if asked for, their logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def _row_views(item: ScheduledRequest) -> list[SimpleNamespace]:
    """Per logits row, the request as plain decoding would see it there (drafts before the
    row counted as output), for ``apply_penalties``."""
    request = item.request
    drafts = list(item.draft_token_ids)
    return [
        SimpleNamespace(
            request=SimpleNamespace(
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids + drafts[:j],
            )
        )
        for j in range(len(drafts) + 1)
    ]


def verify_row(
    logits: torch.Tensor,  # [k + 1, vocab] float32, raw
    item: ScheduledRequest,
    *,
    argmax: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None,
    argmax_ids: list[int] | None = None,
) -> Verification:
    """Verify one speculative row against its target logits.

    Args:
        logits: the target's raw logits at the row's ``k + 1`` positions.
        item: the row (its drafts, its request's sampling parameters and tokens).
        argmax: the greedy pick, the sampler's own (same tie rule as plain decoding).
        generator: the request's random stream (sampled requests only).
        draft_probs: the draft distribution of each draft, or None (point masses).
        argmax_ids: ``argmax(logits)`` per row if the caller has it (one batched call for
            the step's rows); used by greedy requests without penalties.
    """
    params = item.request.sampling_params
    drafts = list(item.draft_token_ids)
    k = len(drafts)
    scores = logits
    if params.needs_penalties:
        scores = apply_penalties(logits, _row_views(item), [params] * (k + 1))  # type: ignore[arg-type]
    if params.greedy:
        if argmax_ids is None or params.needs_penalties:
            argmax_ids = [int(argmax(scores[j : j + 1])[0]) for j in range(k + 1)]
        emitted = accept_greedy(argmax_ids, drafts)
    else:
        probs = truncated_probs(scores, [params] * (k + 1))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        emitted = accept_sampled(probs, drafts, draft_probs, generator)
    logprobs = None
    if params.logprobs is not None:
        raw = torch.log_softmax(logits[: len(emitted)], dim=-1)
        ids = torch.tensor(emitted, device=logits.device)
        chosen = raw.gather(1, ids[:, None]).squeeze(1).tolist()
        top_v: list[list[float]] = []
        top_i: list[list[int]] = []
        if params.logprobs > 0:
            values, indices = raw.topk(params.logprobs, dim=-1)
            top_v, top_i = values.tolist(), indices.tolist()
        logprobs = [
            TokenLogprob(
                token,
                chosen[j],
                list(zip(top_i[j], top_v[j], strict=True)) if params.logprobs > 0 else [],
            )
            for j, token in enumerate(emitted)
        ]
    return Verification(emitted, logprobs, k)
