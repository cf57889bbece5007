"""OpenAI's ``logit_bias``: a request's additive bias per token id, on the device.

Applied to the raw logits before the penalties and everything after them (vLLM's order), so
it moves greedy picks, the tempered distribution and structured output's checks alike (a
constraint's -inf stays -inf). Log-probabilities stay those of the raw logits, as the
sampler's docstring says. One scatter-add for the whole batch: the host lists every row's
(token, bias) pairs, which OpenAI bounds to a few hundred a request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.to_device import on_device
from scheduler.request import SamplingParams


def apply_logit_bias(logits: torch.Tensor, row_params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` ([rows, vocab]) plus each row's bias (``row_params[r].logit_bias``): a new
    tensor, or ``logits`` itself where no row has a bias."""
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, params in enumerate(row_params):
        for token_id, bias in params.logit_bias:
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if not rows:
        return logits
    device = logits.device
    index = (on_device(device, rows, torch.long), on_device(device, token_ids, torch.long))
    values = on_device(device, biases, logits.dtype)
    return logits.index_put(index, values, accumulate=True)
