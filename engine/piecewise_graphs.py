"""Steps with prefill tokens replayed from CUDA graphs in pieces, attention run between them.

Decode-only steps replay one whole-forward graph (engine/cuda_graphs.py). A step with
prefill tokens cannot: its attention depends on how the tokens split into sequences
(query start locations, which rows are decodes, the prefill kernel's grid), which changes
every step. Run eagerly, though, such a step pays the launch cost of the whole forward
(hundreds of small kernels from Python), which on a GPU costs about what a decode step
costs: a chunk of a short prompt admitted beside running decodes then doubles or triples
their inter-token latency.

Here the forward is captured per token-count bucket as ``num_layers + 1`` graphs, cut at
each layer's attention: graph ``i`` runs from layer ``i - 1``'s attention output to layer
``i``'s rotated queries (norms, projections, RoPE and the K/V store, MLP), and attention
runs eagerly between two replays, with the step's own plan, over the real rows. The last
graph ends at the final layer's output; the final norm and head run eagerly over the rows
the step samples, as in the plain forward.

Buffers every graph was captured over (one set, sliced per bucket):
- ``input_ids``, ``positions``, ``slot_mapping``: a step's ``n`` tokens are copied over
  the head, and rows ``n..bucket`` get slot -1, so padding rows never write K/V (their ids
  and positions are a previous step's or 0, valid either way);
- ``queries``: each captured piece ends by copying its rotated queries here; attention
  reads rows ``0..n``;
- ``attn_out``: attention writes its output rows ``0..n`` here (no copy: one launch per
  layer where the step's plan attends in one, ``AttentionPlan``); the next piece reads the
  whole bucket (rows past ``n`` hold earlier values: finite, and read only by padding rows).

Every op but attention is row-wise, so a padding row never changes a real row. A real
row's matmuls run with the bucket's row count, which may round differently from the eager
row count: the near-tie rule covers that, as it covers batching.

Off CUDA (``capture=False``) the same buffers, padding and cuts run, with the pieces
computed eagerly in place of replays: the plumbing is tested where no GPU is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.cuda_graphs import inert_batch, smallest_bucket
from engine.input_batch import InputBatch
from kvpool.storage import KVCacheStorage

if TYPE_CHECKING:
    from engine.attention import AttentionPlan, PagedAttention
    from engine.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def default_piecewise_sizes(max_tokens: int) -> list[int]:
    """Token buckets up to ``max_tokens``: fine steps at the sizes a short prompt beside
    running decodes makes (a step padded to the next bucket computes the gap for nothing),
    coarser above."""
    sizes = [16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024]
    return [s for s in sizes if s <= max_tokens]


@dataclass(slots=True)
class _Cut:
    """One attention call between two captured pieces."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    sliding: bool


@dataclass(slots=True)
class _Captured:
    pieces: list[torch.cuda.CUDAGraph]  # num_layers + 1
    cuts: list[_Cut]  # num_layers, cut i between pieces i and i + 1
    hidden: torch.Tensor  # [bucket, hidden]: the last layer's output, written by the last piece
    residual: torch.Tensor  # [bucket, hidden]


class _Splitter:
    """Stands in for the model's attention while the model runs over the buffers: stores
    the rotated queries, runs (or, capturing, cuts at) attention, hands back ``attn_out``."""

    def __init__(self, owner: PiecewiseGraphs) -> None:
        self.owner = owner

    def rope_and_store(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.owner.attention.rope_and_store(*args, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        query: torch.Tensor,  # [bucket, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        sliding: bool = False,
    ) -> torch.Tensor:
        return self.owner._cut(query, _Cut(key_cache, value_cache, sliding))


class PiecewiseGraphs:
    """Owns the buffers and the pieces captured per token bucket (or their stand-in)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVCacheStorage,
        sizes: Sequence[int],
        device: torch.device,
        *,
        capture: bool,
    ) -> None:
        self.model = model
        self.attention: PagedAttention = model.attention
        self.storage = storage
        self.sizes = sorted(set(sizes))
        self.device = device
        self.capture = capture
        max_tokens = self.sizes[-1]
        layer = model.layers[0]
        dtype = model.embed_tokens.weight.dtype
        self.num_heads, self.head_dim = layer.num_heads, layer.head_dim
        self.num_kv_heads = layer.num_kv_heads
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        shape = (max_tokens, self.num_heads, self.head_dim)
        self.queries = torch.zeros(shape, dtype=dtype, device=device)
        self.attn_out = torch.zeros(shape, dtype=dtype, device=device)
        # Built here, not while capturing: making a tensor from host values copies it to
        # the device, which a capturing stream does not allow.
        self._static = {size: self._static_batch(size) for size in self.sizes}
        self._captured: dict[int, _Captured] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0
        # Set while the model runs over the buffers: the step's plan and real row count
        # (eager pieces), or the pieces and cuts captured so far (capturing).
        self._plan: AttentionPlan | None = None
        self._rows = 0
        self._pieces: list[torch.cuda.CUDAGraph] | None = None
        self._cuts: list[_Cut] = []
        self._pool: tuple[int, int] | None = None

    # ---- which steps ---------------------------------------------------------------------

    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.sizes, num_tokens)

    def handles(self, batch: InputBatch) -> bool:
        """A step of at most the largest bucket's tokens (the runner asks the decode graphs
        first, so in practice: steps with prefill or speculative rows)."""
        return batch.num_tokens <= self.sizes[-1]

    # ---- the model over the buffers -----------------------------------------------------

    def _static_batch(self, size: int) -> InputBatch:
        """The buffers' first ``size`` rows as the batch the pieces run on. Its attention
        metadata is never read: the splitter takes attention's place."""
        inert = inert_batch(size, 1, self.storage.block_size, self.device)
        return InputBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            attn=inert.attn,
            logits_indices=inert.logits_indices,
            sampling=[],
        )

    def _hidden_states(self, size: int, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.model
        real, model.attention = model.attention, _Splitter(self)  # type: ignore[assignment]
        try:
            with torch.inference_mode():
                return model.hidden_states(
                    self._static[size],
                    self.storage.key_caches,
                    self.storage.value_caches,
                    plan,
                )
        finally:
            model.attention = real

    def _cut(self, query: torch.Tensor, cut: _Cut) -> torch.Tensor:
        size = query.shape[0]
        self.queries[:size].copy_(query)
        if self._pieces is not None:  # capturing: end this piece, begin the next
            self._pieces[-1].capture_end()
            self._cuts.append(cut)
            self._pieces.append(torch.cuda.CUDAGraph())
            self._pieces[-1].capture_begin(pool=self._pool)
        else:
            self._attend(cut)
        return self.attn_out[:size]

    def _attend(self, cut: _Cut) -> None:
        n, plan = self._rows, self._plan
        assert plan is not None
        self.attention(
            self.queries[:n],
            cut.key_cache,
            cut.value_cache,
            plan,
            sliding=cut.sliding,
            out=self.attn_out[:n],
        )

    def _plan_of(self, batch: InputBatch) -> AttentionPlan:
        return self.attention.plan(batch.attn, self.storage.block_size, self.num_kv_heads)

    # ---- capture and replay --------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every bucket's pieces, largest first so the smaller ones reuse its memory
        pool. The buffers hold inert rows (slot -1) throughout, so nothing writes K/V."""
        if not self.capture:
            return
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Eager runs first: Triton compiles and cuBLAS picks its kernels outside capture.
            for size in reversed(self.sizes):
                self._rows, self._plan = size, self._plan_of(self._static[size])
                self._hidden_states(size, self._plan)
            torch.cuda.synchronize(self.device)
            self._pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                self._captured[size] = self._capture(size, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self._plan = None
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info(
            "captured piecewise CUDA graphs for steps with prefill tokens, %d token buckets "
            "up to %d (%d pieces each, attention eager between them) in %.2f s (%.0f MiB)",
            len(self.sizes),
            self.sizes[-1],
            len(self.model.layers) + 1,
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def _capture(self, size: int, stream: torch.cuda.Stream) -> _Captured:
        self._cuts = []
        self._pieces = [torch.cuda.CUDAGraph()]
        # Not read while capturing (the splitter cuts instead of attending), but made
        # before: planning may copy host values.
        plan = self._plan_of(self._static[size])
        torch.cuda.synchronize(self.device)
        self._pieces[0].capture_begin(pool=self._pool)
        try:
            hidden, residual = self._hidden_states(size, plan)
        finally:
            self._pieces[-1].capture_end()
        pieces, cuts = self._pieces, self._cuts
        self._pieces, self._cuts = None, []
        assert len(pieces) == len(cuts) + 1 == len(self.model.layers) + 1
        return _Captured(pieces, cuts, hidden, residual)

    def run(self, batch: InputBatch) -> torch.Tensor:  # [num_samples, vocab] float32
        n = batch.num_tokens
        size = self.bucket(n)
        assert size is not None
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
        self._rows, self._plan = n, self._plan_of(batch)
        try:
            captured = self._captured.get(size)
            if captured is None:  # the stand-in
                hidden, residual = self._hidden_states(size, self._plan)
            else:
                for piece, cut in zip(captured.pieces, captured.cuts, strict=False):
                    piece.replay()
                    self._attend(cut)
                captured.pieces[-1].replay()
                hidden, residual = captured.hidden, captured.residual
            with torch.inference_mode():
                return self.model.compute_logits(hidden[:n], residual[:n], batch)
        finally:
            self._plan = None
