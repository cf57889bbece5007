"""Several GPUs: what tensor parallelism puts on each, what its all-reduces cost, how many
GPUs a model and a workload need, and the KV cache a batch needs per KV dtype.

Tensor parallelism over N GPUs (Megatron-style, as ``--tensor-parallel-size`` shards the
model): q/k/v and gate/up are split by columns, o_proj and down_proj by rows, each followed
by one all-reduce of the hidden state; the embedding and the LM head are split over the
vocabulary and the logits gathered; norms are replicated. Every count N does not divide is
padded with zero weights exactly as the engine pads it (``engine.tp_layout.TPLayout``: KV
heads to a multiple of N, so one per GPU when N > H_kv, query heads to the padded KV heads
times the group size, the intermediate size and the vocabulary to multiples of N), and the
per-GPU figures count the padding: a plan and a running group hold the same shapes. Only a
model no N can shard is refused (``engine.tp_layout.shardable_problem``).

Symbols as in :mod:`planner.arithmetic`, plus N (GPUs), B_a (bytes per activation
element), BW_link (one direction of a GPU's link, :class:`planner.devices.Link`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import planner.arithmetic as ar
from engine.config import ModelConfig
from engine.tp_layout import TPLayout, shardable_problem
from kvpool.kv_dtype import kv_bytes_per_token as kvpool_bytes_per_token
from planner.devices import Device, Link
from planner.dtypes import canonical_dtype, dtype_bytes

GIB = 1024**3
DEFAULT_KV_TABLE_BATCHES = (1, 8, 16, 32, 64, 128, 256)
DEFAULT_MAX_GPUS = 64

# A KV dtype's bytes per cached token of a model: (config, dtype) -> bytes.
KVBytesPerToken = Callable[[ModelConfig, str], float]


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> float:
    """k = 2 * L * H_kv * d * B_kv for ``kv_dtype`` (``auto`` is not resolved here), as the
    server's pool stores it: int8/fp8 add a float16 scale per token and KV head
    (``kvpool/kv_dtype.py``). Another layout can supply a function of the same signature to
    :func:`kv_cache_table`.
    """
    return kvpool_bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, dtype_bytes(kv_dtype)
    )


# ---------------------------------------------------------------------------- KV table


def kv_cache_bytes(batch: int, context: int, kv_bytes_token: float) -> float:
    """KV of ``batch`` sequences of ``context`` tokens each: b * c * k.

    Llama 3 8B (k = 131,072 bytes in bf16) at 8,192 tokens: 32 sequences need
    32 * 8192 * 131072 = 34,359,738,368 bytes = 32.0 GiB.
    """
    return batch * context * kv_bytes_token


@dataclass(frozen=True, slots=True)
class KVTable:
    """KV bytes by batch size (rows) and KV dtype (columns) at one context length.

    Attributes:
        context: tokens per sequence.
        dtypes: column labels, e.g. ``("bf16", "fp8", "int8")``.
        bytes_per_token: k of each column, whole model (all GPUs together).
        batches: the row batch sizes.
        bytes: ``bytes[row][column]``, all GPUs together.
        tensor_parallel_size: N; per GPU is ``bytes * ceil(H_kv / N) / H_kv`` (``bytes / N``
            when N divides H_kv; more where padded KV heads are stored too).
        per_gpu_bytes: ``per_gpu_bytes[row][column]`` on one of N GPUs.
    """

    context: int
    dtypes: tuple[str, ...]
    bytes_per_token: tuple[float, ...]
    batches: tuple[int, ...]
    bytes: tuple[tuple[float, ...], ...]
    tensor_parallel_size: int
    per_gpu_bytes: tuple[tuple[float, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_cache_table(
    cfg: ModelConfig,
    context: int,
    dtypes: Sequence[str],
    batches: Iterable[int] = DEFAULT_KV_TABLE_BATCHES,
    *,
    tensor_parallel_size: int = 1,
    bytes_per_token: KVBytesPerToken = kv_bytes_per_token,
) -> KVTable:
    """The KV a batch of sequences needs at ``context`` tokens, per KV dtype.

    ``bytes_per_token`` gives k for a dtype; pass the KV pool's own function to count what
    a quantized layout stores besides the values.
    """
    if context < 1:
        raise ValueError(f"context must be at least 1, got {context}")
    cols = tuple(dict.fromkeys(canonical_dtype(d) for d in dtypes))
    rows = tuple(batches)
    if not rows or min(rows) < 1:
        raise ValueError(f"batch sizes must be at least 1, got {rows}")
    k = tuple(bytes_per_token(cfg, d) for d in cols)
    share = kv_heads_per_gpu(cfg.num_kv_heads, tensor_parallel_size) / cfg.num_kv_heads
    table = tuple(tuple(kv_cache_bytes(b, context, kd) for kd in k) for b in rows)
    per_gpu = tuple(tuple(v * share for v in row) for row in table)
    return KVTable(context, cols, k, rows, table, tensor_parallel_size, per_gpu)


# ---------------------------------------------------------------------------- TP shards


def tp_size_problem(cfg: ModelConfig, n: int) -> str | None:
    """Why ``n`` GPUs cannot shard ``cfg``, or None if they can.

    Counts that ``n`` does not divide are padded (``tp_padding``), never a problem; what is
    left is a size below 1 and the engine's own refusals, which hold at every N > 1 (one GPU
    runs the model unsharded).
    """
    if n < 1:
        return f"the tensor-parallel size must be at least 1, got {n}"
    return shardable_problem(cfg) if n > 1 else None


def tp_padding(cfg: ModelConfig, n: int) -> str | None:
    """What ``n`` GPUs pad (``"query heads 64 -> 72, ..."``), or None when N divides every
    count; as the engine's start-up log says it."""
    return ", ".join(TPLayout.of(cfg, n).padding()) or None


def kv_heads_per_gpu(num_kv_heads: int, n: int) -> int:
    """H_kv' = ceil(H_kv / N): the KV heads padded to a multiple of N, over N GPUs (one each
    when N > H_kv; the padding heads' KV is stored like any other)."""
    return -(-num_kv_heads // n)


def params_per_gpu(cfg: ModelConfig, n: int) -> int:
    """Parameters one of N GPUs holds, padding included.

    P_gpu = L * (2*h*H'*d + 2*h*H_kv'*d + 3*h*i' + 2*h + biases) + V'*h*(1 or 2) + h

    with the per-GPU counts H_kv' = ceil(H_kv/N), H' = H_kv' * H/H_kv, i' = ceil(i/N) and
    V' = ceil(V/N) (``TPLayout``); norms (2*h per layer and the final h) are replicated, as
    are row-parallel biases. Llama 2 70B on 4 GPUs (nothing padded): 17,245,151,232 (of
    68,976,648,192); on 3, where 64 heads pad to 72, 8 KV heads to 9, 28,672 to 28,674 and
    32,000 to 32,001: 23,497,728,000.
    """
    layout = TPLayout.of(cfg, n)
    h, d = cfg.hidden_size, cfg.head_dim
    i = layout.local_intermediate_size
    q = layout.num_local_heads * d
    kv = layout.num_local_kv_heads * d
    attention = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if cfg.attention_bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if cfg.mlp_bias else 0)
    # A mixture's experts are not sharded (the engine refuses N > 1 for one: tp_size_problem),
    # so they appear only at N = 1, whole, as in ar.param_count.
    mlps = ar.mlp_params(cfg, mlp)
    embedding = layout.local_vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * (attention + 2 * h) + mlps + embedding + h


def allreduce_bytes(message_bytes: float, n: int) -> float:
    """Bytes each GPU sends (and receives) in a ring all-reduce of S bytes: 2 (N-1)/N * S.

    A reduce-scatter and an all-gather, each moving (N-1)/N of the message; 0 for N = 1.
    """
    return 2.0 * (n - 1) / n * message_bytes


def allreduce_bytes_per_token(cfg: ModelConfig, n: int, activation_bytes: float) -> float:
    """All-reduce bytes each GPU sends per token through the decoder: 2 L * 2 (N-1)/N * h * B_a.

    Two all-reduces of the hidden state per layer (after o_proj and after down_proj).
    Llama 2 70B in bf16 on 4 GPUs: 2 * 80 * 1.5 * 8192 * 2 = 3,932,160 bytes.
    """
    message = cfg.hidden_size * activation_bytes
    return 2 * cfg.num_layers * allreduce_bytes(message, n)


def logits_gather_bytes(cfg: ModelConfig, n: int, activation_bytes: float) -> float:
    """Bytes rank 0 receives per sampled token to gather the vocab-parallel logits:
    (N-1) * ceil(V/N) * B_a."""
    return (n - 1) * math.ceil(cfg.vocab_size / n) * activation_bytes


@dataclass(frozen=True, slots=True)
class TPPlan:
    """What N GPUs each hold and move for one model, dtypes and workload.

    Every size is per GPU except where named; times are lower bounds (bandwidth only: the
    all-reduce count shows what a per-call latency adds).
    """

    tensor_parallel_size: int
    problem: str | None  # why N cannot shard this model, or None
    padding: str | None  # what N pads with zero weights, or None
    params_per_gpu: int
    weight_bytes_per_gpu: float
    kv_heads_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    workload_tokens: int  # tokens the batch holds: batch * tokens per sequence
    kv_bytes_per_gpu: float  # of the workload
    memory_bytes_per_gpu: float
    fits: bool
    kv_tokens_per_gpu: int  # tokens of KV the memory left by the weights holds
    link: str
    link_bandwidth: float
    allreduces_per_step: int  # 2 per layer
    allreduce_bytes_per_token: float
    allreduce_time_per_token_s: float
    logits_gather_bytes_per_token: float
    decode_batch: int
    # W_gpu / BW: every GPU streams its shard at once (a mixture: the experts a step runs)
    decode_step_weight_time_s: float
    decode_step_allreduce_time_s: float  # b tokens' all-reduces at BW_link

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_tp(
    cfg: ModelConfig,
    device: Device,
    link: Link,
    n: int,
    *,
    weight_dtype: str,
    kv_dtype: str,
    activation_dtype: str,
    batch: int,
    tokens_per_sequence: int,
) -> TPPlan:
    """Per-GPU weights and KV, and all-reduce traffic, for ``n`` GPUs of ``device``."""
    if n < 1:
        raise ValueError(f"the tensor-parallel size must be at least 1, got {n}")
    problem = tp_size_problem(cfg, n)
    p_gpu = params_per_gpu(cfg, n)
    w_gpu = ar.weight_bytes(p_gpu, dtype_bytes(weight_dtype))
    heads = kv_heads_per_gpu(cfg.num_kv_heads, n)
    k_gpu = kvpool_bytes_per_token(
        cfg.num_layers, heads, cfg.head_dim, kv_dtype, dtype_bytes(kv_dtype)
    )
    tokens = batch * tokens_per_sequence
    kv_gpu = tokens * k_gpu
    b_act = dtype_bytes(activation_dtype)
    ar_token = allreduce_bytes_per_token(cfg, n, b_act)
    ar_time = ar_token / link.bandwidth
    # A mixture's step reads only the experts its batch runs (ar.unread_expert_params).
    w_read = w_gpu - ar.weight_bytes(ar.unread_expert_params(cfg, batch), dtype_bytes(weight_dtype))
    return TPPlan(
        tensor_parallel_size=n,
        problem=problem,
        padding=tp_padding(cfg, n),
        params_per_gpu=p_gpu,
        weight_bytes_per_gpu=w_gpu,
        kv_heads_per_gpu=heads,
        kv_bytes_per_token_per_gpu=k_gpu,
        workload_tokens=tokens,
        kv_bytes_per_gpu=kv_gpu,
        memory_bytes_per_gpu=device.memory_bytes,
        fits=problem is None and w_gpu + kv_gpu <= device.memory_bytes,
        kv_tokens_per_gpu=ar.kv_capacity_tokens(device.memory_bytes, w_gpu, k_gpu),
        link=link.name,
        link_bandwidth=link.bandwidth,
        allreduces_per_step=2 * cfg.num_layers if n > 1 else 0,
        allreduce_bytes_per_token=ar_token,
        allreduce_time_per_token_s=ar_time,
        logits_gather_bytes_per_token=logits_gather_bytes(cfg, n, b_act),
        decode_batch=batch,
        decode_step_weight_time_s=ar.memory_time_s(w_read, device.memory_bandwidth),
        decode_step_allreduce_time_s=batch * ar_time,
    )


def fewest_gpus(
    cfg: ModelConfig,
    device: Device,
    link: Link,
    *,
    weight_dtype: str,
    kv_dtype: str,
    activation_dtype: str,
    batch: int,
    tokens_per_sequence: int,
    max_gpus: int = DEFAULT_MAX_GPUS,
) -> TPPlan | None:
    """The smallest N whose GPUs each hold their weight shard and their share of the
    workload's KV (``batch`` sequences of ``tokens_per_sequence``), or None up to
    ``max_gpus``.

    Llama 2 70B in bf16 (138 GB of weights) on A100-40GB: 1 and 2 GPUs are too small
    (2 x 69 GB), 3 pad the 64 heads to 72 and hold 47 GB each, 4 hold 34.5 GB each: 4.
    """
    for n in range(1, max_gpus + 1):
        tp = plan_tp(
            cfg,
            device,
            link,
            n,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
            activation_dtype=activation_dtype,
            batch=batch,
            tokens_per_sequence=tokens_per_sequence,
        )
        if tp.fits:
            return tp
    return None


def kv_table_dtypes(default_kv_dtype: str) -> tuple[str, ...]:
    """The table's columns: the plan's KV dtype (what ``auto`` resolves to), fp8, int8."""
    return tuple(dict.fromkeys((canonical_dtype(default_kv_dtype), "fp8", "int8")))


def gib(num_bytes: float) -> float:
    return num_bytes / GIB
