"""Penalties: the rule, and the per-request token counts it reads, kept on the device.

The rule (as vLLM and OpenAI define it), per row: repetition (HF's divide/multiply rule over
every token of the prompt and the output so far), then frequency and presence (OpenAI's
subtractive rule over the output tokens' counts).

Where the counts come from: ``TokenCounts`` holds, for each request being penalised, one row
of output-token counts and one row marking the tokens it has seen (prompt or output), in two
``[capacity, vocab]`` device tensors. A request's prompt is marked once, when it first
samples with a penalty; after that each step adds only the output tokens appended since the
step before (one or a few per request), with one scatter for the whole batch, and gathers
the batch's rows with one index. The host's share of a step's penalty work is therefore
proportional to its new tokens, not to its requests' contexts (it used to rebuild every row
from the token lists each step: benchmarks/RESULTS.md, "Penalties").

Memory: 5 bytes per row and vocabulary entry (an int32 count and a bool), rows allocated
only once penalised requests arrive and kept at their high-water mark: 164 MB for 256
concurrent penalised requests over a 128k vocabulary, from the headroom the KV cache's
sizing leaves on a GPU.

Invariants:
- an entry's ``counted`` output tokens are exactly those in its row of output counts; they
  are a prefix of the request's ``output_token_ids``, which only grow while a request lives
  (a preemption keeps them; speculative decoding appends only accepted tokens);
- an entry belongs to one ``Request`` object: a request id reused by a new request (the
  engine forgets the old one, but a row of it may be sampled once more in a pipelined step)
  starts a fresh entry rather than reading the old one's counts;
- ``PENDING_TOKEN`` (asynchronous scheduling) is never counted: the counts stop before the
  first one and resume once it is resolved. At a pick the step before has been read, so
  none is there in practice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.to_device import on_device
from scheduler.request import PENDING_TOKEN, Request, SamplingParams

# Rows are allocated in powers of two from here: a server whose penalised requests come and
# go reuses freed rows, and grows (copying the rows in use) only past its high-water mark.
MIN_CAPACITY = 8


@dataclass(slots=True)
class SeenTokens:
    """What a batch of rows has seen, for ``apply_penalties``."""

    output_counts: torch.Tensor  # [rows, vocab] int32: occurrences in the output so far
    seen: torch.Tensor  # [rows, vocab] bool: the token occurs in the prompt or the output


@dataclass(slots=True)
class _Entry:
    request: Request
    row: int  # its row in TokenCounts' tensors
    counted: int  # output tokens already in its row of counts


class TokenCounts:
    """Per request being penalised, its output-token counts and the tokens it has seen, on
    the device (module docstring). Owned by the sampler; the speculator's verification reads
    it too. Not thread-safe: the engine's thread alone uses it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._entries: dict[str, _Entry] = {}
        self._free: list[int] = []
        self._vocab = 0
        self._output = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self._seen = torch.zeros(0, 0, dtype=torch.bool, device=device)

    def __len__(self) -> int:
        """Requests with an entry."""
        return len(self._entries)

    @property
    def capacity(self) -> int:
        return int(self._output.shape[0])

    def seen(
        self,
        requests: Sequence[Request],
        vocab: int,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> SeenTokens:
        """Bring the requests' counts up to date and gather their rows.

        Args:
            requests: the rows' requests, in row order.
            vocab: the logits' width.
            drafts: per request, its speculative tokens: it then has ``len(drafts[i]) + 1``
                rows, row j counting the first j drafts as output (what plain decoding would
                have seen at that position). None: one row per request.
        """
        if vocab != self._vocab:
            self._reset(vocab)
        entries = self._update(requests)
        rows = [e.row for e in entries]
        if drafts is not None:
            rows = [e.row for e, d in zip(entries, drafts, strict=True) for _ in range(len(d) + 1)]
        index = on_device(self.device, rows)
        counts = self._output.index_select(0, index)
        seen = self._seen.index_select(0, index)
        if drafts is not None:
            row_ids: list[int] = []
            token_ids: list[int] = []
            start = 0
            for d in drafts:
                for j in range(1, len(d) + 1):
                    row_ids += [start + j] * j
                    token_ids += d[:j]
                start += len(d) + 1
            if token_ids:
                _count(counts, seen, row_ids, token_ids, self.device)
        return SeenTokens(counts, seen)

    def check_integrity(self, live_request_ids: set[str]) -> None:
        """Every entry belongs to a request still in the engine, and holds its own row."""
        stale = set(self._entries) - live_request_ids
        assert not stale, f"penalty counts of finished requests: {sorted(stale)[:5]}"
        rows = [e.row for e in self._entries.values()]
        assert len(set(rows)) == len(rows), "two requests share a row of counts"
        assert not set(rows) & set(self._free), "a row in use is also free"

    def forget(self, request_id: str) -> None:
        """Free a finished (or aborted) request's row; idempotent."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._free.append(entry.row)

    def _update(self, requests: Sequence[Request]) -> list[_Entry]:
        entries = []
        fresh: list[_Entry] = []
        row_ids: list[int] = []
        token_ids: list[int] = []
        for request in requests:
            entry = self._entries.get(request.request_id)
            if entry is None or entry.request is not request:
                if entry is not None:
                    self._free.append(entry.row)
                entry = _Entry(request, self._take_row(), 0)
                self._entries[request.request_id] = entry
                fresh.append(entry)
            out = request.output_token_ids
            if entry.counted < len(out):
                new = out[entry.counted :]
                if PENDING_TOKEN in new:
                    new = new[: new.index(PENDING_TOKEN)]
                row_ids += [entry.row] * len(new)
                token_ids += new
                entry.counted += len(new)
            entries.append(entry)
        if fresh:
            rows = on_device(self.device, [e.row for e in fresh])
            self._output.index_fill_(0, rows, 0)
            self._seen.index_fill_(0, rows, False)
            prompt_rows = [e.row for e in fresh for _ in e.request.prompt_token_ids]
            prompt_ids = [t for e in fresh for t in e.request.prompt_token_ids]
            if prompt_ids:
                self._seen.index_put_(
                    (on_device(self.device, prompt_rows), on_device(self.device, prompt_ids)),
                    torch.ones((), dtype=torch.bool, device=self.device),
                )
        if token_ids:
            _count(self._output, self._seen, row_ids, token_ids, self.device)
        return entries

    def _take_row(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def _grow(self) -> None:
        old = self.capacity
        new = max(MIN_CAPACITY, 2 * old)
        output = torch.zeros(new, self._vocab, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, self._vocab, dtype=torch.bool, device=self.device)
        output[:old] = self._output
        seen[:old] = self._seen
        self._output, self._seen = output, seen
        # Lowest rows first: popped from the end.
        self._free = sorted(set(self._free) | set(range(old, new)), reverse=True)

    def _reset(self, vocab: int) -> None:
        """A new vocabulary width (the first use): every entry is recounted."""
        self._vocab = vocab
        self._entries.clear()
        self._free = []
        self._output = torch.zeros(0, vocab, dtype=torch.int32, device=self.device)
        self._seen = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab], penalised rows only
    seen: SeenTokens,
    params: Sequence[SamplingParams],
) -> torch.Tensor:
    """Penalise tokens already seen, for a batch of rows: returns new logits ([rows, vocab]).

    On a GPU every entry is computed (finding the seen ones would read the device); on the
    CPU only the seen entries are, usually a few thousand of a row's tens of thousands
    (measured: benchmarks/RESULTS.md, "Penalties"). Both do the same float operations on
    every entry they change, so they agree exactly."""
    if logits.device.type == "cpu":
        return _penalise_seen(logits, seen, params)
    return _penalise_all(logits, seen, params)


def _penalise_all(
    logits: torch.Tensor, seen: SeenTokens, params: Sequence[SamplingParams]
) -> torch.Tensor:
    device = logits.device
    counts = seen.output_counts
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = on_device(device, [p.repetition_penalty for p in params])[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen.seen, penalised, logits)
    if not any(p.frequency_penalty or p.presence_penalty for p in params):
        return logits
    freq = on_device(device, [p.frequency_penalty for p in params])[:, None]
    pres = on_device(device, [p.presence_penalty for p in params])[:, None]
    counts_f = counts.to(logits.dtype)
    return logits - freq * counts_f - pres * (counts > 0).to(logits.dtype)


def _penalise_seen(
    logits: torch.Tensor, seen: SeenTokens, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """``_penalise_all``'s float operations on the seen entries only. An entry it leaves
    alone would keep its value there too: a token never seen is not repeated, and
    ``x - f * 0 - p * 0 == x``. Entries are addressed by flat index (one ``index_select``
    each, several times faster on the CPU than indexing by row and column)."""
    rows_vocab = logits.shape[1]
    logits = logits.contiguous()
    flat = seen.seen.view(-1).nonzero().squeeze(1)
    rows = flat.div(rows_vocab, rounding_mode="floor")
    values = logits.view(-1).index_select(0, flat)
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = torch.tensor([p.repetition_penalty for p in params]).index_select(0, rows)
        values = torch.where(values > 0, values / rep, values * rep)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        freq = torch.tensor([p.frequency_penalty for p in params]).index_select(0, rows)
        pres = torch.tensor([p.presence_penalty for p in params]).index_select(0, rows)
        n = seen.output_counts.view(-1).index_select(0, flat)
        values = values - freq * n.to(values.dtype) - pres * (n > 0).to(values.dtype)
    out = logits.clone()
    out.view(-1).index_copy_(0, flat, values)
    return out


def _count(
    counts: torch.Tensor,
    seen: torch.Tensor,
    row_ids: list[int],
    token_ids: list[int],
    device: torch.device,
) -> None:
    """For every i: counts[row_ids[i], token_ids[i]] += 1 (repeats adding up), and
    seen[row_ids[i], token_ids[i]] = True."""
    index = (on_device(device, row_ids), on_device(device, token_ids))
    counts.index_put_(index, torch.ones((), dtype=counts.dtype, device=device), accumulate=True)
    seen.index_put_(index, torch.ones((), dtype=torch.bool, device=device))
