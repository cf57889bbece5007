"""Paged attention for the model, over one of three explicitly chosen backends.

- ``torch``: the plain-PyTorch reference in ``kernels/reference.py`` (any device and dtype).
- ``cpu``: the C++ kernels of ``kernels.cpu`` (float32 on CPU): every query token, decode or
  prefill, is one row of the decode kernel with its own context length (causal attention is
  exactly that), reading K/V in place through the block tables; the cache write uses the
  reference (the fused C++ stack writes the cache itself, ``engine/backends/cpu.py``).
- ``triton``: the Triton kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``).

``auto`` picks Triton on CUDA, ``cpu`` for float32 on CPU when the C++ kernels build, and
the reference otherwise; a family whose attention soft-caps its scores (Gemma 2) takes the
reference everywhere. With ``cpu``, a Llama-layer model runs on the fused C++ stack
(``engine/backends/cpu.py``); another family runs its own forward with the C++ attention
kernel (sliding windows included). The choice is a constructor argument, never a global switch, and
Triton is imported only when it is chosen.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig, ModelError
from engine.input_batch import AttentionMetadata
from engine.rope import apply_rope
from kernels import cpu as cpu_kernels
from kernels.reference import DecodeContext, decode_context, decode_over_context

logger = logging.getLogger(__name__)

# KV cache dtypes the C++ CPU kernels read (kernels/cpu/csrc/paged_attention.cpp).
CPU_KV_CACHE_DTYPES = ("auto", "int8", "fp8")


class UnsupportedBackendError(ModelError, ValueError):
    """An ``--attention-backend`` this device, dtype or model cannot run; the command line
    reports it as one line."""


def triton_interprets() -> bool:
    """Whether the Triton kernels run under Triton's interpreter, the only way they take CPU
    tensors. Triton decides when a kernel is defined, i.e. when its ``kernels.<name>`` module
    is first imported, from ``TRITON_INTERPRET`` at that moment: once the attention kernels
    are imported their kind answers, before that the variable (read as Triton reads it)."""
    imported = sys.modules.get("kernels.paged_attention")
    if imported is not None:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(imported._paged_attention_decode_kernel, InterpretedFunction)
    import triton

    return bool(triton.knobs.runtime.interpret)


def resolve_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    model: ModelConfig,
    kv_cache_dtype: str = "auto",
) -> str:
    """The backend ``name`` ("auto" resolved) for this device, dtype, model and KV cache
    dtype (``KVPoolConfig.cache_dtype``: the C++ kernels read float32, int8 and fp8 caches,
    ``CPU_KV_CACHE_DTYPES``)."""
    fits_cpu = (
        device.type == "cpu"
        and dtype == torch.float32
        and kv_cache_dtype in CPU_KV_CACHE_DTYPES
        and cpu_kernels.supports(
            head_dim=model.head_dim,
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
        )
    )
    # The C++ attention kernel takes a sliding window but no soft-capped scores, as the
    # Triton kernels; the fused C++ stack (engine/backends/cpu.py) computes Llama's layer
    # only, so another family runs its own forward around the C++ attention.
    family_fits_kernels = model.attn_logit_softcap is None
    if name == "auto":
        if not family_fits_kernels:
            logger.info(
                "%s soft-caps attention scores, which the C++ and Triton kernels do not: "
                "attention runs on the torch reference",
                model.model_type,
            )
            return "torch"
        if device.type == "cuda":
            return "triton"
        backend = "cpu" if fits_cpu and cpu_kernels.load() is not None else "torch"
        if backend == "cpu" and not model.is_plain_llama:
            logger.info(
                "the fused C++ stack computes Llama's layer; %s differs (%s): its own "
                "forward runs in torch around the C++ attention kernel",
                model.model_type,
                model.family_differences(),
            )
        return backend
    if name in ("cpu", "triton") and not family_fits_kernels:
        raise UnsupportedBackendError(
            f"the {name} attention backend has no attention soft-capping, which "
            f"{model.model_type} uses: use --attention-backend torch"
        )
    if name == "triton" and device.type == "cpu" and not triton_interprets():
        # Compiled kernels take CUDA tensors only: refused here, before the model loads, not
        # at the first step.
        raise UnsupportedBackendError(
            "the triton attention backend runs on CUDA, or on the CPU only under Triton's "
            "interpreter (TRITON_INTERPRET=1, slow; for tests): use --device cuda, or "
            "--attention-backend auto, cpu or torch"
        )
    if name == "cpu":
        if not fits_cpu:
            raise UnsupportedBackendError(
                "the cpu attention backend needs float32 on the CPU, a KV cache dtype of "
                f"{', '.join(CPU_KV_CACHE_DTYPES)}, head_dim 32/64/96/128/256 and hidden and "
                "intermediate sizes that are multiples of 16"
            )
        if cpu_kernels.load() is None:
            raise RuntimeError("the C++ CPU kernels could not be built (see the log)")
    return name


@dataclass(slots=True)
class AttentionPlan:
    """What every layer of one step needs for attention, computed once per step.

    ``decode_context`` (torch backend only) holds the decode rows' gathered slot indices
    and padding mask, which are the same for all layers.

    ``row_block_tables`` / ``row_seq_lens`` (cpu backend only): per query token, its
    sequence's block table and the context it sees (its position + 1), so that one decode
    kernel call covers a whole step, prefill chunks included.

    A mixed step (decodes and prefill chunks) attends in one of two ways:

    - ``one_launch`` (triton backend, where the decode kernel would not split its contexts):
      the prefill kernel over every row, a decode being a chunk of one query. Per layer that
      is one launch instead of the decode kernel, the prefill kernel and the copies that
      join their outputs; and its grid depends only on the token and sequence counts, so
      such a step replays one CUDA graph of the whole forward (engine/prefill_graphs.py).
      Where the decode kernel would split (few decodes, long contexts), its split-K reads a
      decode's context with more programs than the prefill kernel's one per KV head.
    - otherwise the decode kernel over the first ``num_decodes`` rows and the prefill kernel
      over the rest, whose query start locations (``prefill_query_start_loc``, counted from
      the first prefill row) are computed once per step here.
    """

    meta: AttentionMetadata
    decode_context: DecodeContext | None = None
    sliding_decode_context: DecodeContext | None = None  # the same, for sliding layers
    row_block_tables: torch.Tensor | None = None  # [num_tokens, max_num_blocks] int32
    row_seq_lens: torch.Tensor | None = None  # [num_tokens] int32
    one_launch: bool = False
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefills + 1] int32


class PagedAttention:
    """Writes a step's new K/V into the cache (rotating K on the way) and attends over it
    through block tables."""

    def __init__(
        self,
        backend: str,
        scale: float,
        *,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """Args:
        backend: "torch", "cpu" or "triton" (already resolved from "auto").
        scale: softmax scale, usually head_dim ** -0.5.
        softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2); torch only.
        (The cpu and triton kernels take ``sliding_window`` as a keyword argument.)
        sliding_window: the keys a query of a sliding layer sees (itself included); a
            layer asks for it with ``sliding=True``.
        """
        self.backend = backend
        self.scale = scale
        self.softcap = softcap
        self.sliding_window = sliding_window
        assert softcap is None or backend == "torch", "soft-capping runs on the reference"
        self._store_kv: Callable[..., None]
        self._decode: Callable[..., torch.Tensor]
        self._prefill: Callable[..., torch.Tensor]
        # RoPE on Q and K fused with the K/V store: one Triton kernel, bitwise the reference.
        self._rope_and_store_: Callable[..., torch.Tensor] | None = None
        if backend == "triton":
            from kernels.paged_attention import paged_attention_decode
            from kernels.prefill_attention import paged_attention_prefill
            from kernels.rope_and_store import rope_and_store_
            from kernels.store_kv import store_kv

            self._rope_and_store_ = rope_and_store_
        elif backend == "torch":
            from kernels.reference import (
                paged_attention_decode,
                paged_attention_prefill,
                store_kv,
            )
        elif backend == "cpu":
            from kernels.reference import store_kv

            paged_attention_decode = cpu_kernels.load().paged_attention_decode
            # plan() gives every cpu step a per-token plan: prefill chunks go through the
            # decode kernel, and no prefill kernel is ever called.
            paged_attention_prefill = _no_prefill_kernel
        else:
            raise ValueError(f"unknown attention backend {backend!r}")
        self._store_kv = store_kv
        self._decode = paged_attention_decode
        self._prefill = paged_attention_prefill
        # Quantized key cache (its data_ptr) -> its calibrated key offset; set_key_offsets.
        self._key_offsets: dict[int, torch.Tensor] = {}

    def set_key_offsets(
        self, key_caches: list[torch.Tensor], key_offsets: list[torch.Tensor] | None
    ) -> None:
        """Subtract ``key_offsets[i]`` ([num_kv_heads, head_dim] float32) from every key
        stored into ``key_caches[i]`` (kvpool's quantized caches and their calibrated
        offsets, ``KVCacheStorage.key_offsets``; ``kernels/kv_quant.py``); None: no offsets.
        Attention needs no counterpart: one vector less on every key of a head moves none
        of its softmax weights. Caches not named here (a draft model's, a profiling run's)
        store their keys as they are."""
        if key_offsets is None:
            self._key_offsets = {}
            return
        self._key_offsets = {
            cache.data_ptr(): offset for cache, offset in zip(key_caches, key_offsets, strict=True)
        }

    def key_offset(self, key_cache: torch.Tensor) -> torch.Tensor | None:
        """The offset the stores into ``key_cache`` subtract (``set_key_offsets``), or None."""
        return self._key_offsets.get(key_cache.data_ptr()) if self._key_offsets else None

    def store(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        self._store_kv(key, value, key_cache, value_cache, slot_mapping, self.key_offset(key_cache))

    def rope_and_store(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:  # rotated queries [num_tokens, num_heads, head_dim]
        """Rotate Q and K by their positions and store K and V at ``slot_mapping``."""
        cos, sin = rope
        if self._rope_and_store_ is not None:
            return self._rope_and_store_(
                qkv,
                cos,
                sin,
                key_cache,
                value_cache,
                slot_mapping,
                num_heads,
                num_kv_heads,
                self.key_offset(key_cache),
            )
        t, head_dim = qkv.shape[0], key_cache.shape[-1]
        qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], -1)
        # Q and K heads rotate together: one set of elementwise ops instead of two.
        qk = apply_rope(qk.view(t, num_heads + num_kv_heads, head_dim), cos, sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        self.store(k, v.view(t, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping)
        return q

    def compile_variants(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_heads: int,
        query_dtype: torch.dtype,
    ) -> int:
        """Compile the decode kernel's variants before traffic meets them (triton backend;
        the others compile nothing). Returns the number of kernel calls made."""
        if self.backend != "triton":
            return 0
        from kernels.paged_attention import compile_variants

        return compile_variants(key_cache, value_cache, num_heads, self.scale, query_dtype)

    def plan(self, meta: AttentionMetadata, key_cache: torch.Tensor) -> AttentionPlan:
        """Per-step work shared by all layers (called once per forward); ``key_cache``: a
        layer's, [num_blocks, block_size, num_kv_heads, head_dim] (every layer's is alike)."""
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        nd = meta.num_decodes
        if self.backend == "cpu":
            return per_token_plan(meta)
        mixed = 0 < nd < meta.seq_lens.shape[0]
        if self.backend == "triton" and mixed:
            from kernels.paged_attention import choose_num_splits

            width = meta.block_tables.shape[1] * block_size
            device = meta.seq_lens.device
            splits = choose_num_splits(
                nd, num_kv_heads, width, device, head_dim=head_dim, kv_dtype=key_cache.dtype
            )
            if splits == 1:
                return AttentionPlan(meta, one_launch=True)
        prefill_starts = meta.query_start_loc[nd:] - nd if mixed else None
        if self.backend != "torch" or nd == 0:
            return AttentionPlan(meta, prefill_query_start_loc=prefill_starts)
        tables, lens = meta.block_tables[:nd], meta.seq_lens[:nd]
        return AttentionPlan(
            meta,
            decode_context(tables, lens, block_size, num_kv_heads),
            None
            if self.sliding_window is None
            else decode_context(tables, lens, block_size, num_kv_heads, self.sliding_window),
            prefill_query_start_loc=prefill_starts,
        )

    def _attend_decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        window: int | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        context = plan.decode_context if window is None else plan.sliding_decode_context
        if context is not None:
            result = decode_over_context(
                query, key_cache, value_cache, context, self.scale, self.softcap
            )
            return result if out is None else out.copy_(result)
        nd = plan.meta.num_decodes
        meta = plan.meta
        return self._decode(
            query,
            key_cache,
            value_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            self.scale,
            **self._extras(window, out),
        )

    def _extras(self, window: int | None, out: torch.Tensor | None = None) -> dict[str, object]:
        """The keyword arguments only some calls need: a kernel without them keeps its
        plain signature (the cpu backend's C++ decode kernel takes no ``out``; it is never
        given one, see ``__call__``)."""
        extras: dict[str, object] = {}
        if window is not None:
            extras["sliding_window"] = window
        if self.softcap is not None:
            extras["softcap"] = self.softcap
        if out is not None:
            extras["out"] = out
        return extras

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        plan: AttentionPlan,
        *,
        sliding: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``sliding``: the layer attends through the sliding window (``sliding_window``).
        ``out`` (shaped like ``query``): written and returned instead of a new tensor."""
        meta = plan.meta
        window = self.sliding_window if sliding else None
        if plan.row_seq_lens is not None:
            result = self._decode(
                query,
                key_cache,
                value_cache,
                plan.row_block_tables,
                plan.row_seq_lens,
                self.scale,
                **self._extras(window),
            )
            return result if out is None else out.copy_(result)
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd == num_seqs:
            return self._attend_decode(query, key_cache, value_cache, plan, window, out)
        if nd == 0 or plan.one_launch:  # see AttentionPlan
            return self._prefill(
                query,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                self.scale,
                **self._extras(window, out),
            )
        # Mixed step: decodes are the first nd tokens (see engine/input_batch.py).
        assert plan.prefill_query_start_loc is not None
        if out is None:
            out = torch.empty_like(query)
        self._attend_decode(query[:nd], key_cache, value_cache, plan, window, out[:nd])
        self._prefill(
            query[nd:],
            key_cache,
            value_cache,
            meta.block_tables[nd:],
            plan.prefill_query_start_loc,
            meta.seq_lens[nd:],
            self.scale,
            **self._extras(window, out[nd:]),
        )
        return out


def _no_prefill_kernel(*args: object) -> torch.Tensor:
    raise AssertionError("the cpu backend attends per token (see per_token_plan)")


def per_token_plan(meta: AttentionMetadata) -> AttentionPlan:
    """Query token ``j`` of a sequence's ``q_len`` this step sits at position
    ``seq_len - q_len + j`` and sees that many tokens plus itself (see
    ``kernels.reference.paged_attention_prefill``)."""
    num_seqs = meta.seq_lens.shape[0]
    if meta.num_decodes == num_seqs:  # one token per sequence already
        return AttentionPlan(meta, row_block_tables=meta.block_tables, row_seq_lens=meta.seq_lens)
    q_lens = meta.query_start_loc.diff()
    num_rows = int(meta.query_start_loc[-1])
    row = torch.arange(num_rows, device=q_lens.device, dtype=meta.query_start_loc.dtype)
    # The sequence of each row: how many sequences end at or before it. (Not
    # repeat_interleave, whose CPU kernel wakes the thread pool and took tens of ms per
    # call on a busy 2-core machine: every speculative-decoding step comes here.)
    seq_of_row = torch.searchsorted(meta.query_start_loc[1:], row, right=True)
    first = meta.query_start_loc[seq_of_row]
    lens = meta.seq_lens[seq_of_row] - q_lens[seq_of_row] + 1 + (row - first)
    return AttentionPlan(
        meta,
        row_block_tables=meta.block_tables[seq_of_row],
        row_seq_lens=lens.to(torch.int32),
    )
