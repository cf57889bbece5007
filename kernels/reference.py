"""Plain-PyTorch twins of every kernel in ``kernels/``: the CPU path and the test oracle.

Every function here has exactly the signature of its Triton launcher, so the engine can
swap one for the other behind ``engine/attention.py``.

Shapes used throughout (names follow vLLM):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:           [num_seqs, max_num_blocks_per_seq] int32, padded with any id
    seq_lens:               [num_seqs] int32, tokens in the context *including* the ones
                            whose queries are being computed this step
    query_start_loc:        [num_seqs + 1] int32, prefix sums of the query lengths

A slot is ``block_id * block_size + offset``; a slot of -1 is padding and is skipped.
Softmax is computed in float32 whatever the input dtype, and the output has the query's dtype.

A quantized cache (int8 / float8_e4m3fn values with a float16 scale per (slot, KV head) row,
keys Hadamard-transformed, ``kernels/kv_quant.py``) is quantized by ``store_kv`` and
de-quantized to float32 (keys transformed back) when the attention functions read it; the
query then keeps its own dtype (an int8 cache beside a bf16 model). Unquantized caches take
exactly the code paths they always did.

The decoder layer's elementwise ops (``rms_norm``, ``add_rms_norm_``, ``silu_mul``,
``rope_and_store_``) are written op by op as the engine's plain model evaluates them
(``engine/llama.py``, ``PagedAttention.rope_and_store``), so their Triton kernels can be held
to the same rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import kv_quant

__all__ = [
    "store_kv",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "add_rms_norm_",
    "silu_mul",
    "rope_and_store_",
    "quant_matmul",
    "dense_matmul",
]


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    key_offset: torch.Tensor | None = None,  # [num_kv_heads, head_dim] float32
) -> None:
    """Write each token's K/V row into its slot of the paged cache, in place.

    ``key_offset`` (a quantized cache only): subtracted from every key before it is
    quantized (``kernels/kv_quant.py``); attention over the cache is unchanged by it."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    if kv_quant.is_quantized(key_cache):
        _store_kv_quantized(key, value, key_cache, value_cache, slots, key_offset)
        return
    assert key_offset is None, "a key offset is for a quantized cache only"
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if int(slots.min()) < 0:  # padding rows present: drop them (rare; static-batch padding)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    # A [num_blocks, block_size, ...] tensor viewed as [num_slots, ...] is indexed by slot.
    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key)
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value)


def _store_kv_quantized(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # quantized values view (kernels/kv_quant.py)
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [num_tokens] int64, -1 = skip
    key_offset: torch.Tensor | None,  # [num_kv_heads, head_dim] float32
) -> None:
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    for cache, (q, scale) in (
        # Keys less their offset, Hadamard-transformed; values as they are.
        (key_cache, kv_quant.quantize_keys(key, key_cache.dtype, key_offset)),
        (value_cache, kv_quant.quantize(value, value_cache.dtype)),
    ):
        # Each row's values, then its scale, as head_dim + 2 bytes (the cache's layout).
        row = torch.cat((q.view(torch.uint8), scale[..., None].view(torch.uint8)), dim=-1)
        rows = kv_quant.cache_rows(cache).view(torch.uint8)
        rows.view(num_blocks * block_size, num_kv_heads, -1).index_copy_(0, slots, row)


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_num_blocks_per_seq]
    seq_len: int,
    keys: bool,  # a K cache (a quantized one holds Hadamard-transformed rows)
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]; float32 from a quantized cache
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    if kv_quant.is_quantized(cache):
        dequantize = kv_quant.dequantize_keys if keys else kv_quant.dequantize
        blocks = dequantize(cache[ids], kv_quant.cache_scales(cache)[ids])
    else:
        blocks = cache[ids]  # [nb, block_size, kvh, d]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to all ``seq_lens[i]`` cached tokens, or with
    ``sliding_window`` to the last that many of them (transformers' window: the query at
    position ``p`` sees keys ``p - sliding_window < k <= p``, itself included); with
    ``softcap``, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
    ``out`` (shaped like ``query``): written and returned instead of a new tensor.

    Vectorised over sequences: each cache is gathered with one ``index_select`` into a
    padded [num_seqs * num_kv_heads, max_len, head_dim] tensor and the padding is masked, so
    a decode step costs a handful of batched ops instead of a Python loop over sequences.
    """
    context = decode_context(
        block_tables, seq_lens, key_cache.shape[1], key_cache.shape[2], sliding_window
    )
    result = decode_over_context(query, key_cache, value_cache, context, scale, softcap)
    return result if out is None else out.copy_(result)


@dataclass(frozen=True, slots=True)
class DecodeContext:
    """Where each decoding sequence's context lives: the same for every layer of a step, so
    the engine computes it once per step and reuses it (``decode_over_context``)."""

    rows: torch.Tensor  # [num_seqs * num_kv_heads * max_len] int64, see decode_context
    bias: torch.Tensor  # [num_seqs, 1, max_len] float32: 0, or -inf on padding and
    # on positions before the sliding window
    max_len: int
    num_kv_heads: int


def decode_context(
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    block_size: int,
    num_kv_heads: int,
    sliding_window: int | None = None,
) -> DecodeContext:
    """Row indices into a cache viewed as ``[num_slots * num_kv_heads, head_dim]``, ordered
    (sequence, KV head, position), so that one gather yields each KV head's context as a
    contiguous [max_len, head_dim] matrix: the batched matmuls then read it in place, with no
    transposed copy and no GQA expansion of K/V to every query head."""
    num_seqs = block_tables.shape[0]
    device = block_tables.device
    max_len = int(seq_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    offsets = torch.arange(block_size, device=device)
    # slot of context position p of sequence i: block_tables[i, p // bs] * bs + p % bs;
    # padded positions read whatever the padding block ids point at, and are masked.
    slots = block_tables[:, :max_blocks, None].long() * block_size + offsets  # [n, nb, bs]
    slots = slots.view(num_seqs, -1)[:, :max_len]  # [n, max_len]
    heads = torch.arange(num_kv_heads, device=device)
    rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [n, kvh, max_len]
    pos = torch.arange(max_len, device=device)[None, :]
    padding = pos >= seq_lens[:, None]
    if sliding_window is not None:  # outside the window: masked like padding
        padding |= pos < seq_lens[:, None] - sliding_window
    bias = torch.zeros(num_seqs, 1, max_len, device=device)
    bias.masked_fill_(padding[:, None, :], float("-inf"))
    return DecodeContext(rows.reshape(-1), bias, max_len, num_kv_heads)


def decode_over_context(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    context: DecodeContext,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    kvh, max_len = context.num_kv_heads, context.max_len
    group = num_heads // kvh  # query head j reads KV head j // group

    def gather(cache: torch.Tensor, keys: bool) -> torch.Tensor:  # [num_seqs * kvh, max_len, d]
        if kv_quant.is_quantized(cache):
            raw = kv_quant.cache_rows(cache).reshape(-1, head_dim + kv_quant.SCALE_BYTES)
            picked = raw.index_select(0, context.rows)  # [rows, d + 2]
            scales = picked[:, head_dim:].view(kv_quant.SCALE_DTYPE).squeeze(-1)  # [rows]
            dequantize = kv_quant.dequantize_keys if keys else kv_quant.dequantize
            rows = dequantize(picked[:, :head_dim], scales)
            return rows.view(num_seqs * kvh, max_len, head_dim)
        rows = cache.view(-1, head_dim).index_select(0, context.rows)
        rows = rows.view(num_seqs * kvh, max_len, head_dim)
        return rows if rows.dtype == torch.float32 else rows.float()

    k, v = gather(key_cache, keys=True), gather(value_cache, keys=False)
    q = query if query.dtype == torch.float32 else query.float()
    # The group of query heads sharing a KV head is a [group, d] matrix against its [L, d].
    scores = torch.bmm(q.reshape(num_seqs * kvh, group, head_dim), k.transpose(1, 2))
    scores = scores.view(num_seqs, num_heads, max_len).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.add_(context.bias)
    probs = torch.softmax(scores, dim=-1).view(num_seqs * kvh, group, max_len)
    out = torch.bmm(probs, v).view(num_seqs, num_heads, head_dim)
    return out if out.dtype == query.dtype else out.to(query.dtype)


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """A chunk of query tokens per sequence, attending causally over its paged context.

    Sequence ``i`` owns queries ``query_start_loc[i]:query_start_loc[i+1]`` (``q_len`` of them);
    they are the *last* ``q_len`` tokens of its ``seq_lens[i]`` tokens of context, whose K/V
    (cached prefix and this chunk alike) are already in the cache::

        context:  |<------ cached prefix ------>|<--- this chunk (q_len) --->|
                  0                   seq_len - q_len                     seq_len

    Query ``j`` of the chunk sits at position ``seq_len - q_len + j`` and sees positions
    ``0 ..= seq_len - q_len + j``, or with ``sliding_window`` only the last
    ``sliding_window`` of those. A decode step is the case ``q_len == 1``. ``out`` (shaped
    like ``query``): written and returned instead of a new tensor; rows no sequence covers
    are left as they are.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(key_cache, block_tables[i], seq_len, keys=True)  # [ctx, kvh, d]
        k = k.float()
        v = _gather_context(value_cache, block_tables[i], seq_len, keys=False).float()
        q = query[q_start:q_end].float()  # [q_len, h, d]
        # [kvh, group, q_len, d] against [kvh, 1, ctx, d]
        q = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        k = k.permute(1, 0, 2).unsqueeze(1)
        v = v.permute(1, 0, 2).unsqueeze(1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [kvh, group, q_len, ctx]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [q_len, ctx]: the future
        if sliding_window is not None:  # and the past before the window
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [kvh, group, q_len, d]
        out[q_start:q_end] = (
            o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)
        )
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size], x's dtype
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """``weight * rms_normalised(x)``: statistics in float32, the normalised row cast back to
    the dtype before the weight multiplies it (transformers' ``LlamaRMSNorm``)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    residual: torch.Tensor,  # [num_tokens, hidden_size], updated in place
    weight: torch.Tensor,  # [hidden_size], x's dtype
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """``residual += x`` in place, then ``rms_norm(residual, weight, eps)``."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]
) -> torch.Tensor:  # [num_tokens, intermediate_size]
    """``silu(gate) * up`` of ``gate_up = [gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_store_(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim] (or [num_tokens, 1, head_dim]), qkv's dtype
    sin: torch.Tensor,  # [num_tokens, head_dim] (or [num_tokens, 1, head_dim]), qkv's dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    key_offset: torch.Tensor | None = None,  # [num_kv_heads, head_dim] float32 (store_kv)
) -> torch.Tensor:  # rotated queries [num_tokens, num_heads, head_dim], a view of qkv
    """Rotary embedding (Llama's rotate_half) on Q and K; rotated Q overwrites Q's part of
    ``qkv`` and is returned as a view, rotated K and the unchanged V go to their slots."""
    num_tokens, head_dim = qkv.shape[0], key_cache.shape[-1]
    half = head_dim // 2
    cos = cos.view(num_tokens, 1, head_dim)
    sin = sin.view(num_tokens, 1, head_dim)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_heads + num_kv_heads, head_dim
    )
    rotated = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    q.copy_(rotated[:, :num_heads])
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    store_kv(rotated[:, num_heads:], value, key_cache, value_cache, slot_mapping, key_offset)
    return q


def quant_matmul(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [in_features, out_features] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [out_features] float32: column n's weights are weight[:, n] * scale[n]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """``x @ (weight * scale) + bias`` for a per-output-channel quantized weight
    (``engine/quantization.py``): the products summed in float32 against the integer (or
    fp8) weights, then each column scaled once, as ``kernels/quant_matmul.py`` computes it.
    The plain-PyTorch path of a quantized matmul on any device; it upcasts the whole weight
    on every call, so it saves memory, not time."""
    y = (x.float() @ weight.float()) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dense_matmul(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [in_features, out_features], x's dtype
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """``x @ weight + bias`` with the products summed in float32 and the sum (bias
    included) rounded once to x's dtype, as ``kernels/quant_matmul.py``'s ``dense_matmul``
    computes it (and as the library's bf16/fp16 matmuls do, in another order)."""
    y = x.float() @ weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
