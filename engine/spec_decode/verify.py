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
emits tokens distributed exactly as the target's (after token biases, penalties, temperature, top-k,
top-p, min-p): draft ``dj`` drawn from ``q`` is kept with probability ``min(1, p(dj) /
q(dj))``; at the first rejection the token is drawn from the residual ``max(0, p - q)``
renormalised, and the rest is dropped; if all are kept the bonus is drawn from row ``k``.
An n-gram proposal is deterministic, a point mass: ``q = one_hot(dj)``, so the draft is kept
with probability ``p(dj)`` and the residual is ``p`` with ``dj`` removed.

Penalties see the drafts before each row: row ``j`` is penalised as if ``d1 .. dj`` were
already output, as plain decoding would have them then.

One step's rows are verified together, on the logits' device, with one host read
(``verify_rows``): the greedy rows' argmax over all their rows at once; for the sampled
rows, every draft's test at once, each request's first rejected row found on the device
(a cumulative product of the tests), and the draw from the residual at that row. The host
then takes, per request, the drafts before the first rejection (a greedy draft is rejected
where it differs from the argmax) and the token chosen at it. A request draws from its
stream what it drew row by row (its k uniforms, then one row of noise), so a seeded
request's tokens do not change; requests without a seed share one stream and draw from it
together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.penalties import TokenCounts, apply_penalties
from engine.sampler import truncated_probs
from engine.to_device import on_device
from engine.token_bias import apply_token_bias, has_token_bias, row_bias
from scheduler.output import ScheduledRequest
from scheduler.request import Request


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


def argmax_rows(
    argmax: Callable[[torch.Tensor], torch.Tensor],
    scores: torch.Tensor,  # [rows, vocab]
) -> torch.Tensor:
    """[rows] int64: each row's argmax, by ``argmax`` (the sampler's rule), left on the device.

    NOTE: on the CPU, one call per row: a call over several rows splits them over the
    thread team (torch's argmax and the C++ kernel's alike), and waking the team on a busy
    machine costs far more than one row's argmax, where a one-row call runs on the calling
    thread. The rows are still joined on the device and read with the rest of the step.
    """
    if scores.device.type == "cpu" and scores.shape[0] > 1:
        return torch.cat([argmax(scores[i : i + 1]) for i in range(scores.shape[0])])
    return argmax(scores)


def draw_uniforms_and_noise(
    generators: Sequence[torch.Generator],
    num_uniforms: Sequence[int],
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per row ``i``: ``num_uniforms[i]`` U(0, 1) draws, then ``vocab`` i.i.d. Exp(1) draws,
    from ``generators[i]``.

    A row with a generator of its own (a seeded request) draws exactly what it would
    alone: its uniforms, then its noise, one call each. Rows sharing a generator (requests
    without a seed share one) draw together: all their uniforms in one call, then all their
    noise in one call.

    Returns:
        Each row's uniforms ([num_uniforms[i]] float32), and the noise ([rows, vocab]).
    """
    groups: dict[int, list[int]] = {}
    for i, gen in enumerate(generators):
        groups.setdefault(id(gen), []).append(i)
    uniforms = [torch.empty(0, device=device)] * len(generators)
    noise = torch.empty(len(generators), vocab, dtype=dtype, device=device)
    for members in groups.values():
        gen = generators[members[0]]
        sizes = [num_uniforms[i] for i in members]
        if sum(sizes):
            drawn = torch.rand(sum(sizes), generator=gen, device=device)
            for i, part in zip(members, torch.split(drawn, sizes), strict=True):
                uniforms[i] = part
        if len(members) == 1:
            noise[members[0]].exponential_(generator=gen)
        else:
            block = torch.empty(len(members), vocab, dtype=dtype, device=device)
            noise[on_device(device, members)] = block.exponential_(generator=gen)
    return uniforms, noise


@dataclass(slots=True)
class _Sampled:
    """The sampled requests' verdicts, on the device."""

    accepted: torch.Tensor  # [num_drafts] bool: whether each draft is kept, in row order
    # [requests] int64: each request's draw at its first rejected row (or its bonus row)
    picks: torch.Tensor
    # [rows] int64: the token each row emits if it is at or before its request's first
    # rejection (its draft where kept, else the draw)
    emitted: torch.Tensor

    @staticmethod
    def join(parts: list[_Sampled]) -> _Sampled:
        """The verdicts of consecutive groups of requests as one."""
        if len(parts) == 1:
            return parts[0]
        return _Sampled(
            torch.cat([v.accepted for v in parts]),
            torch.cat([v.picks for v in parts]),
            torch.cat([v.emitted for v in parts]),
        )


def _rejection_sample(
    probs: torch.Tensor,  # [rows, vocab] the target's normalised probabilities
    draft_ids: Sequence[Sequence[int]],  # per request, its k drafts
    draft_probs: Sequence[torch.Tensor | None],  # per request, [>= k, vocab] q, or None
    generators: Sequence[torch.Generator],  # per request, its random stream
) -> _Sampled:
    """Rejection sampling (module docstring) over several requests' rows at once: request
    ``i`` owns the next ``k_i + 1`` rows of ``probs``. Every draft is tested; the residual
    is formed and drawn from at each request's first rejected row only (found on the
    device), so the work over the vocabulary is one row per request, as row by row."""
    device = probs.device
    ks = [len(d) for d in draft_ids]
    num_requests, width = len(ks), max(ks) + 1
    firsts = [0]  # each request's first draft, in draft order
    for k in ks:
        firsts.append(firsts[-1] + k)
    # Each draft's row of ``probs``, and its place in the padded [requests, width] layout.
    rows = on_device(device, [i + j + firsts[i] for i, k in enumerate(ks) for j in range(k)])
    padded_at = on_device(device, [i * width + j for i, k in enumerate(ks) for j in range(k)])
    ids = on_device(device, [t for d in draft_ids for t in d])
    with_q = [i for i, dp in enumerate(draft_probs) if dp is not None]
    # q of each draft: 1 for a point mass, else its distribution's.
    q_rows = None  # [drafts of with_q, vocab]
    if with_q:
        q_drafts = torch.ones(len(ids), dtype=probs.dtype, device=device)
        q_rows = torch.cat([draft_probs[i][: ks[i]] for i in with_q]).to(probs.dtype)  # type: ignore[index]
        at = on_device(device, [firsts[i] + j for i in with_q for j in range(ks[i])])
        q_drafts[at] = q_rows.gather(1, ids[at][:, None]).squeeze(1)
    uniforms, noise = draw_uniforms_and_noise(generators, ks, probs.shape[1], probs.dtype, device)
    # u < p / q, with q > 0 because the draft was drawn from q; in float64, where the
    # product of two float32 values is exact.
    u = (torch.cat(uniforms) if len(uniforms) > 1 else uniforms[0]).double()
    if with_q:
        u = u * q_drafts.double()
    accepted = u < probs[rows, ids].double()

    # Each request's first rejected row: the number of drafts kept before it.
    kept = torch.zeros(num_requests * width, dtype=torch.long, device=device)
    kept[padded_at] = accepted.long()
    num_kept = kept.view(num_requests, width).cumprod(dim=1).sum(dim=1)  # [requests]
    k_t = on_device(device, ks)
    at_draft = (num_kept < k_t)[:, None]  # [requests, 1]: a draft rejected (else: bonus)
    padded_ids = torch.zeros(num_requests * width, dtype=torch.long, device=device)
    padded_ids[padded_at] = ids
    padded_ids = padded_ids.view(num_requests, width)
    starts = on_device(device, [i + firsts[i] for i in range(num_requests)])
    p = probs[starts + num_kept]  # [requests, vocab]
    # The residual max(0, p - q) at that row: p without the rejected draft for a point
    # mass; p itself on the bonus row (q = 0 there).
    rejected = padded_ids.gather(1, num_kept[:, None])
    p_rejected = p.gather(1, rejected)
    residual = p.scatter(1, rejected, torch.where(at_draft, 0.0, p_rejected))
    if q_rows is not None:
        index = on_device(device, with_q)
        q_firsts = on_device(device, [sum(ks[i] for i in with_q[:n]) for n in range(len(with_q))])
        q = q_rows[q_firsts + num_kept[index].clamp(max=k_t[index] - 1)]
        residual[index] = (p[index] - q * at_draft[index].to(q.dtype)).clamp_(min=0.0)
    # A residual with no mass means p <= q everywhere, i.e. p == q up to rounding, where a
    # rejection has probability ~0: fall back to p itself.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0.0, residual, p)
    picks = (residual / noise).argmax(dim=-1)
    steps = torch.arange(width, device=device)
    emitted = torch.where(steps[None, :] < num_kept[:, None], padded_ids, picks[:, None])
    if num_requests > 1:  # back from the padded layout to the rows
        emitted = emitted.flatten()[
            on_device(device, [i * width + j for i, k in enumerate(ks) for j in range(k + 1)])
        ]
    return _Sampled(accepted, picks, emitted.flatten())


def accept_sampled(
    probs: torch.Tensor,  # [k + 1, vocab] the target's normalised probabilities
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,  # [k, vocab] q, normalised; None: point masses
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling over one speculative row (module docstring); ``verify_rows``
    does the same for a step's rows together.

    Args:
        probs: the target's distribution at every row.
        draft_ids: the ``k`` drafts.
        draft_probs: the distribution each draft was drawn from, or None when the drafts
            are deterministic (n-gram proposals, greedy drafts).
        generator: the request's random stream.
    Returns:
        The emitted tokens (1 to k + 1), distributed as plain sampling from the target.
    """
    sampled = _rejection_sample(probs, [draft_ids], [draft_probs], [generator])
    k = len(draft_ids)
    host = torch.cat([sampled.accepted.long(), sampled.picks]).tolist()
    return _kept(draft_ids, host[:k], host[k])


def _kept(draft_ids: Sequence[int], accepted: Sequence[float], pick: float) -> list[int]:
    """The drafts up to the first rejected one, then the draw at that row."""
    n = next((j for j, ok in enumerate(accepted) if not ok), len(draft_ids))
    return [*draft_ids[:n], int(pick)]


@dataclass(slots=True)
class Verification:
    """One speculative row's result: the emitted tokens and, if asked for, their logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def sampled_groups(device: torch.device, sampled: list[int]) -> list[list[int]]:
    """The sampled requests, in groups verified together (in order; one read for all).

    NOTE: on the CPU, one request a group: the vocabulary-wide work over one request's
    k + 1 rows stays in the core's cache from one operation to the next, where over every
    row at once each operation streams its whole input and output through memory (and
    faults in fresh pages for it). Elsewhere, all of them at once.
    """
    return [[i] for i in sampled] if device.type == "cpu" else [sampled]


def verify_rows(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab] float32, raw: each row's positions in order
    items: list[ScheduledRequest],
    *,
    argmax: Callable[[torch.Tensor], torch.Tensor],
    penalties: TokenCounts,
    generator: Callable[[Request], torch.Generator],
    draft_probs: Sequence[torch.Tensor | None],
) -> list[Verification]:
    """Verify a step's speculative rows against their target logits, with one host read
    (module docstring).

    Args:
        logits: the target's raw logits at every position of every row.
        items: the rows (their drafts, their requests' sampling parameters and tokens), in
            the order of ``logits``.
        argmax: the greedy pick, the sampler's own (same tie rule as plain decoding).
        penalties: the sampler's token counts; a row's drafts before a position count as
            output there, as plain decoding would have counted them.
        generator: a sampled request's random stream.
        draft_probs: per row, the distribution each of its drafts was drawn from
            ([>= k, vocab]), or None (point masses: n-gram proposals, greedy drafts).
    Returns:
        Per row, its emitted tokens (and their logprobs where asked for).
    """
    device = logits.device
    params = [item.request.sampling_params for item in items]
    starts = [0]
    for item in items:
        starts.append(starts[-1] + item.num_tokens)

    def rows_of(requests: list[int]) -> list[int]:
        return [r for i in requests for r in range(starts[i], starts[i + 1])]

    def select(t: torch.Tensor, requests: list[int]) -> torch.Tensor:
        """The rows of ``requests`` (all of them: ``t`` itself, not a copy)."""
        if len(requests) == len(items):
            return t
        return t[on_device(device, rows_of(requests))]

    # The token biases, then the penalties, as the sampler applies them (engine/sampler.py):
    # row j of an item samples the output token after its position start + j.
    scores = logits
    if any(has_token_bias(p) for p in params):
        scores = apply_token_bias(logits, [
            row_bias(item.request, item.start + 1 + j - item.request.num_prompt_tokens)
            for item in items for j in range(item.num_tokens)
        ])  # fmt: skip
    penalised = [i for i, p in enumerate(params) if p.needs_penalties]
    if penalised:
        seen = penalties.seen(
            [items[i].request for i in penalised],
            logits.shape[1],
            drafts=[items[i].draft_token_ids for i in penalised],
        )
        penalised_scores = apply_penalties(
            select(scores, penalised),
            seen,
            [params[i] for i in penalised for _ in range(items[i].num_tokens)],
        )
        if len(penalised) == len(items):
            scores = penalised_scores
        else:
            scores = scores.clone() if scores is logits else scores
            scores[on_device(device, rows_of(penalised))] = penalised_scores

    # What the host reads, in this order (``_unpack``): the greedy rows' argmax; the sampled
    # rows' draft verdicts and residual draws; the logprobs rows' top ids, chosen
    # logprobs and top logprobs.
    ints: list[torch.Tensor] = []
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    greedy_picks = verdict = None
    if greedy:
        greedy_picks = argmax_rows(argmax, select(scores, greedy))
        ints.append(greedy_picks)
    if sampled:
        verdicts = []
        for group in sampled_groups(device, sampled):
            row_params = [params[i] for i in group for _ in range(items[i].num_tokens)]
            if len(group) == 1:  # its rows, as a view
                group_scores = scores[starts[group[0]] : starts[group[0] + 1]]
            else:
                group_scores = select(scores, group)
            probs = truncated_probs(group_scores, row_params)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            verdicts.append(
                _rejection_sample(
                    probs,
                    [items[i].draft_token_ids for i in group],
                    [draft_probs[i] for i in group],
                    [generator(items[i].request) for i in group],
                )
            )
        verdict = _Sampled.join(verdicts)
        ints += [verdict.accepted.long(), verdict.picks]

    floats: list[torch.Tensor] = []
    with_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    num_top = max((params[i].logprobs or 0 for i in with_logprobs), default=0)
    if with_logprobs:
        # The token each row emits (at or before its first rejection; later rows' are
        # never read), to read its logprob.
        emitted = torch.empty(starts[-1], dtype=torch.long, device=device)
        if greedy_picks is not None:
            emitted[on_device(device, rows_of(greedy))] = greedy_picks
        if verdict is not None:
            emitted[on_device(device, rows_of(sampled))] = verdict.emitted
        raw = torch.log_softmax(select(logits, with_logprobs), dim=-1)
        if num_top > 0:
            top_values, top_ids = raw.topk(num_top, dim=-1)
            ints.append(top_ids.flatten())
        floats.append(raw.gather(1, select(emitted, with_logprobs)[:, None]).squeeze(1))
        if num_top > 0:
            floats.append(top_values.flatten())

    # The step's one host read. With logprobs everything travels as float64, in which
    # token ids and float32 logprobs are exact.
    if floats:
        host = torch.cat([t.double() for t in ints + floats]).tolist()
    else:
        host = (torch.cat(ints) if len(ints) > 1 else ints[0]).tolist()
    return _unpack(host, items, greedy, sampled, with_logprobs, num_top)


def _unpack(
    host: list[int] | list[float],  # verify_rows's read
    items: list[ScheduledRequest],
    greedy: list[int],
    sampled: list[int],
    with_logprobs: list[int],
    num_top: int,
) -> list[Verification]:
    """Per row, its emitted tokens and their logprobs, from ``verify_rows``'s read."""
    at = 0

    def take(n: int) -> list[int] | list[float]:
        nonlocal at
        at += n
        return host[at - n : at]

    emitted: list[list[int]] = [[] for _ in items]
    for i in greedy:
        targets = [int(t) for t in take(items[i].num_tokens)]
        emitted[i] = accept_greedy(targets, list(items[i].draft_token_ids))
    flags = take(sum(len(items[i].draft_token_ids) for i in sampled))
    num_flags = 0
    for i in sampled:
        k = len(items[i].draft_token_ids)
        emitted[i] = _kept(items[i].draft_token_ids, flags[num_flags : num_flags + k], take(1)[0])
        num_flags += k
    num_rows = sum(items[i].num_tokens for i in with_logprobs)
    top_ids = [int(t) for t in take(num_rows * num_top)]
    chosen = [float(v) for v in take(num_rows)]
    top_values = [float(v) for v in take(num_rows * num_top)]
    logprobs: list[list[TokenLogprob] | None] = [None] * len(items)
    row = 0
    for i in with_logprobs:
        num = items[i].request.sampling_params.logprobs or 0
        out = []
        for token in emitted[i]:
            top = slice(row * num_top, row * num_top + num)
            alternatives = list(zip(top_ids[top], top_values[top], strict=True))
            out.append(TokenLogprob(token, chosen[row], alternatives))
            row += 1
        row += items[i].num_tokens - len(emitted[i])
        logprobs[i] = out
    return [
        Verification(emitted[i], logprobs[i], len(item.draft_token_ids))
        for i, item in enumerate(items)
    ]
