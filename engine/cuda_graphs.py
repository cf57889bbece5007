"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step of ``n`` requests is padded to the smallest captured bucket ``b >= n``:
its token ids, positions, slot mapping, block tables and context lengths are copied into
persistent buffers that every graph was captured over, the rows ``n..b`` are made inert,
and the graph of ``b`` replays the whole forward (every layer's launches) in one call. The
per-step Python work is then independent of the number of layers.

Inert padding rows (``inert_batch`` builds them, for the graphs' buffers and for
engine/gpu_memory.py's measuring steps): slot -1 (the KV store skips it), context length 1
over block 0 (the attention reads one cached token, which is finite because the cache is
zero-filled), token 0 at position 0. Every op of the forward is row-wise apart from
attention, which is per-sequence, so padding rows never change a real row's result; their
logits are dropped.

Small batches also get graphs per context bucket (``SHORT_CONTEXTS``): the decode kernel
splits each sequence's context over several programs when the batch alone cannot fill the
GPU, and it sizes the splits from the block-table width it is given. A graph captured over
the full width would size them for the longest context the model allows, leaving a short
context in one split; a graph over a narrower view of the same buffer sizes them for that
bucket. A step takes the narrowest bucket that holds its longest context.

Mixed and prefill steps, static batches with padding rows of their own, and batches larger
than the largest bucket run eagerly.

Off CUDA (``capture=False``) the same buffers, padding and bucketing run, and "replay" is an
eager forward over the persistent buffers: the plumbing is tested where no GPU is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.input_batch import AttentionMetadata, InputBatch
from kvpool.storage import KVCacheStorage

if TYPE_CHECKING:
    from engine.backends import ModelForward

logger = logging.getLogger(__name__)

# Context buckets (tokens) captured besides the full width, for batches of at most
# SHORT_CONTEXT_MAX_BATCH sequences: larger batches give the decode kernel enough programs
# without splitting, so their split count does not depend on the context.
SHORT_CONTEXTS = (1024, 4096)
SHORT_CONTEXT_MAX_BATCH = 32


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to ``max_num_seqs``
    (which is always a bucket, so every decode step has one)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def context_widths(size: int, max_blocks_per_seq: int, block_size: int) -> list[int]:
    """The context buckets (in blocks) batch bucket ``size`` gets a graph for, narrowest
    first; the full width ``max_blocks_per_seq`` last (and alone above
    SHORT_CONTEXT_MAX_BATCH)."""
    if size > SHORT_CONTEXT_MAX_BATCH:
        return [max_blocks_per_seq]
    short = {-(-c // block_size) for c in SHORT_CONTEXTS}
    return sorted(w for w in short if w < max_blocks_per_seq) + [max_blocks_per_seq]


def decode_graph_keys(
    sizes: Sequence[int], max_blocks_per_seq: int, block_size: int
) -> list[tuple[int, int]]:
    """Every (batch bucket, context width) ``DecodeGraphs`` captures a graph for, largest
    first: what each keeps (its logits) is counted per key (engine/gpu_memory.py)."""
    return sorted(
        ((s, w) for s in set(sizes) for w in context_widths(s, max_blocks_per_seq, block_size)),
        reverse=True,
    )


def inert_batch(
    num_tokens: int, num_seqs: int, block_size: int, device: torch.device
) -> InputBatch:
    """A batch of inert rows, which writes no K/V and reads block 0 only: ``num_seqs``
    sequences, the first ``num_seqs - 1`` decodes (all of them when ``num_tokens ==
    num_seqs``) and the last one a prefill of the other tokens, whose context is its own
    tokens over a table of block 0."""
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


class DecodeGraphs:
    """Owns the persistent input buffers and the captured graphs (or their stand-in)."""

    def __init__(
        self,
        model: ModelForward,  # the model, or a backend's forward in its place
        storage: KVCacheStorage,
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        device: torch.device,
        *,
        capture: bool,
    ) -> None:
        self.model = model
        self.storage = storage
        self.sizes = sorted(set(sizes))
        self.capture = capture
        self.device = device
        max_bs = self.sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        # The buffers start as inert decode rows; ``run`` copies a step's rows over the head
        # and the padding rows back from ``_inert`` (a previous step may have used them).
        self._inert = inert_batch(max_bs, max_bs, storage.block_size, device)
        buffers = inert_batch(max_bs, max_bs, storage.block_size, device)
        self.input_ids = buffers.input_ids  # [max_bs]
        self.positions = buffers.positions  # [max_bs]
        self.slot_mapping = buffers.slot_mapping  # [max_bs]
        self.seq_lens = buffers.attn.seq_lens  # [max_bs]
        self.query_start_loc = buffers.attn.query_start_loc  # [max_bs + 1]
        self.logits_indices = buffers.logits_indices  # [max_bs]
        block_size = storage.block_size
        # Per batch bucket, its context buckets in blocks, narrowest first; the full width last.
        self.widths: dict[int, list[int]] = {
            size: context_widths(size, max_blocks_per_seq, block_size) for size in self.sizes
        }
        # Per context width, a [max_bs, width] table: contiguous rows of exactly that width,
        # as every attention kernel expects of a block table.
        self.block_tables = {
            width: self._inert_tables(slice(0, max_bs), width).clone()
            for width in {w for ws in self.widths.values() for w in ws}
        }
        # Rows a step may have left non-inert: in the 1-D buffers, and per table width. Only
        # those rows of a padded bucket are made inert again (rows past them still are).
        self._dirty_rows = 0
        self._dirty_table_rows = dict.fromkeys(self.block_tables, 0)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0

    # ---- which steps ---------------------------------------------------------------------

    def bucket(self, num_seqs: int) -> int | None:
        return smallest_bucket(self.sizes, num_seqs)

    def handles(self, batch: InputBatch) -> bool:
        """A decode-only step without padding rows, of at most the largest bucket."""
        n = batch.num_tokens
        return (
            batch.logits_are_all_rows
            and batch.attn.num_decodes == n
            and n <= self.sizes[-1]
            and batch.attn.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    # ---- capture and replay --------------------------------------------------------------

    def width(self, size: int, needed: int) -> int:
        """The narrowest context bucket of batch bucket ``size`` holding ``needed`` blocks."""
        return next(w for w in self.widths[size] if w >= needed)

    def static_batch(self, size: int, width: int) -> InputBatch:
        """The persistent buffers' first ``size`` rows and ``width`` block-table columns, as
        the batch a graph is captured on."""
        return InputBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            attn=AttentionMetadata(
                num_decodes=size,
                block_tables=self.block_tables[width][:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                max_seq_len=width * self.storage.block_size,
            ),
            logits_indices=self.logits_indices[:size],
            sampling=[],
            logits_are_all_rows=True,
        )

    def _inert_tables(self, rows: slice, width: int) -> torch.Tensor:
        """The inert rows' block-table ``rows``, ``width`` columns wide (a view)."""
        return self._inert.attn.block_tables[rows].expand(-1, width)

    def _forward(self, size: int, width: int) -> torch.Tensor:
        return self.model(
            self.static_batch(size, width), self.storage.key_caches, self.storage.value_caches
        )

    @property
    def keys(self) -> list[tuple[int, int]]:
        """Every (batch bucket, context width) a graph is kept for, largest first."""
        return decode_graph_keys(self.sizes, self.max_blocks_per_seq, self.storage.block_size)

    def capture_all(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool.
        The buffers hold inert rows throughout, so capturing writes no K/V."""
        if not self.capture:
            return
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        # One eager run first: Triton compiles and cuBLAS picks its kernels outside capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for key in self.keys:
                self._forward(*key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for key in self.keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(*key)
            self._graphs[key] = (graph, logits)
        # A graph's first launch also uploads it to the device: done here, over the inert
        # rows (it writes nothing), and not in the first request's time.
        for graph, _ in self._graphs.values():
            graph.replay()
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info(
            "captured %d CUDA graphs for decode batches of %s (small batches also per "
            "context bucket) in %.2f s (%.0f MiB)",
            len(self._graphs),
            _ranges(self.sizes),
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def run(self, batch: InputBatch) -> torch.Tensor:  # [num_seqs, vocab] float32
        n = batch.num_tokens
        size = self.bucket(n)
        assert size is not None and self.handles(batch)
        width = batch.attn.block_tables.shape[1]
        key = (size, self.width(size, width))
        tables = self.block_tables[key[1]]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.attn.seq_lens, non_blocking=True)
        tables[:n, :width].copy_(batch.attn.block_tables, non_blocking=True)
        # Columns past a row's own blocks keep a previous step's ids: attention reads a
        # table only up to its row's context. Rows n..size become inert padding again, as
        # far as an earlier step wrote them.
        inert = self._inert
        pad, self._dirty_rows = padding_to_reset(self._dirty_rows, n, size)
        if pad is not None:
            self.input_ids[pad].copy_(inert.input_ids[pad])
            self.positions[pad].copy_(inert.positions[pad])
            self.slot_mapping[pad].copy_(inert.slot_mapping[pad])
            self.seq_lens[pad].copy_(inert.attn.seq_lens[pad])
        pad, self._dirty_table_rows[key[1]] = padding_to_reset(
            self._dirty_table_rows[key[1]], n, size
        )
        if pad is not None:
            tables[pad].copy_(self._inert_tables(pad, tables.shape[1]))
        captured = self._graphs.get(key)
        if captured is None:  # the stand-in
            return self._forward(*key)[:n]
        graph, logits = captured
        graph.replay()
        return logits[:n]


def padding_to_reset(dirty: int, n: int, size: int) -> tuple[slice | None, int]:
    """A step of ``n`` rows padded to ``size``, over buffers whose rows from ``dirty`` on are
    inert: the padding rows to make inert again (None: none), and where the inert rows start
    once this step has written its own."""
    pad = slice(n, min(size, dirty)) if min(size, dirty) > n else None
    return pad, dirty if dirty > size else n


def smallest_bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of ``sizes`` (sorted) that holds ``n``; None if none does."""
    return next((size for size in sizes if size >= n), None)


def _ranges(sizes: Sequence[int]) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"
