"""Tensor parallelism: a loaded model sharded over the ranks of a torch.distributed group.

``shard_model(model, group)`` transforms a built and loaded ``LlamaForCausalLM`` from
outside, as gpt-fast does, Megatron-style; the model definition (``engine/llama.py``) stays
plain math and knows nothing of ranks::

    embed_tokens   vocab-parallel: rank r holds rows [r*V/N, (r+1)*V/N), looks up the ids in
                   its range, zeros the rest, one all-reduce sums the ranks' rows
    qkv_proj       column-parallel: rank r holds its query heads and their KV heads
    attention      local: rank r's KV pool holds its KV heads only (num_kv_heads / N)
    o_proj         row-parallel: rank r's query heads' rows; one all-reduce
    gate_up_proj   column-parallel: rank r's slice of gate and of up
    down_proj      row-parallel: the same slice's rows; one all-reduce (bias added once, after)
    lm_head        vocab-parallel: rank r's columns; one all-gather gives every rank the logits

The norms, RoPE tables and residual stream are replicated. So each decoder layer costs two
all-reduces of ``[num_tokens, hidden]`` and a step one more for the embedding and one
all-gather of ``[num_samples, vocab]``.

Counts that do not divide by N are padded with zero weights, never refused (``TPLayout``,
engine/tp_layout.py, which also says what is refused):

- KV heads are padded to a multiple of N, and each padded KV head gets its group of padded
  query heads, so query head j still reads KV head j // group on every rank. A padded query
  head's q is zero and its V rows are zero, so its attention output is zero, and its o_proj
  rows are zero besides: it adds exactly nothing to the sum. SmolLM2-135M (9 heads, 3 KV
  heads) at N=2 runs 12 and 4: rank 0 heads 0-5 with KV heads 0-1, rank 1 heads 6-8 plus 3
  padding heads with KV head 2 plus one padding KV head.
- The intermediate size is padded with zero gate/up columns: silu(0) * 0 = 0, and the zero
  down_proj rows drop them again.
- The vocabulary is padded with zero embedding rows (no id reaches them) and zero head
  columns, which the gathered logits cut off before anyone samples.

Every rank builds the whole model on the host, loads it, and keeps its shard
(``shard_model`` copies the slices and frees the rest); on CUDA the shard then moves to the
rank's GPU, so a GPU only ever holds its shard.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.llama import DecoderLayer, Linear, LlamaForCausalLM
from engine.tp_layout import TPLayout as TPLayout
from engine.tp_layout import check_shardable as check_shardable

logger = logging.getLogger(__name__)


class RowParallelLinear(nn.Module):
    """A ``Linear`` whose input rows are split over the ranks: each multiplies its slice of
    the input by its slice of the weight's rows, and one all-reduce sums the partial outputs.
    The bias (replicated) is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [in / N, out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out]
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in / N] -> [tokens, out]
        y = x @ self.weight
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of ids ``[start, start + num_rows)``; other ids look up
    zeros, and one all-reduce gives every rank every id's row (a sum of one row and zeros:
    exact)."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V_padded / N, hidden]
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """The head's columns split over the ranks; one all-gather puts the logits side by side
    on every rank, and the vocabulary's padding columns are cut off."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, vocab_size: int, group: Any
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [hidden, V_padded / N]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group
        self.world_size = dist.get_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        local = x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` along dim 0."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _slice_heads(
    t: torch.Tensor, num: int, padded: int, head_dim: int, rank: int, world: int
) -> torch.Tensor:
    """Rank ``rank``'s heads of a tensor whose dim 0 is ``num`` heads of ``head_dim``, padded
    with zero heads to ``padded`` first."""
    per = padded // world
    full = _pad_rows(t, padded * head_dim)
    return full[rank * per * head_dim : (rank + 1) * per * head_dim]


def _slice(t: torch.Tensor, padded: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of dim 0, after zero padding dim 0 to ``padded``."""
    per = padded // world
    return _pad_rows(t, padded)[rank * per : (rank + 1) * per]


def _shard_qkv(
    t: torch.Tensor, layout: TPLayout, head_dim: int, rank: int
) -> torch.Tensor:  # dim 0 is qkv_proj's output: [q heads | k heads | v heads]
    h, kv, n = layout.num_heads * head_dim, layout.num_kv_heads * head_dim, layout.world_size
    q, k, v = t[:h], t[h : h + kv], t[h + kv :]
    return torch.cat(
        [
            _slice_heads(q, layout.num_heads, layout.padded_num_heads, head_dim, rank, n),
            _slice_heads(k, layout.num_kv_heads, layout.padded_num_kv_heads, head_dim, rank, n),
            _slice_heads(v, layout.num_kv_heads, layout.padded_num_kv_heads, head_dim, rank, n),
        ]
    )


def _shard_gate_up(t: torch.Tensor, layout: TPLayout, rank: int) -> torch.Tensor:
    inter, n = layout.intermediate_size, layout.world_size
    gate, up = t[:inter], t[inter:]
    padded = layout.padded_intermediate_size
    return torch.cat([_slice(gate, padded, rank, n), _slice(up, padded, rank, n)])


def _column_linear(
    linear: Linear,
    shard: Any,  # shard(tensor with the output dim first) -> its rank's rows
) -> Linear:
    """A ``Linear`` holding the rank's output columns of ``linear``."""
    w = shard(linear.weight.detach().t()).t().contiguous()  # [in, out / N]
    out = Linear(w.shape[0], w.shape[1], bias=linear.bias is not None)
    out.weight = nn.Parameter(w, requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(shard(linear.bias.detach()).contiguous(), requires_grad=False)
    return out


def shard_model(model: LlamaForCausalLM, group: Any) -> TPLayout:
    """Replace ``model``'s layers by this rank's shards in place (module docstring).

    Args:
        model: built and loaded, on the host; every rank passes the same weights.
        group: the tensor-parallel process group; this process's rank in it picks the shard.
    Returns:
        The layout: the padded counts, and the heads each rank holds (the KV pool is sized
        for ``num_local_kv_heads``).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    config = model.config
    layout = TPLayout.of(config, world)
    d = config.head_dim
    with torch.no_grad():
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.qkv_proj = _column_linear(
                layer.qkv_proj, lambda t: _shard_qkv(t, layout, d, rank)
            )
            o_w = _slice_heads(
                layer.o_proj.weight.detach(),
                layout.num_heads,
                layout.padded_num_heads,
                d,
                rank,
                world,
            )
            assert layer.o_proj.bias is None  # o_proj has no bias in any supported family
            layer.o_proj = RowParallelLinear(o_w.contiguous(), None, group)
            layer.gate_up_proj = _column_linear(
                layer.gate_up_proj, lambda t: _shard_gate_up(t, layout, rank)
            )
            down = layer.down_proj
            down_w = _slice(down.weight.detach(), layout.padded_intermediate_size, rank, world)
            layer.down_proj = RowParallelLinear(
                down_w.contiguous(), None if down.bias is None else down.bias.detach(), group
            )
            layer.num_heads = layout.num_local_heads
            layer.num_kv_heads = layout.num_local_kv_heads
            layer.q_size = layout.num_local_heads * d
            layer.kv_size = layout.num_local_kv_heads * d
        per_vocab = layout.local_vocab_size
        embed = _slice(model.embed_tokens.weight.detach(), layout.padded_vocab_size, rank, world)
        model.embed_tokens = VocabParallelEmbedding(embed.contiguous(), rank * per_vocab, group)
        head = model.lm_head
        head_w = _slice(head.weight.detach().t(), layout.padded_vocab_size, rank, world)
        head_b = None
        if head.bias is not None:
            head_b = _slice(head.bias.detach(), layout.padded_vocab_size, rank, world)
        model.lm_head = VocabParallelHead(head_w.t().contiguous(), head_b, config.vocab_size, group)
    return layout
