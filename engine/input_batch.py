"""InputBatch: one step's plan turned into the flat tensors the model reads.

All requests' tokens are concatenated into one flat batch. Requests computing a single
token (decodes) come first, so the attention layer can run the decode kernel on the head of
the batch and the prefill kernel on the tail::

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
              <- num_decodes ->|<---- prefill chunks ---->|

Padding rows (a finished member of a static batch, ``ScheduledRequest.padding``) are decodes
whose slot is -1: the token's K/V is already cached, so nothing is written. Their logits are
computed, as a fixed batch computes them, but sit after the sampling rows and are discarded.
Speculative rows (``ScheduledRequest.draft_token_ids``) are multi-token queries like prefill
chunks, and need logits at every position (engine/spec_decode/verify.py); those rows come
after the sampling rows, and then the scored positions of chunks of requests that asked for
prompt logprobs (``ScheduledRequest.num_scored``, engine/prompt_logprobs.py)::

    logits rows:  | sampling[0] ... sampling[n-1] | verifying: every position | scored | padding |
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.prompt_logprobs import ScoredChunk
from kvpool.manager import slots_for
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import PENDING_TOKEN


@dataclass(slots=True)
class AttentionMetadata:
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_seq_len: int


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    # [num_samples + num_padding] int64: the last token of each sampling request, then the
    # padding rows (whose logits nobody uses)
    logits_indices: torch.Tensor
    sampling: list[ScheduledRequest]  # aligned with the head of logits_indices
    # logits_indices is every row in order (a step of decodes only, none of them padding):
    # the model then takes the rows as they are instead of gathering them.
    logits_are_all_rows: bool = False
    # Speculative rows, whose logits follow the sampling rows': num_tokens rows each.
    verifying: list[ScheduledRequest] = field(default_factory=list)
    # Scored prompt positions, whose logits follow the verifying rows': one row per token.
    scoring: list[ScoredChunk] = field(default_factory=list)
    # (position in input_ids, request id) of decode rows whose input token is still on the
    # device (asynchronous scheduling: ``PENDING_TOKEN`` in the plan); the runner writes
    # each from the step before's picks before the forward pass reads ``input_ids``.
    pending: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# Without staging (on the CPU), a decode step of fewer rows builds its lists request by
# request: below this, numpy's fixed costs outweigh what its array operations save.
MIN_ARRAY_ROWS = 16


def build_input_batch(
    out: SchedulerOutput,
    block_size: int,
    device: torch.device,
    staging: HostStaging | None = None,
) -> InputBatch:
    """The step's tensors on ``device``. ``staging`` (the runner's, on CUDA): a pinned host
    buffer the step's integers are packed into, then moved by one asynchronous copy; without
    it each tensor is moved on its own."""
    scheduled = out.scheduled
    if (
        (staging is not None or len(scheduled) >= MIN_ARRAY_ROWS)
        and scheduled
        and all(
            s.num_tokens == 1 and not s.padding and not s.draft_token_ids and not s.num_scored
            for s in scheduled
        )
    ):
        return _decode_batch(scheduled, block_size, device, staging)
    decodes = [s for s in scheduled if s.num_tokens == 1]
    prefills = [s for s in scheduled if s.num_tokens != 1]
    ordered = decodes + prefills

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    padding_indices: list[int] = []
    sampling: list[ScheduledRequest] = []
    verify_indices: list[int] = []
    verifying: list[ScheduledRequest] = []
    scored_indices: list[int] = []
    scoring: list[ScoredChunk] = []
    for item in ordered:
        end = item.start + item.num_tokens
        if item.num_scored:
            first = len(input_ids)
            scored_indices.extend(range(first, first + item.num_scored))
            prompt = item.request.prompt_token_ids
            scoring.append(
                ScoredChunk(
                    item.request_id,
                    item.start,
                    tuple(prompt[item.start + 1 : item.start + 1 + item.num_scored]),
                    item.request.sampling_params.prompt_logprobs or 0,
                )
            )
        input_ids.extend(item.token_ids)
        positions.extend(range(item.start, end))
        query_start_loc.append(len(input_ids))
        if item.padding:
            slots.append(-1)
            padding_indices.append(len(input_ids) - 1)
            continue
        slots.extend(slots_for(item.block_ids, block_size, item.start, end))
        if item.draft_token_ids:
            verify_indices.extend(range(len(input_ids) - item.num_tokens, len(input_ids)))
            verifying.append(item)
        elif item.samples:
            logits_indices.append(len(input_ids) - 1)
            sampling.append(item)

    seq_lens = [item.seq_len for item in ordered]
    rows = logits_indices + verify_indices + scored_indices + padding_indices
    lists = (input_ids, positions, slots, rows, seq_lens, query_start_loc)
    dtypes = (np.int64,) * 4 + (np.int32,) * 2
    arrays = [np.array(v, dtype=d) for v, d in zip(lists, dtypes, strict=True)]
    tables = _block_tables([r.block_ids for r in ordered])
    tensors = _to_device([*arrays, tables], device, staging)
    batch = _input_batch(
        tensors,
        num_decodes=len(decodes),
        max_seq_len=max(seq_lens),
        sampling=sampling,
        logits_are_all_rows=rows == list(range(len(input_ids))),
        verifying=verifying,
        scoring=scoring,
    )
    # Only a decode's one token can be pending, and decodes lead the batch.
    batch.pending = [
        (i, item.request_id) for i, item in enumerate(decodes) if item.input_pending
    ]
    return batch


def _decode_batch(
    scheduled: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
    staging: HostStaging | None,
) -> InputBatch:
    """``build_input_batch`` of a step of one-token rows, none of them padding or speculative
    (every decode-only step a graph replays), in array operations: the same tensors."""
    n = len(scheduled)
    i64 = np.int64
    starts = np.fromiter((s.start for s in scheduled), dtype=i64, count=n)
    input_ids = np.fromiter((s.token_ids[0] for s in scheduled), dtype=i64, count=n)
    samples = np.fromiter((s.samples for s in scheduled), dtype=np.bool_, count=n)
    tables = _block_tables([s.block_ids for s in scheduled])
    slots = tables[np.arange(n), starts // block_size].astype(i64) * block_size
    slots += starts % block_size
    all_rows = bool(samples.all())
    rows = np.arange(n, dtype=i64) if all_rows else np.flatnonzero(samples).astype(i64)
    seq_lens = (starts + 1).astype(np.int32)
    tensors = _to_device(
        [
            input_ids,
            starts,
            slots,
            rows,
            seq_lens,
            np.arange(n + 1, dtype=np.int32),
            tables,
        ],
        device,
        staging,
    )
    batch = _input_batch(
        tensors,
        num_decodes=n,
        max_seq_len=int(seq_lens.max()),
        sampling=list(scheduled) if all_rows else [s for s in scheduled if s.samples],
        logits_are_all_rows=all_rows,
    )
    pending = np.flatnonzero(input_ids == PENDING_TOKEN)
    if pending.size:
        batch.pending = [(int(i), scheduled[i].request_id) for i in pending]
    return batch


def _block_tables(block_ids: list[tuple[int, ...]]) -> np.ndarray:
    """[rows, max_num_blocks] int32: each row's block ids, padded with 0."""
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    width = int(lens.max())
    flat = np.fromiter(
        itertools.chain.from_iterable(block_ids), dtype=np.int32, count=int(lens.sum())
    )
    if flat.size == len(block_ids) * width:  # every row as wide as the widest
        return flat.reshape(len(block_ids), width)
    tables = np.zeros((len(block_ids), width), dtype=np.int32)
    tables[np.arange(width) < lens[:, None]] = flat  # row-major order: each row's ids in turn
    return tables


def _input_batch(
    tensors: list[torch.Tensor],
    *,
    num_decodes: int,
    max_seq_len: int,
    sampling: list[ScheduledRequest],
    logits_are_all_rows: bool,
    verifying: list[ScheduledRequest] | None = None,
    scoring: list[ScoredChunk] | None = None,
) -> InputBatch:
    input_ids, positions, slots, rows, seq_lens, query_start_loc, tables = tensors
    return InputBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        attn=AttentionMetadata(
            num_decodes=num_decodes,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_seq_len=max_seq_len,
        ),
        logits_indices=rows,
        sampling=sampling,
        logits_are_all_rows=logits_are_all_rows,
        verifying=verifying if verifying is not None else [],
        scoring=scoring if scoring is not None else [],
    )


def _to_device(
    arrays: list[np.ndarray], device: torch.device, staging: HostStaging | None
) -> list[torch.Tensor]:
    """The arrays as tensors on ``device``: through ``staging`` (one copy) when given."""
    if staging is not None:
        return staging.to_device(arrays)
    tensors = [torch.from_numpy(a) for a in arrays]
    if device.type == "cpu":
        return tensors
    return [t.to(device, non_blocking=True) for t in tensors]


# Every packed array starts at a multiple of this many bytes: kernels (Triton's pointer
# specialisations among them) see the same alignment as from a tensor of its own.
_ALIGN = 16


class HostStaging:
    """A pinned host buffer that a step's integer arrays are packed into, moved to the device
    by one asynchronous copy and handed out as views of the one device tensor.

    NOTE: the buffer is refilled only after the previous step's copy out of it has finished
    (an event recorded after the copy): a step without sampling never waits for its copy.

    Off CUDA the same packing runs into an ordinary buffer (no pinning, no event), so the
    layout is tested where no GPU is.
    """

    def __init__(self, device: torch.device, num_bytes: int = 1 << 16) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self._pin)
        self._event = torch.cuda.Event() if self._pin else None
        self._copying = False  # a copy out of ``_host`` was queued after ``_event``'s record

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        offsets = []
        total = 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if self._event is not None and self._copying:
            self._event.synchronize()
        if total > self._host.numel():
            self._host = torch.empty(
                max(total, 2 * self._host.numel()), dtype=torch.uint8, pin_memory=self._pin
            )
        host = self._host.numpy()
        for a, offset in zip(arrays, offsets, strict=True):
            host[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        packed = self._host[:total].to(self.device, non_blocking=True, copy=True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
            self._copying = True
        # One strided view per array (each torch call costs the host more than numpy's).
        typed = {8: packed.view(torch.int64), 4: packed.view(torch.int32)}
        return [
            typed[a.itemsize].as_strided(a.shape, _strides(a), offset // a.itemsize)
            for a, offset in zip(arrays, offsets, strict=True)
        ]


def _strides(a: np.ndarray) -> tuple[int, ...]:
    """A contiguous array's strides in elements."""
    return tuple(s // a.itemsize for s in a.strides)
