"""Draft-model proposals: a smaller model with the target's vocabulary guesses the next
``k`` tokens, one decode step at a time, in its own paged KV pool.

The draft model is built by the same code as the target (``engine/builder.py``: the model
definition, the device's backend, ``PagedAttention``), and its steps are built by the same
``build_input_batch`` from ``ScheduledRequest`` rows over its own block tables. Its pool
(``KVCacheStorage`` + a ``KVCacheManager`` without prefix caching) holds, per request, the
draft K/V of the tokens it has seen::

    known tokens (prompt + output)        | 0 ......... n-1 |
    draft K/V after catching up           | 0 ......... n-1 | d1 .. d(k-1) |
                                                             (written while proposing)
    kept after verification (a accepted)  | 0 ......... n-1 | d1 .. d(min(a, k-1)) |

Per step: one pass catches every proposing request up on its new known tokens (its prompt
the first time, then the one or few tokens last step emitted) and draws ``d1``; then
``k - 1`` batched decode passes draw ``d2 .. dk``. Greedy requests take the draft's argmax
(a point mass, verified as such); sampled requests draw from the draft's own
temperature/top-k/top-p distribution ``q``, which verification needs
(``engine/spec_decode/verify.py``). The drafts stay on the device: each decode pass takes
its input tokens from the pass before's picks there, and the host reads the drafts once,
after the last pass.

The draft pool is best-effort: when it has no room for a request, that request does not
propose this step (after evicting the draft K/V of requests not proposing now); it never
preempts anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.backends import ModelForward
from engine.input_batch import InputBatch, build_input_batch
from engine.sampler import truncated_probs
from engine.spec_decode.verify import argmax_rows, draw_uniforms_and_noise
from engine.to_device import on_device
from kvpool.manager import KVCacheManager
from kvpool.storage import KVCacheStorage
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import PENDING_TOKEN, Request


@dataclass(slots=True)
class DraftProposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab] the q each draft was drawn from; None: argmax


class DraftModelProposer:
    """Owns: the draft model's forward, its K/V pool, and per request how many of its known
    tokens the draft has computed (``num_computed``) plus the known-token count at its last
    proposal (to keep what verification accepted)."""

    def __init__(
        self,
        forward: ModelForward,
        storage: KVCacheStorage,
        device: torch.device,
        argmax: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.forward = forward
        self.storage = storage
        self.kv = KVCacheManager(storage.num_blocks, storage.block_size)
        self.device = device
        self.argmax = argmax
        self._num_computed: dict[str, int] = {}
        # Known tokens and drafts at its last proposal (to keep what verification accepted).
        self._proposed_at: dict[str, tuple[int, int]] = {}

    def propose(
        self,
        requests: list[Request],
        num_tokens: Mapping[str, int],
        generators: Callable[[Request], torch.Generator],
    ) -> dict[str, DraftProposal]:
        """Propose ``num_tokens`` drafts for each request that fits in the draft pool.

        Args:
            requests: decoding requests (all their known tokens but the last computed by
                the target).
            num_tokens: request id -> its drafts (k >= 1); a request stops drafting at
                its own k while the others go on.
            generators: the random stream of a sampled request.
        Returns:
            Request id -> its proposal.
        """
        rows: list[ScheduledRequest] = []
        proposing = {r.request_id for r in requests}
        for request in requests:
            if self._make_room(request, num_tokens[request.request_id], proposing):
                rows.append(self._catch_up_row(request))
        if not rows:
            return {}
        device = self.device
        max_drafts = max(num_tokens[row.request_id] for row in rows)
        sampled = [row.request_id for row in rows if not row.request.sampling_params.greedy]
        sampled_index = {request_id: i for i, request_id in enumerate(sampled)}
        probs: torch.Tensor | None = None  # [sampled, max_drafts, vocab]: each draft's q
        # Every draft stays on the device until the one read at the end: a decode pass
        # takes its input tokens from the pass before's picks there.
        passes: list[torch.Tensor] = []  # per pass, its picks ([rows of the pass] int64)
        pass_ids: list[list[str]] = []  # per pass, the request id of each of its picks
        for j in range(max_drafts):
            if j > 0:
                rows = [self._decode_row(row) for row in rows if num_tokens[row.request_id] > j]
            batch = build_input_batch(
                SchedulerOutput(scheduled=rows), self.storage.block_size, device
            )
            if j > 0:
                _feed(batch, passes[-1], pass_ids[-1])
            logits = self.forward(batch, self.storage.key_caches, self.storage.value_caches)
            step_rows = batch.sampling  # the rows of ``logits``
            picks, q = self._draw(logits[: len(step_rows)], step_rows, generators)
            passes.append(picks)
            pass_ids.append([item.request_id for item in step_rows])
            if q is not None:
                if probs is None:
                    probs = q.new_empty(len(sampled), max_drafts, q.shape[1])
                step_sampled = [
                    sampled_index[item.request_id]
                    for item in step_rows
                    if not item.request.sampling_params.greedy
                ]
                probs[on_device(device, step_sampled), j] = q
        host = (torch.cat(passes) if len(passes) > 1 else passes[0]).tolist()  # the one read
        drafts: dict[str, list[int]] = {}
        for request_id, token in zip(itertools.chain(*pass_ids), host, strict=True):
            drafts.setdefault(request_id, []).append(token)
        return {
            request_id: DraftProposal(
                tokens,
                None
                if probs is None or request_id not in sampled_index
                else probs[sampled_index[request_id], : len(tokens)],
            )
            for request_id, tokens in drafts.items()
        }

    def _make_room(self, request: Request, num_tokens: int, keep: set[str]) -> bool:
        """Allocate draft slots for the request's known tokens and its first
        ``num_tokens - 1`` drafts, evicting requests outside ``keep`` if the pool is full."""
        request_id = request.request_id
        need = request.num_tokens + num_tokens - 1
        while self.kv.allocate_slots(request_id, need) is None:
            idle = next((r for r in self._num_computed if r not in keep), None)
            if idle is None:
                return False
            self.forget(idle)
        self._num_computed.setdefault(request_id, 0)
        self._proposed_at[request_id] = (request.num_tokens, num_tokens)
        return True

    def _catch_up_row(self, request: Request) -> ScheduledRequest:
        start = self._num_computed[request.request_id]
        end = request.num_tokens
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=end - start,
            token_ids=request.token_ids(start, end),
            block_ids=self.kv.block_ids(request.request_id),
            samples=True,
        )

    def _decode_row(self, previous: ScheduledRequest) -> ScheduledRequest:
        """The next pass's row: one token, the pick of ``previous``, still on the device."""
        return ScheduledRequest(
            request=previous.request,
            start=previous.seq_len,
            num_tokens=1,
            token_ids=[PENDING_TOKEN],
            block_ids=previous.block_ids,
            samples=True,
        )

    def _draw(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        rows: list[ScheduledRequest],
        generators: Callable[[Request], torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's draft, on the device: a greedy request's argmax, a sampled request's
        draw from its own distribution ``q``.

        Returns:
            The drafts ([rows] int64), and the sampled rows' ``q`` ([sampled rows, vocab],
            in row order; None when no row samples).
        """
        device = logits.device
        sampled = [i for i, row in enumerate(rows) if not row.request.sampling_params.greedy]
        if not sampled:
            return argmax_rows(self.argmax, logits), None
        index = on_device(device, sampled)
        params = [rows[i].request.sampling_params for i in sampled]
        q = truncated_probs(logits[index].float(), params)
        q = q / q.sum(dim=-1, keepdim=True)
        _, noise = draw_uniforms_and_noise(
            [generators(rows[i].request) for i in sampled],
            [0] * len(sampled),
            q.shape[1],
            q.dtype,
            device,
        )
        drawn = (q / noise).argmax(dim=-1)
        if len(sampled) == len(rows):
            return drawn, q
        picks = torch.empty(len(rows), dtype=torch.long, device=device)
        greedy = on_device(device, sorted(set(range(len(rows))) - set(sampled)))
        picks[greedy] = argmax_rows(self.argmax, logits[greedy])
        picks[index] = drawn
        return picks, q

    def verified(self, request_id: str, num_accepted: int | None) -> None:
        """Keep the draft K/V that verification proved right and give back the rest.

        Args:
            request_id: a request that proposed this step.
            num_accepted: drafts the target kept, or None if its drafts were not verified
                (the scheduler ran it as a plain decode, or it was preempted).
        """
        proposed = self._proposed_at.pop(request_id, None)
        if proposed is None or not self.kv.has_request(request_id):
            return
        known, num_drafts = proposed
        # Positions known .. known + k - 2 hold drafts d1 .. d(k-1); accepted ones stay.
        kept = known + min(num_accepted or 0, num_drafts - 1)
        self.kv.rollback_slots(request_id, kept)
        self.kv.commit_computed(request_id, kept, _no_hashes)
        self._num_computed[request_id] = kept

    def forget(self, request_id: str) -> None:
        """Free a request's draft K/V (it finished, or the pool needs room)."""
        self.kv.free(request_id)
        self._num_computed.pop(request_id, None)
        self._proposed_at.pop(request_id, None)


def _feed(batch: InputBatch, picks: torch.Tensor, pick_ids: list[str]) -> None:
    """Write a decode pass's input tokens, all pending, from the pass before's picks on
    the device (``pick_ids``: the request of each pick)."""
    src = {request_id: i for i, request_id in enumerate(pick_ids)}
    dst = [position for position, _ in batch.pending]
    rows = [src[request_id] for _, request_id in batch.pending]
    if dst == rows == list(range(len(pick_ids))):  # the same rows in the same order
        batch.input_ids.copy_(picks)
        return
    device = picks.device
    batch.input_ids.index_copy_(0, on_device(device, dst), picks[on_device(device, rows)])


def _no_hashes(start: int, end: int) -> list[int]:
    raise AssertionError("the draft pool has no prefix cache")
