"""Additive per-token biases on the device, per row: OpenAI's ``logit_bias``, and vLLM's
``min_tokens``, which bans (-inf) a request's stop tokens (EOS unless ignored, and its
``stop_token_ids``) at output positions before its minimum.

Applied to the raw logits before the penalties and everything after them (vLLM's order), so
they move greedy picks, the tempered distribution and structured output's checks alike (a
constraint's -inf stays -inf); log-probabilities stay those of the raw logits, as the
sampler's docstring says. A constrained request's stop tokens are not banned: where its
grammar is complete the end is the only token it allows, and the grammar's end wins over the
minimum. One scatter-add for the whole batch: the host lists every row's (token, bias) pairs,
which OpenAI bounds to a few hundred a request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.to_device import on_device
from scheduler.request import Request, SamplingParams

TokenBias = Sequence[tuple[int, float]]


def has_token_bias(params: SamplingParams) -> bool:
    """Whether a request's rows may have a bias (the batch skips the work where none has)."""
    return bool(params.logit_bias) or params.min_tokens > 0


def row_bias(request: Request, output_position: int) -> TokenBias:
    """What the row of ``request`` that samples its output token ``output_position``
    (0: the first) adds to its logits."""
    params = request.sampling_params
    if output_position >= params.min_tokens or params.structured is not None:
        return params.logit_bias
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(request.eos_token_ids)
        if request.eos_token_id is not None:
            stops.add(request.eos_token_id)
    return (*params.logit_bias, *((t, float("-inf")) for t in sorted(stops)))


def apply_token_bias(logits: torch.Tensor, row_biases: Sequence[TokenBias]) -> torch.Tensor:
    """``logits`` ([rows, vocab]) plus each row's biases: a new tensor, or ``logits`` itself
    where no row has one."""
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, pairs in enumerate(row_biases):
        for token_id, bias in pairs:
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if not rows:
        return logits
    device = logits.device
    index = (on_device(device, rows, torch.long), on_device(device, token_ids, torch.long))
    values = on_device(device, biases, logits.dtype)
    return logits.index_put(index, values, accumulate=True)
