"""How much GPU memory the KV cache may take, measured before it is allocated.

The cache is sized last, from what is free once the weights are loaded, less what the
serving steps themselves will need: the activations of the largest step the scheduler can
plan (a prefill of ``max_num_batched_tokens`` tokens), measured by running one, and the
memory the decode graphs keep (each captured graph holds its own logits buffer, one per
batch bucket and context width, and all of them share one pool as large as the largest
bucket's activations).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import KVCacheSettingError
from engine.cuda_graphs import decode_graph_keys, inert_batch
from engine.input_batch import InputBatch

logger = logging.getLogger(__name__)

# The share of the memory left after the reserve that the KV cache takes (the rest covers
# the sampler's [rows, vocab] buffers, the allocator's fragmentation and other processes'
# CUDA contexts).
KV_FRACTION = 0.9
# What capturing the graphs may take beyond the reserve before it is reported: the caching
# allocator rounds each pool's memory up to whole segments (2 MiB small, 20 MiB large),
# which a tiny model's reserve does not count.
GRAPH_SLACK_BYTES = 64 * 2**20


def memory_baseline(device: torch.device, utilization: float) -> int:
    """The bytes free on ``device`` before this engine loads anything, for
    ``--gpu-memory-utilization``: what it then holds is measured against them. Raises
    ``KVCacheSettingError`` where the share asked for is more than is free (another process
    holds the rest), as nothing loaded afterwards could keep to it."""
    free, total = torch.cuda.mem_get_info(device)
    if utilization * total > free:
        raise KVCacheSettingError(
            f"--gpu-memory-utilization {utilization:g} asks for "
            f"{utilization * total / 2**30:.2f} GiB of {device}'s {total / 2**30:.2f} GiB, but "
            f"only {free / 2**30:.2f} GiB is free (other processes hold the rest): lower it"
        )
    return free


def kv_budget_bytes(
    free: int,
    total: int,
    reserve: int,
    *,
    utilization: float | None = None,
    baseline_free: int | None = None,
) -> int:
    """The KV cache's bytes, from the GPU's ``free`` and ``total`` bytes after the weights
    and the ``reserve`` for the steps' activations and graphs: KV_FRACTION of what the
    reserve leaves free; with ``utilization`` (and the free bytes before loading,
    ``memory_baseline``), no more than that share of ``total`` less what this engine holds
    since the baseline and the reserve. A share only ever lowers the budget: the rest of
    the free memory is the sampler's buffers' and the allocator's headroom."""
    budget = int((free - reserve) * KV_FRACTION)
    if utilization is None:
        return budget
    if baseline_free is None:
        raise ValueError("gpu_memory_utilization needs the free memory before loading")
    held = baseline_free - free  # the weights, and what loading them keeps
    return min(int(utilization * total) - held - reserve, budget)


@dataclass(frozen=True, slots=True)
class GpuBudget:
    """What ``gpu_kv_budget`` measured: the KV cache's bytes, and the bytes it left for the
    steps' activations and the CUDA graphs (what capturing the graphs may take, at most)."""

    kv_bytes: int
    reserve_bytes: int


def decode_graphs_bytes(
    graph_sizes: Sequence[int],
    *,
    max_blocks_per_seq: int,
    block_size: int,
    vocab_size: int,
    activation_bytes: int,
) -> int:
    """The memory the decode graphs keep: every graph ``DecodeGraphs`` captures (one per
    batch bucket and context width, ``decode_graph_keys``) its own ``[size, vocab]``
    float32 logits, and their shared pool the largest bucket's ``activation_bytes``."""
    if not graph_sizes:
        return 0
    keys = decode_graph_keys(graph_sizes, max_blocks_per_seq, block_size)
    return sum(size for size, _ in keys) * vocab_size * 4 + activation_bytes


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
    max_blocks_per_seq: int,
    prefill_sizes: Sequence[int] = (),
    prefill_whole: bool = False,
    block_size: int = 16,
    utilization: float | None = None,
    baseline_free: int | None = None,
) -> GpuBudget:
    """Bytes the KV cache may take on ``device``; runs the largest prefill step and the
    largest decode step once, over a one-block scratch cache. ``max_blocks_per_seq``: the
    decode graphs' full context width (blocks of the longest sequence); ``prefill_sizes``:
    the token buckets of the graphs for steps with prefill tokens (engine/prefill_graphs.py),
    none if empty; ``prefill_whole``: each bucket is captured whole besides its pieces;
    ``utilization``, ``baseline_free``: ``--gpu-memory-utilization`` (``kv_budget_bytes``)."""
    layer = model.layers[0]
    shape = (1, block_size, layer.num_kv_heads, layer.head_dim)
    dtype = model.embed_tokens.weight.dtype
    caches = (
        [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers],
        [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers],
    )
    prefill = _peak_bytes(model, inert_batch(max_tokens, 1, block_size, device), caches)
    decode = 0
    if graph_sizes:
        largest = max(graph_sizes)
        decode = _peak_bytes(model, inert_batch(largest, largest, block_size, device), caches)
    graphs = decode_graphs_bytes(
        graph_sizes,
        max_blocks_per_seq=max_blocks_per_seq,
        block_size=block_size,
        vocab_size=model.config.vocab_size,
        activation_bytes=decode,
    )
    if prefill_sizes:
        # Their own pool, as large as their largest bucket's activations, and each bucket's
        # last-layer output and residual stream, which each capture (whole, pieces) keeps.
        largest = max(prefill_sizes)
        graphs += _peak_bytes(model, inert_batch(largest, 1, block_size, device), caches)
        hidden = model.config.hidden_size * model.embed_tokens.weight.element_size()
        graphs += (2 if prefill_whole else 1) * 2 * hidden * sum(prefill_sizes)
    del caches
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(prefill, decode) + graphs
    budget = kv_budget_bytes(
        free, total, reserve, utilization=utilization, baseline_free=baseline_free
    )
    share = ""
    if utilization is not None:
        share = f" (--gpu-memory-utilization {utilization:g} of {total / 2**30:.2f} GiB)"
    logger.info(
        "GPU memory: %.2f GiB free after the weights; reserved %.2f GiB for activations "
        "(largest step %.2f GiB) and CUDA graphs (%.2f GiB); KV cache budget %.2f GiB%s",
        free / 2**30,
        reserve / 2**30,
        max(prefill, decode) / 2**30,
        graphs / 2**30,
        budget / 2**30,
        share,
    )
    if budget <= 0:
        raise KVCacheSettingError(
            f"no GPU memory is left for the KV cache{share} ({free / 2**30:.2f} GiB free, "
            f"{reserve / 2**30:.2f} GiB needed by the steps): lower --max-num-batched-tokens "
            "or --max-num-seqs, or "
            + ("raise --gpu-memory-utilization" if utilization else "pass --kv-cache-memory")
        )
    return GpuBudget(kv_bytes=budget, reserve_bytes=reserve)


def check_graph_memory(captured_bytes: int, reserve_bytes: int) -> bool:
    """Warn when capturing the CUDA graphs (their eager warm-up runs included) took more
    memory than the KV cache's budget left for the steps and the graphs, beyond
    GRAPH_SLACK_BYTES: the estimate missed something, and a large step may then run out of
    memory. Returns whether it fit."""
    if captured_bytes <= reserve_bytes + GRAPH_SLACK_BYTES:
        return True
    logger.warning(
        "capturing the CUDA graphs took %.2f GiB, more than the %.2f GiB reserved for the "
        "steps' activations and the graphs when the KV cache was sized: a large step may run "
        "out of memory (lower --max-num-seqs or --cuda-graph-sizes, or pass --kv-cache-memory)",
        captured_bytes / 2**30,
        reserve_bytes / 2**30,
    )
    return False
