"""Decode-attention cases for the kernel benchmarks: shapes, paged inputs, and the timers.

``benchmarks/kernels.py`` (the decode and fused-op tables) and ``benchmarks/decode_sweep.py``
(the decode launch sweep) time the same cases the same way: on CUDA, each case as one CUDA
graph over enough independent input sets that none is found in L2 (``time_graph``); on CPU
the least-disturbed of repeated calls (``time_cpu``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "TARGET_ROWS",
    "Config",
    "Inputs",
    "gather",
    "make_inputs",
    "num_input_sets",
    "time_cpu",
    "time_fn",
    "time_graph",
    "time_sets",
]


@dataclass(frozen=True)
class Config:
    batch: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    def bytes_moved(self) -> int:
        """Bytes one decode step must move: K and V of every context token, Q in, O out,
        and the block tables (int32)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        kv = 2 * self.batch * self.context_len * self.num_kv_heads * self.head_dim * elem
        q_and_o = 2 * self.batch * self.num_heads * self.head_dim * elem
        tables = self.batch * math.ceil(self.context_len / self.block_size) * 4
        return kv + q_and_o + tables

    def kv_gib(self) -> float:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.batch * self.context_len * self.num_kv_heads * self.head_dim * elem / 2**30


def time_cpu(fn: Callable[[], object], min_seconds: float = 0.2, max_reps: int = 50) -> float:
    """Fastest of repeated calls after one warm-up call, in seconds.

    The minimum, not the median: build machines are shared, and the least-disturbed run is
    the best estimate of the code's own cost.
    """
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps and (
        len(samples) < 3 or time.perf_counter() - start < min_seconds
    ):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples)


def time_fn(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call: do_bench on CUDA (median, L2 flushed), wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return time_cpu(fn)


# CUDA: each implementation is timed over this many bytes of independent inputs, captured in
# one CUDA graph (see time_graph), so that a small case does not find its data in the L2
# cache (50 MB on an H100) left there by the previous call.
GRAPH_BYTES = 256 * 2**20
MAX_INPUT_SETS = 64


def num_input_sets(bytes_per_call: int, device: torch.device) -> int:
    """How many independent input sets a case is timed over (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_INPUT_SETS, -(-GRAPH_BYTES // max(1, bytes_per_call))))


def time_graph(fns: list[Callable[[], object]], reps: int = 20) -> float:
    """Seconds per call of ``fns`` (one call per input set) captured in one CUDA graph.

    This is how a decode step runs in the engine (a graph, each layer on its own cache), so
    it measures the kernels and not Python's launch overhead, which at a few microseconds a
    launch exceeds a small case's whole GPU time (``do_bench`` then times the launches).
    The median of ``reps`` replays, divided by the calls in one replay.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    # Replay for 25 ms first (do_bench's warm-up): an idle GPU's clocks take that long to
    # rise, and the first case timed after a pause otherwise reads ~15% slow.
    warm_until = time.perf_counter() + 0.025
    while time.perf_counter() < warm_until:
        graph.replay()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] / 1e3 / len(fns)


def time_sets(
    impl: Callable[[object], object], sets: list, device: torch.device, *, capturable: bool = True
) -> float:
    """Seconds per call of ``impl(input_set)``: a CUDA graph over every set on CUDA (do_bench
    on the first set where the implementation cannot be captured, e.g. it reads a tensor on
    the host), wall clock on the first set on CPU."""
    if device.type == "cuda" and capturable:
        return time_graph([lambda s=s: impl(s) for s in sets])
    return time_fn(lambda: impl(sets[0]), device)


@dataclass
class Inputs:
    query: torch.Tensor  # [batch, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [batch, blocks_per_seq] int32, shuffled
    seq_lens: torch.Tensor  # [batch] int32, all context_len
    key: torch.Tensor  # [batch, num_kv_heads, context_len, head_dim] contiguous, for SDPA
    value: torch.Tensor  # [batch, num_kv_heads, context_len, head_dim]


def make_inputs(cfg: Config, device: torch.device) -> Inputs:
    blocks_per_seq = math.ceil(cfg.context_len / cfg.block_size)
    num_blocks = cfg.batch * blocks_per_seq
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    key_cache = torch.randn(shape, dtype=cfg.dtype, device=device)
    value_cache = torch.randn(shape, dtype=cfg.dtype, device=device)
    # Shuffled block ids: a realistic pool after many allocations and frees.
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(cfg.batch, blocks_per_seq)
    seq_lens = torch.full((cfg.batch,), cfg.context_len, dtype=torch.int32, device=device)
    query = torch.randn(cfg.batch, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=device)
    return Inputs(
        query, key_cache, value_cache, block_tables, seq_lens,
        gather(key_cache, block_tables, cfg.context_len),
        gather(value_cache, block_tables, cfg.context_len),
    )  # fmt: skip


def gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, blocks_per_seq] int32
    context_len: int,
) -> torch.Tensor:  # [batch, num_kv_heads, context_len, head_dim] contiguous
    batch = block_tables.shape[0]
    blocks = cache.index_select(0, block_tables.flatten().long())
    flat = blocks.view(batch, -1, cache.shape[2], cache.shape[3])[:, :context_len]
    return flat.transpose(1, 2).contiguous()


# The decode rows: (batch, context), Llama-3-8B shape, block 16.
TARGET_ROWS = [(1, 512), (16, 512), (1, 4096), (64, 4096), (256, 4096)]
