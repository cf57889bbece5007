"""The transformer-inference arithmetic, as pure functions of plain numbers.

Each function's docstring holds its formula. Symbols used throughout:

    P    parameters             B_w  bytes per weight       W = P * B_w   weight bytes
    L    layers                 H    query heads            H_kv  KV heads      d  head dim
    B_kv bytes per KV element   k    KV bytes per token     c    tokens attended (context)
    b    batch (sequences decoding together)                n    prompt tokens
    BW   memory bandwidth, bytes/s                          F    peak FLOP/s
    R = F / BW   the device's ops:byte ratio

Units are SI: bytes, seconds, FLOP/s. Every time here is a *lower bound*: the roofline
``max(bytes / BW, FLOPs / F)`` with perfect overlap of memory and compute.
"""

from __future__ import annotations

import math

from engine.config import ModelConfig

# --------------------------------------------------------------------------- model size


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family decoder, tied embeddings counted once.

    P = L * (H*d*h + 2*H_kv*d*h + H*d*h     # q, k, v, o projections
             + 3*h*i                         # gate, up, down
             + 2*h)                          # two RMSNorm weights
        + V*h * (1 if tied else 2)           # embedding (+ untied LM head)
        + h                                  # final norm
        (+ (H + 2*H_kv)*d per layer for q/k/v biases, Qwen2)

    A mixture-of-experts layer holds E experts of intermediate size i_e and a router instead
    of the MLP: E*3*h*i_e + h*E (Mixtral 8x7B: 46.7e9 in all).

    h = hidden size, i = intermediate size, V = vocabulary. Llama 2 7B: 6,738,415,616.
    """
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attention = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if cfg.attention_bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if cfg.mlp_bias else 0)
    embedding = v * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * (attention + 2 * h) + mlp_params(cfg, mlp) + embedding + h


def mlp_params(cfg: ModelConfig, dense_mlp: int) -> int:
    """Every layer's MLP parameters: ``dense_mlp`` for a dense layer, E*(3*h*i_e + h) (the
    experts and the router) for a mixture-of-experts one."""
    moe = cfg.num_experts * (cfg.expert_params + cfg.hidden_size)
    return sum(moe if is_moe else dense_mlp for is_moe in cfg.layer_is_moe())


def streamed_param_count(cfg: ModelConfig) -> int:
    """Parameters a forward step may read and multiply: P minus an untied input embedding.

    P_s = P - V*h   if the embeddings are untied, else P

    The input embedding is a gather of one row per token, not a matmul, so a decode step
    reads b rows of it, not the table. A tied table is read in full as the LM head.
    Llama 2 7B: 6.74e9 - 0.13e9 = 6.61e9. A mixture of experts reads only the experts its
    tokens run (``unread_expert_params``).
    """
    untied_input = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return param_count(cfg) - untied_input


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token multiplies through: P_s with each mixture layer's E experts cut
    to the k it routes to.

    P_a = P_s - L_moe * (E - k) * 3*h*i_e

    A dense model's is P_s. Mixtral 8x7B: 12.7e9 (its "12.9B active" counts the input
    embedding too); Qwen3-30B-A3B: 3.0e9 ("3.3B").
    """
    num_moe_layers = sum(cfg.layer_is_moe())
    idle = cfg.num_experts - cfg.num_experts_per_tok
    return streamed_param_count(cfg) - num_moe_layers * idle * cfg.expert_params


def experts_run(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Expected distinct experts a mixture layer runs for n tokens that each route to k of E
    uniformly (no expert twice for one token, so each misses a given expert with probability
    1 - k/E):

        E_run(n) = E * (1 - (1 - k/E)^n)

    One token: k; n -> inf: E. Routing that favours some experts runs fewer. Mixtral (E = 8,
    k = 2) at 4 tokens: 5.47 of 8."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** max(num_tokens, 0.0))


def unread_expert_params(cfg: ModelConfig, num_tokens: float) -> float:
    """Expert parameters a step of n tokens leaves unread: L_moe * (E - E_run(n)) * 3*h*i_e
    (0 for a dense model). A step reads P_s minus these."""
    num_moe_layers = sum(cfg.layer_is_moe())
    if not num_moe_layers:
        return 0.0
    run = experts_run(cfg.num_experts, cfg.num_experts_per_tok, num_tokens)
    return num_moe_layers * (cfg.num_experts - run) * cfg.expert_params


def weight_bytes(num_params: float, bytes_per_param: float) -> float:
    """W = P * B_w. The guide's Llama 2 7B in fp16: 2 * 7e9 = 14e9 bytes."""
    return num_params * bytes_per_param


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float
) -> float:
    """k = 2 * L * H_kv * d * B_kv: one K and one V vector per KV head per layer.

    Counting KV heads (not query heads) handles GQA/MQA. Llama 2 7B fp16:
    2 * 32 * 32 * 128 * 2 = 524,288 bytes; Llama 3 8B (8 KV heads) fp16: 131,072.
    """
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


# ------------------------------------------------------------------ device ratios, intensity


def ops_per_byte(peak_flops: float, bandwidth: float) -> float:
    """R = F / BW: FLOPs the device can do per byte it loads. A10 fp16: 125e12 / 600e9 = 208.3.

    A kernel whose arithmetic intensity is below R is memory-bound on that device.
    """
    return peak_flops / bandwidth


def bound_by(intensity: float, device_ops_per_byte: float) -> str:
    """``"memory"`` if intensity < R (bandwidth limits), else ``"compute"``."""
    return "memory" if intensity < device_ops_per_byte else "compute"


def attention_intensity(seq_len: int, head_dim: int, bytes_per_element: float = 2.0) -> float:
    """Arithmetic intensity of standard (unfused) attention for one head, FlashAttention-style.

    With N = seq_len, the steps and their HBM traffic, in elements:

        S = Q K^T       load Q, K: 2*N*d     store S: N^2      compute 2*N^2*d
        P = softmax(S)  load S:    N^2       store P: N^2      compute 3*N^2
        O = P V         load P, V: N^2+N*d   store O: N*d      compute 2*N^2*d

        FLOPs = 4*N^2*d + 3*N^2        bytes = B * (4*N^2 + 4*N*d)

    fp16 (B = 2), N = 4096, d = 128: 8.64e9 / 1.38e8 = 62.4 ops/byte, below every GPU's R,
    which is why FlashAttention keeps S and P on chip.
    """
    n, d = float(seq_len), float(head_dim)
    flops = 4 * n * n * d + 3 * n * n
    return flops / (bytes_per_element * (4 * n * n + 4 * n * d))


def attention_flops_per_token(
    num_layers: int, num_heads: int, head_dim: int, context: float
) -> float:
    """FLOPs of one query token attending over ``context`` cached tokens.

    A(c) = 4 * L * H * d * c        (q.K^T and p.V, 2 FLOPs per multiply-add, every layer)
    """
    return 4.0 * num_layers * num_heads * head_dim * context


def decode_step_flops(streamed_params: float, batch: int, attention_flops: float = 0.0) -> float:
    """FLOPs of one decode step: b * (2 * P_s + A(c)).

    Every sequence multiplies one token through every streamed weight (2 FLOPs per
    multiply-add) and attends over its context; ``attention_flops`` is A(c) per token.
    """
    return batch * (2.0 * streamed_params + attention_flops)


def decode_step_bytes(
    streamed_weight_bytes: float, batch: int, context: float = 0.0, kv_bytes_token: float = 0.0
) -> float:
    """Bytes one decode step reads: W_s + b * c * k.

    Weights are read once per step however large the batch (that is the whole point of
    batching); each sequence reads its own c cached tokens. Activations and the write of the
    new token's K/V (b * k, 1/c of the read) are left out.
    """
    return streamed_weight_bytes + batch * context * kv_bytes_token


def arithmetic_intensity(flops: float, num_bytes: float) -> float:
    """I = FLOPs / bytes moved. Decode at batch b without KV: 2*b*P / (B_w*P) = 2*b / B_w."""
    return flops / num_bytes


def critical_batch_size(
    device_ops_per_byte: float,
    streamed_weight_bytes: float,
    streamed_params: float,
    attention_flops: float = 0.0,
    context: float = 0.0,
    kv_bytes_token: float = 0.0,
) -> float:
    """Smallest batch at which a decode step turns compute-bound.

    Solve b * (2*P_s + A(c)) / (W_s + b*c*k) = R for b:

        b* = R * W_s / (2*P_s + A(c) - R*c*k)

    Without KV traffic this is b* = R * B_w / 2 (A10, fp16: 208). When R*c*k >= 2*P_s + A(c)
    the KV reads grow as fast as the FLOPs and decode never turns compute-bound: returns inf.
    """
    denominator = (
        2.0 * streamed_params + attention_flops - device_ops_per_byte * context * kv_bytes_token
    )
    if denominator <= 0:
        return math.inf
    return device_ops_per_byte * streamed_weight_bytes / denominator


# ------------------------------------------------------------------------------- capacity


def kv_capacity_tokens(
    memory_bytes: float, weight_bytes_total: float, kv_bytes_token: float
) -> int:
    """Tokens whose KV fits in the memory the weights leave: floor((M - W) / k), at least 0.

    A10 (24e9 bytes), Llama 2 7B fp16 (14e9): 10e9 / 524,288 = 19,073 tokens. The guide
    prints 19,230 because it rounds k to 0.00052 GB first.
    """
    free = memory_bytes - weight_bytes_total
    return max(0, math.floor(free / kv_bytes_token))


def max_sequences(kv_tokens: int, seq_len: int) -> int:
    """Sequences of ``seq_len`` tokens that fit at once: floor(tokens / seq_len).

    19,073 / 4,096 = 4 (the guide: "about 4 sequences of 4,096").
    """
    return kv_tokens // seq_len


# --------------------------------------------------------------------------- lower bounds


def memory_time_s(num_bytes: float, bandwidth: float) -> float:
    """t_mem = bytes / BW."""
    return num_bytes / bandwidth


def compute_time_s(flops: float, peak_flops: float) -> float:
    """t_comp = FLOPs / F."""
    return flops / peak_flops


def roofline_time_s(num_bytes: float, flops: float, bandwidth: float, peak_flops: float) -> float:
    """t >= max(bytes / BW, FLOPs / F): neither memory nor compute can go faster than its peak.

    Decode step (= time per output token of each sequence in the batch):
        t_decode(b, c) = max((W_s + b*c*k) / BW, b*(2*P_s + A(c)) / F)
    The guide's Llama 2 7B fp16 at b = 1, KV ignored: 14e9 / BW = 46.7 / 23.3 / 6.9 ms on a
    T4 / A10 / A100-80GB (the guide truncates to 46 / 23 / 6).
    """
    return max(memory_time_s(num_bytes, bandwidth), compute_time_s(flops, peak_flops))


def prefill_flops(
    streamed_params: float,
    num_tokens: int,
    num_layers: int = 0,
    num_heads: int = 0,
    head_dim: int = 0,
) -> float:
    """FLOPs of a prompt of n tokens: 2 * P_s * n + 4 * L * H * d * n * (n + 1) / 2.

    The second term is causal attention (token i attends over i tokens); it is under 1 % of
    the first for short prompts, which is why the guide's 2 * P * n omits it.
    Guide: 2 * 7e9 * 350 = 4.9e12 FLOPs -> 75 / 39 / 16 ms at 65 / 125 / 312 TFLOP/s.
    """
    attention = 4.0 * num_layers * num_heads * head_dim * num_tokens * (num_tokens + 1) / 2
    return 2.0 * streamed_params * num_tokens + attention


def prefill_bytes(
    streamed_weight_bytes: float, num_tokens: int, kv_bytes_token: float = 0.0
) -> float:
    """Bytes a prefill moves at least: the weights once plus the prompt's KV written, W_s + n*k."""
    return streamed_weight_bytes + num_tokens * kv_bytes_token


def generation_time_s(
    prefill_s: float, time_per_output_token_s: float, num_output_tokens: int
) -> float:
    """Total time of one request: t_prefill(n) + O * t_decode.

    The guide counts O decode steps (strictly the prefill samples the first token, so O - 1
    follow; the difference is one step in O). Guide, 350 + 150 tokens:
    0.075 + 150 * 0.046 = 6.98 s (T4), 0.039 + 150 * 0.023 = 3.49 s (A10),
    0.016 + 150 * 0.006 = 0.92 s (A100-80GB).
    """
    return prefill_s + num_output_tokens * time_per_output_token_s


# ----------------------------------------------------------------------------------- cost


def cost_per_request(price_per_hour: float, request_time_s: float, batch: int = 1) -> float:
    """USD per request: price/3600 * t_request / b (b requests share the device's time)."""
    return price_per_hour / 3600.0 * request_time_s / batch


def cost_per_million_tokens(price_per_hour: float, tokens_per_second: float) -> float:
    """USD per 10^6 tokens: price/3600 / throughput * 10^6."""
    return price_per_hour / 3600.0 / tokens_per_second * 1e6
