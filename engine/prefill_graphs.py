"""Steps with prefill tokens replayed from CUDA graphs: whole where their attention fits in
one launch, in pieces cut at attention elsewhere.

Decode-only steps replay one whole-forward graph per batch bucket (engine/cuda_graphs.py).
A step with prefill (or speculative) rows has a shape that changes every step: how its
tokens split into sequences, which rows are decodes. Run eagerly, such a step pays the
launch cost of the whole forward (hundreds of small kernels from Python), which on a GPU
costs about what a decode step costs: a chunk of a short prompt admitted beside running
decodes then doubles or triples their inter-token latency.

Here each token bucket gets two captures of the forward, over one set of buffers:

- **Whole** (``mode="full"``): the whole forward in one graph, attention inside it. This
  holds where the step's plan attends in one launch (``AttentionPlan.one_launch``: the
  prefill kernel over every row, a decode being a chunk of one query) or has no decodes.
  That kernel's grid depends only on the token and sequence counts, never on the step's
  lengths, so a graph captured over a bucket's token count and a fixed sequence count
  (``seq_capacity``) replays any step of that bucket: the step's sequences fill the head of
  the metadata buffers, and the rest are empty sequences (no queries, no context), whose
  programs return at once.
- **Pieces**: ``num_layers + 1`` graphs cut at each layer's attention. Graph ``i`` runs
  from layer ``i - 1``'s attention output to layer ``i``'s rotated queries (norms,
  projections, RoPE and the K/V store, MLP), and attention runs eagerly between two
  replays, with the step's own plan, over the real rows. This is for the steps whose
  decodes the decode kernel splits (few decodes over long contexts: more programs per
  context than the prefill kernel's one per KV head), whose launch depends on the
  contexts' width; and for every step with ``mode="piecewise"``.

Either way the last graph ends at the final layer's output; the final norm and head run
eagerly over the rows the step samples, as in the plain forward.

Buffers every graph was captured over (one set, sliced per bucket):
- ``input_ids``, ``positions``, ``slot_mapping``: a step's ``n`` tokens are copied over
  the head, and rows ``n..bucket`` get slot -1, so padding rows never write K/V (their ids
  and positions are a previous step's or 0, valid either way);
- ``attn_out``: attention writes its output rows ``0..n`` here; the next layer reads the
  whole bucket (rows past ``n`` hold earlier values: finite, and read only by padding
  rows, which no sequence covers);
- ``queries`` (pieces): each piece ends by copying its rotated queries here, and attention
  reads rows ``0..n``;
- ``seq_lens``, ``query_start_loc``, ``block_tables`` (whole): the step's ``s`` sequences
  over the head; sequences ``s..seq_capacity`` get length 0 and start at ``n``. Table
  columns past a row's own blocks keep earlier ids: attention reads a row's table only up
  to its context.

Every op but attention is row-wise, so a padding row never changes a real row. A real
row's matmuls run with the bucket's row count, which may round differently from the eager
row count: the near-tie rule covers that, as it covers batching. The whole graph and the
pieces run the same kernels on the same rows, so a step's tokens do not depend on which
one it replays.

Off CUDA (``capture=False``) the same buffers, padding and cuts run, with the graphs'
work computed eagerly in place of replays: the plumbing is tested where no GPU is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionPlan
from engine.config import CUDA_GRAPH_PREFILL_MODES
from engine.cuda_graphs import inert_batch, padding_to_reset, smallest_bucket
from engine.input_batch import AttentionMetadata, InputBatch
from kvpool.storage import KVCacheStorage

if TYPE_CHECKING:
    from engine.attention import PagedAttention
    from engine.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def default_prefill_sizes(max_tokens: int) -> list[int]:
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
    """One bucket's capture: its graphs, and the outputs the last one writes."""

    graphs: list[torch.cuda.CUDAGraph]  # whole: one; pieces: num_layers + 1
    cuts: list[_Cut]  # pieces: num_layers, cut i between graphs i and i + 1; whole: none
    hidden: torch.Tensor  # [bucket, hidden]: the last layer's output
    residual: torch.Tensor  # [bucket, hidden]


class _StandIn:
    """Stands in for the model's attention while the model runs over the buffers.

    Whole: attends with the plan it is given, writing into ``attn_out`` (so that rows no
    sequence covers keep finite values, not the pool's leftovers). In pieces: stores the
    rotated queries, runs (or, capturing, cuts at) attention, hands back ``attn_out``."""

    def __init__(self, owner: PrefillGraphs, *, whole: bool) -> None:
        self.owner = owner
        self.whole = whole

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
        owner = self.owner
        if self.whole:
            out = owner.attn_out[: query.shape[0]]
            return owner.attention(query, key_cache, value_cache, plan, sliding=sliding, out=out)
        return owner._cut(query, _Cut(key_cache, value_cache, sliding))


class PrefillGraphs:
    """Owns the buffers and the graphs captured per token bucket (or their stand-in)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVCacheStorage,
        sizes: Sequence[int],
        device: torch.device,
        *,
        capture: bool,
        mode: str = "full",
        max_num_seqs: int | None = None,
        max_blocks_per_seq: int = 1,
    ) -> None:
        """Args:
        sizes: the token buckets.
        capture: capture CUDA graphs (CUDA); False: the eager stand-in.
        mode: "full" (a whole graph per bucket for the steps that attend in one launch,
            pieces for the others) or "piecewise" (pieces only).
        max_num_seqs: the most sequences a step holds (the scheduler's limit); None: no
            more than the tokens. Whole graphs are captured for this many sequences at
            most, and a bucket of fewer tokens for as many sequences as tokens.
        max_blocks_per_seq: the widest block table a step brings (whole graphs' table
            buffer).
        """
        if mode not in CUDA_GRAPH_PREFILL_MODES:
            raise ValueError(
                f"mode must be one of {', '.join(CUDA_GRAPH_PREFILL_MODES)}, got {mode!r}"
            )
        self.model = model
        self.attention: PagedAttention = model.attention
        self.storage = storage
        self.sizes = sorted(set(sizes))
        self.device = device
        self.capture = capture
        # The cpu backend has no prefill kernel to attend in one launch (it plans per token).
        self.whole = mode == "full" and self.attention.backend != "cpu"
        max_tokens = self.sizes[-1]
        self.max_seqs = min(max_tokens, max_num_seqs or max_tokens)
        layer = model.layers[0]
        dtype = model.embed_tokens.weight.dtype
        self.num_heads, self.head_dim = layer.num_heads, layer.head_dim
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        shape = (max_tokens, self.num_heads, self.head_dim)
        self.queries = torch.zeros(shape, dtype=dtype, device=device)
        self.attn_out = torch.zeros(shape, dtype=dtype, device=device)
        i32 = torch.int32
        seqs = self.max_seqs if self.whole else 0
        self.max_blocks_per_seq = max_blocks_per_seq
        self.seq_lens = torch.zeros(seqs, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros(seqs, max_blocks_per_seq, dtype=i32, device=device)
        # Built here, not while capturing: making a tensor from host values copies it to
        # the device, which a capturing stream does not allow.
        self._static = {size: self._static_batch(size) for size in self.sizes}
        self._whole_plans = {size: self._whole_plan(size) for size in self.sizes if self.whole}
        self._pieces: dict[int, _Captured] = {}
        self._wholes: dict[int, _Captured] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0
        # Set while the model runs over the buffers in pieces: the step's plan and real row
        # count (eager pieces), or the pieces and cuts captured so far (capturing).
        self._plan: AttentionPlan | None = None
        self._rows = 0
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self._cuts: list[_Cut] = []
        self._pool: tuple[int, int] | None = None
        # Where the whole graphs' sequence buffers stop holding empty sequences (a step
        # may have written its own past the next step's).
        self._dirty_seqs = 0
        # How many steps replayed each way (benchmarks.gpu's profile reads them).
        self.replays = {"whole": 0, "pieces": 0}

    # ---- which steps ---------------------------------------------------------------------

    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.sizes, num_tokens)

    def seq_capacity(self, size: int) -> int:
        """The sequences bucket ``size``'s whole graph covers: a step of at most ``size``
        tokens has at most that many, and never more than ``max_num_seqs``."""
        return min(size, self.max_seqs)

    def handles(self, batch: InputBatch) -> bool:
        """A step of at most the largest bucket's tokens (the runner asks the decode graphs
        first, so in practice: steps with prefill or speculative rows)."""
        return batch.num_tokens <= self.sizes[-1]

    def takes_whole(self, batch: InputBatch, plan: AttentionPlan, size: int) -> bool:
        """Whether ``batch`` (with its own ``plan``, in bucket ``size``) replays the whole
        graph: its attention is one launch of the prefill kernel over every row, as the
        whole graph's is, and its sequences and tables fit the buffers."""
        meta = batch.attn
        return (
            self.whole
            and (plan.one_launch or meta.num_decodes == 0)
            and meta.seq_lens.shape[0] <= self.seq_capacity(size)
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    # ---- the model over the buffers -----------------------------------------------------

    def _static_batch(self, size: int) -> InputBatch:
        """The buffers' first ``size`` rows as the batch the graphs run on. Its attention
        metadata is the whole graph's (``_whole_plan``); the pieces never read it."""
        seqs = self.seq_capacity(size) if self.whole else 0
        attn = (
            AttentionMetadata(
                num_decodes=0,
                block_tables=self.block_tables[:seqs],
                seq_lens=self.seq_lens[:seqs],
                query_start_loc=self.query_start_loc[: seqs + 1],
                max_seq_len=self.max_blocks_per_seq * self.storage.block_size,
            )
            if self.whole
            else inert_batch(size, 1, self.storage.block_size, self.device).attn
        )
        return InputBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            attn=attn,
            logits_indices=torch.zeros(0, dtype=torch.int64, device=self.device),
            sampling=[],
        )

    def _whole_plan(self, size: int) -> AttentionPlan:
        """The prefill kernel over every row of the buffers' sequences, every layer."""
        return AttentionPlan(self._static[size].attn, one_launch=True)

    def _hidden_states(
        self, size: int, plan: AttentionPlan, *, whole: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.model
        stand_in = _StandIn(self, whole=whole)
        real, model.attention = model.attention, stand_in  # type: ignore[assignment]
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
        if self._capturing is not None:  # capturing: end this piece, begin the next
            self._capturing[-1].capture_end()
            self._cuts.append(cut)
            self._capturing.append(torch.cuda.CUDAGraph())
            self._capturing[-1].capture_begin(pool=self._pool)
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
        return self.attention.plan(batch.attn, self.storage.key_caches[0])

    # ---- capture and replay --------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture every bucket (whole, then in pieces), largest first so the smaller ones
        reuse its memory pool. The buffers hold inert rows (slot -1) and empty sequences
        throughout, so nothing writes K/V and attention reads nothing."""
        if not self.capture:
            return
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Eager runs first: Triton compiles and cuBLAS picks its kernels outside capture.
            for size in reversed(self.sizes):
                if self.whole:
                    self._hidden_states(size, self._whole_plans[size], whole=True)
                self._rows, self._plan = size, self._plan_of(self._static[size])
                self._hidden_states(size, self._plan, whole=False)
            torch.cuda.synchronize(self.device)
            self._pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                if self.whole:
                    self._wholes[size] = self._capture_whole(size)
                self._pieces[size] = self._capture_pieces(size)
            # A graph's first launch also uploads it to the device: done here, not in the
            # first request's time. Over the inert rows and empty sequences nothing reaches
            # the cache (every slot is -1); the pieces run without attention between them,
            # and what they compute is not read.
            for captured in (*self._wholes.values(), *self._pieces.values()):
                for graph in captured.graphs:
                    graph.replay()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self._plan = None
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info(
            "captured CUDA graphs for steps with prefill tokens, %d token buckets up to %d: "
            "%sin %d pieces each (attention eager between them), in %.2f s (%.0f MiB)",
            len(self.sizes),
            self.sizes[-1],
            f"whole (attention in one launch, up to {self.max_seqs} sequences) and "
            if self.whole
            else "",
            len(self.model.layers) + 1,
            self.capture_s,
            self.pool_bytes / 2**20,
        )

    def _capture_whole(self, size: int) -> _Captured:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        graph.capture_begin(pool=self._pool)
        try:
            hidden, residual = self._hidden_states(size, self._whole_plans[size], whole=True)
        finally:
            graph.capture_end()
        return _Captured([graph], [], hidden, residual)

    def _capture_pieces(self, size: int) -> _Captured:
        self._cuts = []
        self._capturing = [torch.cuda.CUDAGraph()]
        # Not read while capturing (the stand-in cuts instead of attending), but made
        # before: planning may copy host values.
        plan = self._plan_of(self._static[size])
        torch.cuda.synchronize(self.device)
        self._capturing[0].capture_begin(pool=self._pool)
        try:
            hidden, residual = self._hidden_states(size, plan, whole=False)
        finally:
            self._capturing[-1].capture_end()
        pieces, cuts = self._capturing, self._cuts
        self._capturing, self._cuts = None, []
        assert len(pieces) == len(cuts) + 1 == len(self.model.layers) + 1
        return _Captured(pieces, cuts, hidden, residual)

    def run(self, batch: InputBatch) -> tuple[torch.Tensor, bool]:
        """The step's logits ([num_samples, vocab] float32), and whether it replayed the
        whole graph (else the pieces)."""
        n = batch.num_tokens
        size = self.bucket(n)
        assert size is not None
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
        plan = self._plan_of(batch)
        whole = self.takes_whole(batch, plan, size)
        if whole:
            self.replays["whole"] += 1
            hidden, residual = self._run_whole(batch, size)
        else:
            self.replays["pieces"] += 1
            hidden, residual = self._run_pieces(plan, n, size)
        with torch.inference_mode():
            return self.model.compute_logits(hidden[:n], residual[:n], batch), whole

    def _run_whole(self, batch: InputBatch, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta, n = batch.attn, batch.num_tokens
        s, width = meta.seq_lens.shape[0], meta.block_tables.shape[1]
        self.seq_lens[:s].copy_(meta.seq_lens, non_blocking=True)
        self.query_start_loc[: s + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.block_tables[:s, :width].copy_(meta.block_tables, non_blocking=True)
        # Sequences s..capacity are empty: no queries (they start where the step's tokens
        # end, n) and no context (length 0 again, as far as an earlier step wrote them).
        capacity = self.seq_capacity(size)
        if capacity > s:
            self.query_start_loc[s + 1 : capacity + 1].fill_(n)
        pad, self._dirty_seqs = padding_to_reset(self._dirty_seqs, s, capacity)
        if pad is not None:
            self.seq_lens[pad].zero_()
        captured = self._wholes.get(size)
        if captured is None:  # the stand-in
            return self._hidden_states(size, self._whole_plans[size], whole=True)
        captured.graphs[0].replay()
        return captured.hidden, captured.residual

    def _run_pieces(
        self, plan: AttentionPlan, n: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._rows, self._plan = n, plan
        try:
            captured = self._pieces.get(size)
            if captured is None:  # the stand-in
                return self._hidden_states(size, plan, whole=False)
            for piece, cut in zip(captured.graphs, captured.cuts, strict=False):
                piece.replay()
                self._attend(cut)
            captured.graphs[-1].replay()
            return captured.hidden, captured.residual
        finally:
            self._plan = None
