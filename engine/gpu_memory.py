"""How much GPU memory the KV cache may take, measured before it is allocated.

The cache is sized last, from what is free once the weights are loaded, less what the
serving steps themselves will need: the activations of the largest step the scheduler can
plan (a prefill of ``max_num_batched_tokens`` tokens), measured by running one, and the
memory the decode graphs keep (each captured graph holds its own logits buffer, and all of
them share one pool as large as the largest bucket's activations).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.input_batch import AttentionMetadata, InputBatch

logger = logging.getLogger(__name__)

# The share of the memory left after the reserve that the KV cache takes (the rest covers
# the sampler's [rows, vocab] buffers, the allocator's fragmentation and other processes'
# CUDA contexts).
KV_FRACTION = 0.9


def _inert_batch(
    num_tokens: int, num_seqs: int, block_size: int, device: torch.device
) -> InputBatch:
    """A batch that writes no K/V (slot -1) and attends over block 0 only: ``num_seqs``
    sequences, the first ``num_seqs - 1`` decodes and the last one a prefill of the rest."""
    i32, i64 = torch.int32, torch.int64
    num_decodes = num_seqs if num_tokens == num_seqs else num_seqs - 1
    q_lens = [1] * num_decodes + ([num_tokens - num_decodes] if num_decodes < num_seqs else [])
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    width = -(-max(q_lens) // block_size)
    return InputBatch(
        input_ids=torch.zeros(num_tokens, dtype=i64, device=device),
        positions=torch.zeros(num_tokens, dtype=i64, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=i64, device=device),
        attn=AttentionMetadata(
            num_decodes=num_decodes,
            block_tables=torch.zeros(num_seqs, width, dtype=i32, device=device),
            seq_lens=torch.tensor(q_lens, dtype=i32, device=device),
            query_start_loc=torch.tensor(starts, dtype=i32, device=device),
            max_seq_len=max(q_lens),
        ),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=i64, device=device),
        sampling=[],
        logits_are_all_rows=num_decodes == num_seqs,
    )


def _peak_bytes(model: torch.nn.Module, batch: InputBatch, caches: tuple[list, list]) -> int:
    device = batch.input_ids.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(batch, *caches)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def gpu_kv_budget(
    model: torch.nn.Module,
    device: torch.device,
    *,
    max_tokens: int,
    graph_sizes: Sequence[int],
    block_size: int = 16,
) -> int:
    """Bytes the KV cache may take on ``device``; runs the largest prefill step and the
    largest decode step once, over a one-block scratch cache."""
    layer = model.layers[0]
    shape = (1, block_size, layer.num_kv_heads, layer.head_dim)
    dtype = model.embed_tokens.weight.dtype
    caches = (
        [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers],
        [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers],
    )
    prefill = _peak_bytes(model, _inert_batch(max_tokens, 1, block_size, device), caches)
    decode = 0
    if graph_sizes:
        largest = max(graph_sizes)
        decode = _peak_bytes(model, _inert_batch(largest, largest, block_size, device), caches)
    # Each graph keeps its [size, vocab] float32 logits; the pool's scratch is the largest
    # bucket's activations.
    graphs = sum(graph_sizes) * model.config.vocab_size * 4 + decode if graph_sizes else 0
    del caches
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    reserve = max(prefill, decode) + graphs
    budget = int((free - reserve) * KV_FRACTION)
    logger.info(
        "GPU memory: %.2f GiB free after the weights; reserved %.2f GiB for activations "
        "(largest step %.2f GiB) and decode graphs (%.2f GiB); KV cache budget %.2f GiB",
        free / 2**30,
        reserve / 2**30,
        max(prefill, decode) / 2**30,
        graphs / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache ({free / 2**30:.2f} GiB free, "
            f"{reserve / 2**30:.2f} GiB needed by the steps): lower --max-num-batched-tokens "
            "or --max-num-seqs, or pass --kv-cache-memory"
        )
    return budget
