"""Calibrate a quantized KV cache's key offsets at start-up (``kernels/kv_quant.py``).

Post-RoPE keys of a (layer, KV head) share a large component common to every token, which
widens each row's absmax scale when the row is quantized. ``calibrate_key_offsets`` runs the
model once over ``CALIBRATION_TEXT`` (``CALIBRATION_TOKENS`` tokens, one prefill) into a
scratch cache of the model's own dtype, reads the rotated keys back from it, and returns
each (layer, KV head)'s mean key: the offset kvpool's quantized cache then subtracts from
every key it stores. Any vector is exact there (softmax ignores a shift common to a query's
scores); the mean is the one that shrinks the rows most.

The text ships here (prose, a dialogue and code, as requests are), not in the quality
report's text (``benchmarks/kv_quant.py`` scores Python's reference topics), so the report
measures an offset fitted on other text. Without a tokenizer (``--load-format dummy`` with a
preset shape) the text's bytes stand in for token ids: random weights give some vector, and
the path is the same. Cost: one prefill of 128 tokens, a sixteenth of the server's default
largest step (2,048 tokens), in the serving forward (the fused C++ stack, Triton, or torch):
0.15 s for the default model on 2 CPU cores, 0.9 s while they are busy. (256 tokens took 3-6
s there, and fitted offsets that the quality report could not tell from these, nor from
ones fitted on the report's own text.)

Opt-in (``--kv-key-offsets``): measured on the default model (``benchmarks/RESULTS.md``) the
offsets cut the stored keys' error and the mean logprob error over a long passage, but the
first few dozen positions of a sequence get worse (the attention sink's key, far from the
mean, is quantized less finely), and so did the greedy agreement the issue counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.input_batch import AttentionMetadata, InputBatch

logger = logging.getLogger(__name__)

__all__ = ["CALIBRATION_TEXT", "CALIBRATION_TOKENS", "calibrate_key_offsets", "calibration_ids"]

CALIBRATION_TOKENS = 128

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in before dawn, and by seven the market
smelled of salt, diesel and fresh bread. Maria ran the small bookshop on the corner; she
opened at nine, swept the step, and put out a crate of second-hand paperbacks at a euro each.
Most mornings the first customer was Mr. Okafor, a retired engineer who bought one detective
novel a week and returned it, read, the following Monday.

"Any new arrivals?" he asked, as he always did.
"A box from an estate sale," she said. "Mostly travel writing, some maps, two cookbooks."
"Maps," he said. "Old ones?"
"From the sixties. The coastline has moved since then, you know. The sea took the dunes."

Questions people ask an assistant are just as varied: how to convert 3.5 kilometres to
miles (about 2.17), why the sky is blue (short wavelengths scatter more), what a good name
for a cat might be, or how to write a polite email declining a meeting. Some ask for a
summary of a long report, others for a list of ten ideas for a birthday party.

def moving_average(values, window):
    \"\"\"Return the averages of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result

SELECT customer_id, COUNT(*) AS orders, SUM(amount) AS spent
FROM orders WHERE created_at >= '2024-01-01'
GROUP BY customer_id ORDER BY spent DESC LIMIT 20;

In the afternoon the wind turned west and the light went grey and soft. Maria closed the
shop at six, counted the till (forty-two euros, a good day for March) and walked home along
the sea wall, past the lifeboat station and the old customs house, thinking about maps.
"""


def calibration_ids(tokenizer: Any | None, vocab_size: int, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids of ``CALIBRATION_TEXT`` (repeated if it is shorter): the
    tokenizer's, or without one the text's bytes (modulo the vocabulary)."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))
    else:
        ids = [b % vocab_size for b in CALIBRATION_TEXT.encode()]
    assert ids, "the calibration text encodes to no tokens"
    return (ids * -(-num_tokens // len(ids)))[:num_tokens]


@torch.inference_mode()
def calibrate_key_offsets(
    forward: Callable[[InputBatch, list[torch.Tensor], list[torch.Tensor]], torch.Tensor],
    token_ids: list[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
) -> list[torch.Tensor]:  # per layer [num_kv_heads, head_dim] float32
    """The mean post-RoPE key of each (layer, KV head) over ``token_ids``, one prefill of
    ``forward`` (the serving forward: ``forward(batch, key_caches, value_caches)``) into
    scratch caches of ``dtype``, freed on return. Logs the time and what share of the keys'
    mean square the offsets carry (what quantizing ``k - offset`` no longer spends scale on).
    """
    t0 = time.perf_counter()
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    positions = torch.arange(n, device=device)

    def int32(values: torch.Tensor | list[int]) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    batch = InputBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=positions,
        slot_mapping=positions.clone(),  # blocks 0, 1, ... in order: slot == position
        attn=AttentionMetadata(
            num_decodes=0,
            block_tables=int32(torch.arange(num_blocks)[None]),
            seq_lens=int32([n]),
            query_start_loc=int32([0, n]),
            max_seq_len=n,
        ),
        logits_indices=torch.tensor([n - 1], device=device),
        sampling=[],
    )
    forward(batch, key_caches, value_caches)
    offsets, carried = [], []
    for cache in key_caches:
        keys = cache.view(-1, num_kv_heads, head_dim)[:n].float()  # [n, kvh, d], in order
        mean = keys.mean(dim=0)
        offsets.append(mean.contiguous())
        carried.append(float(mean.square().sum() / keys.square().sum(dim=(1, 2)).mean()))
    logger.info(
        "KV key offsets: calibrated on %d tokens in %.2f s; they carry %.0f%% of the keys' "
        "mean square (%.0f%%-%.0f%% by layer)",
        n,
        time.perf_counter() - t0,
        100 * sum(carried) / len(carried),
        100 * min(carried),
        100 * max(carried),
    )
    return offsets
