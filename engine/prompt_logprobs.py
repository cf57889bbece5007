"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

A request whose ``SamplingParams.prompt_logprobs`` is set has a row of logits at each
position of its prompt chunks but the prompt's last (``ScheduledRequest.num_scored``, the
scheduler's choice). Those rows follow the sampling and verifying rows of the step's logits
(engine/input_batch.py); row ``p`` is the distribution of prompt token ``p + 1``.

``score`` turns the rows into log-probabilities on their device, as ``log_softmax`` of the
raw logits, the way sampled tokens' logprobs are reported (engine/outputs.py): the prompt
token's own, its rank and the top-N. ``ScoredRows.read`` brings them to the host with the
step's picks, so the step still has one wait. The engine gathers a request's chunks and
hands the whole list out with its first token (``RequestOutput.prompt_logprobs``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.to_device import on_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScoredChunk:
    """One request's scored rows in a step."""

    request_id: str
    start: int  # the first row's position: it scores prompt token start + 1
    token_ids: tuple[int, ...]  # the prompt tokens the rows score, one each
    top_n: int  # alternatives reported per position (SamplingParams.prompt_logprobs)


class ScoredRows:
    """The prompt logprobs of one step's scored rows, queued on the device; ``read`` waits."""

    def __init__(
        self,
        chunks: list[ScoredChunk],
        logprob: torch.Tensor,
        rank: torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self.chunks = chunks
        self._tensors = [logprob, rank] + (list(top) if top is not None else [])

    def read(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """Request id -> (its first scored position, one entry per scored row). Called after
        the step's picks are read, so on CUDA the device has (nearly) finished."""
        lists = [t.tolist() for t in self._tensors]
        logprobs, ranks = lists[0], lists[1]
        top_values, top_ids = (lists[2], lists[3]) if len(lists) > 2 else ([], [])
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        row = 0
        for chunk in self.chunks:
            entries = []
            for r, token_id in enumerate(chunk.token_ids, start=row):
                n = chunk.top_n
                # No top-n where every chunk of the step asked for none (prompt_logprobs=0).
                top = list(zip(top_ids[r][:n], top_values[r][:n], strict=True)) if n else []
                entries.append(TokenLogprob(token_id, logprobs[r], top, rank=ranks[r]))
            row += len(chunk.token_ids)
            out[chunk.request_id] = (chunk.start, entries)
        return out


def score(logits: torch.Tensor, chunks: list[ScoredChunk]) -> ScoredRows:
    """Queue the prompt logprobs of the scored rows.

    Args:
        logits: [rows, vocab], the scored rows' logits in ``chunks``' order.
        chunks: who the rows belong to, and the tokens they score.
    """
    targets = on_device(
        logits.device, [t for chunk in chunks for t in chunk.token_ids], torch.int64
    )
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    # Rank 1 is the most likely token; ties share the better rank (vLLM's count).
    rank = (logprobs > chosen).sum(dim=1) + 1
    k = max(chunk.top_n for chunk in chunks)
    top = None
    if k > 0:
        values, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        top = (values, ids)
    return ScoredRows(chunks, chosen.squeeze(1), rank, top)


class PromptLogprobs:
    """The prompt logprobs of the requests still prefilling, gathered chunk by chunk.

    Owned by the engine: it adds each step's ``ScoredRows.read`` and takes a request's list
    when its first token goes out. A recomputed prompt (after preemption) scores its rows
    again; rows already held are kept, not doubled.
    """

    def __init__(self) -> None:
        self._rows: dict[str, list[TokenLogprob]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def expect(self, request_id: str) -> None:
        """A request that asked for prompt logprobs was added."""
        self._rows[request_id] = []

    def add(self, scored: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        for request_id, (start, entries) in scored.items():
            held = self._rows.get(request_id)
            if held is None:
                continue  # aborted since its step was launched
            if start > len(held):
                raise RuntimeError(
                    f"{request_id}: prompt logprobs from position {start} after {len(held)}"
                )
            held.extend(entries[len(held) - start :])

    def take(self, request_id: str, num_prompt_tokens: int) -> list[TokenLogprob | None]:
        """The request's prompt logprobs, position 0 (which has none) first."""
        held = self._rows.pop(request_id, [])
        if len(held) != num_prompt_tokens - 1:
            # Not expected (the scheduler scores every position); the request still runs,
            # with None where a position's logprob is missing.
            logger.error(
                "%s: %d prompt logprobs for %d prompt tokens",
                request_id,
                len(held),
                num_prompt_tokens,
            )
        entries: list[TokenLogprob | None] = [None, *held[: num_prompt_tokens - 1]]
        return entries + [None] * (num_prompt_tokens - len(entries))

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
