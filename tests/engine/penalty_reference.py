"""The penalty rule one row at a time, from the row's token lists: what the batched rule
over the sampler's token counts (engine/penalties.py) must compute."""

from __future__ import annotations

import torch

from scheduler.request import SamplingParams


def reference_penalties(
    row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    """One row's penalised logits from its token lists: HF's repetition rule over the prompt
    and output, then OpenAI's frequency and presence rule over the output."""
    row = row.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(prompt + output, dtype=torch.long).unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output:
        counts = torch.bincount(torch.tensor(output), minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row
