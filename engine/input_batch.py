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
after the sampling rows::

    logits rows:  | sampling[0] ... sampling[n-1] | verifying: every position | padding ... |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpool.manager import slots_for
from scheduler.output import ScheduledRequest, SchedulerOutput


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_input_batch(out: SchedulerOutput, block_size: int, device: torch.device) -> InputBatch:
    decodes = [s for s in out.scheduled if s.num_tokens == 1]
    prefills = [s for s in out.scheduled if s.num_tokens != 1]
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
    for item in ordered:
        end = item.start + item.num_tokens
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

    max_blocks = max(len(item.block_ids) for item in ordered)
    tables = [list(item.block_ids) + [0] * (max_blocks - len(item.block_ids)) for item in ordered]
    seq_lens = [item.seq_len for item in ordered]

    rows = logits_indices + verify_indices + padding_indices

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return InputBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        attn=AttentionMetadata(
            num_decodes=len(decodes),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(query_start_loc, torch.int32),
            max_seq_len=max(seq_lens),
        ),
        logits_indices=tensor(rows, torch.int64),
        sampling=sampling,
        logits_are_all_rows=rows == list(range(len(input_ids))),
        verifying=verifying,
    )
