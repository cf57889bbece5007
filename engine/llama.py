"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM) in plain
PyTorch.

It differs from ``transformers``' model in one way only: attention writes each step's K/V
into the paged cache and reads the context back through block tables, for a flat batch that
mixes prefill chunks and decode tokens of many requests. Q/K/V and gate/up projections are
fused into single matmuls (one weight read each instead of three and two), and every
matmul weight is stored input-major (``Linear`` below).

This file is the model's math and its checkpoint mapping (``checkpoint_sources``) only. A
device's fast path (packed or quantized weight copies, fused kernels, CUDA graphs) is a
backend in ``engine/backends/`` that transforms the loaded model from outside and runs in
its place; nothing here knows about one. A family that differs in a few places (biases,
RoPE scaling, tied embeddings) is a ``ModelConfig`` field read here and a name in
``checkpoint_sources``. What each family changes (``engine/config.py``, ``FAMILIES``)::

    family    differs from Llama by
    qwen2     q/k/v biases
    qwen3     per-head RMSNorm of q and k before RoPE
    mistral   a sliding window on every layer
    phi3      fused qkv / gate_up in the checkpoint (split the way ours are fused)
    gemma2    GeGLU (gelu-tanh), (1 + w) norms, norms on the attention and MLP outputs
              too, embeddings times sqrt(hidden), softmax scale from
              query_pre_attn_scalar, soft-capped attention scores and logits, every
              other layer sliding
    gemma3    gemma2 without soft-caps, with q/k norms, 5 sliding layers in 6, and its
              own RoPE base on the sliding layers
    mixtral   mistral with a mixture of experts for its MLPs (engine/moe.py)
    qwen3_moe qwen3 with a mixture of experts for its MLPs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.moe import SparseMoe, expert_sources, split_fused_experts, stack_experts
from engine.rope import RotaryEmbedding

if TYPE_CHECKING:
    from engine.attention import AttentionPlan, PagedAttention
    from engine.input_batch import InputBatch


class Linear(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` stored ``[in_features, out_features]``.

    ``nn.Linear`` keeps ``[out, in]`` and multiplies by its transpose. On CPUs (MKL/oneDNN
    float32 sgemm, AVX2), the transposed-B case is markedly slower for 4 to 48 rows, the
    decode batch sizes a server runs, while 1 row and large prefill chunks are the same speed
    either way (``benchmarks/mfu.py`` sweeps the model's weight shapes). The checkpoint's
    ``[out, in]`` tensors are transposed once at load. A backend that wants another layout
    (the C++ panels, ``engine/backends/cpu.py``) packs its own copy from this one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def add_norm_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Add a sublayer's output ``x`` into the residual stream in place and return the
        normed sum: ``residual = residual + x`` followed by ``self(residual)``. Each
        sublayer's residual add is deferred into the next norm this way (one fused op in a
        backend that fuses them)."""
        residual.add_(x)
        return self(residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; bitwise equal to the formula below in float32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # In float32 whatever the model dtype, cast back before the weight (as transformers).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of the gate_up projection's ``[gate | up]`` output."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [t, 2 * inter] -> [t, inter]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up``: Gemma's GeGLU."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [t, 2 * inter] -> [t, inter]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: Gemma 2's bound on attention scores and logits."""
    return torch.tanh(x / cap) * cap


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d
        self.q_size = config.num_heads * d
        self.kv_size = config.num_kv_heads * d
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, h)
        self.post_attention_norm = RMSNorm(h, config.rms_norm_eps)
        # The MLP: dense, or on a mixture-of-experts layer the experts (engine/moe.py).
        self.moe = None
        self.gate_up_proj: Linear | None = None
        self.down_proj: Linear | None = None
        if config.layer_is_moe()[layer]:
            self.moe = SparseMoe(config, ACTIVATIONS[config.hidden_act]())
        else:
            self.gate_up_proj = Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
            self.down_proj = Linear(config.intermediate_size, h, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]()
        # The family's variations (engine/config.py); None where a family has none.
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(d, eps) if config.qk_norm else None  # per head, before RoPE
        self.k_norm = RMSNorm(d, eps) if config.qk_norm else None
        self.attn_out_norm = RMSNorm(h, eps) if config.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(h, eps) if config.sandwich_norms else None
        self.sliding = config.layer_window(layer) is not None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's output (or embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before x is added
        batch: InputBatch,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim]
        attention: PagedAttention,
        plan: AttentionPlan,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, residual stream)
        # The stream is residual + x until add_rms_norm_ folds x in.
        t = x.shape[0]
        if residual is None:
            residual = x
            h = self.input_norm(x)
        else:
            h = self.input_norm.add_norm_(x, residual)
        qkv = self.qkv_proj(h)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_heads(qkv)
        # The chunk's own K/V must be in the cache before attention: its queries attend to
        # them through the block table like to any cached token.
        q = attention.rope_and_store(
            qkv, rope, key_cache, value_cache, batch.slot_mapping, self.num_heads, self.num_kv_heads
        )
        # [num_tokens, num_heads, head_dim]
        o = attention(q, key_cache, value_cache, plan, sliding=self.sliding)
        o = self.o_proj(o.reshape(t, self.q_size))
        if self.attn_out_norm is not None:
            o = self.attn_out_norm(o)
        h = self.post_attention_norm.add_norm_(o, residual)
        if self.moe is not None:
            out = self.moe(h)
        else:
            assert self.gate_up_proj is not None and self.down_proj is not None
            out = self.down_proj(self.act(self.gate_up_proj(h)))
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return out, residual

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k RMS-normed per head (Qwen3, Gemma 3); v unchanged."""
        assert self.q_norm is not None and self.k_norm is not None
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # One row per head: [t * heads, head_dim] (the fused norm kernels take 2-D rows).
        q = self.q_norm(q.reshape(t * self.num_heads, d)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d)).reshape(t, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: PagedAttention,
        rope: RotaryEmbedding,
        sliding_rope: RotaryEmbedding | None = None,
    ) -> None:
        """``sliding_rope``: the sliding layers' own RoPE tables (Gemma 3); None: theirs
        are ``rope``."""
        super().__init__()
        self.config = config
        self.attention = attention
        # Allocated, not initialised (like Linear): every weight is loaded or filled after
        # construction. nn.Embedding's own init (normal_) on the meta device the builder
        # constructs on runs a Python decomposition that imports torch._dynamo, which
        # imports triton: every CPU process would load triton's extension for a random draw
        # it throws away.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Never shares storage with the embedding, even for tied checkpoints: the embedding
        # is looked up by rows of [vocab, hidden], the head multiplies by [hidden, vocab]
        # (see Linear). A tied model pays one extra copy (vocab x hidden) of memory.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rope = rope
        self.sliding_rope = sliding_rope

    def experts_touched(self) -> int | None:
        """Experts the last forward ran, summed over the layers; None: no experts."""
        counts = [layer.moe.experts_touched for layer in self.layers if layer.moe is not None]
        return sum(counts) if counts else None

    @torch.inference_mode()
    def forward(
        self,
        batch: InputBatch,
        key_caches: list[
            torch.Tensor
        ],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        value_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [num_samples, vocab] float32
        x, residual = self.hidden_states(batch, key_caches, value_caches)
        return self.compute_logits(x, residual, batch)

    def hidden_states(
        self,
        batch: InputBatch,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        plan: AttentionPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the last layer's (output, residual stream)
        """Every layer over every token of the step. ``plan``: the step's attention plan,
        None to make it from ``batch.attn`` (engine/prefill_graphs.py passes its own)."""
        if plan is None:
            plan = self.attention.plan(batch.attn, key_caches[0])
        x = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        if self.config.embed_scale != 1.0:
            # Rounded to the model's dtype first, as transformers' Gemma does.
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = self.rope.lookup(batch.positions, x.dtype)
        local_rope = rope
        if self.sliding_rope is not None:
            local_rope = self.sliding_rope.lookup(batch.positions, x.dtype)
        residual = None
        for layer, key_cache, value_cache in zip(
            self.layers, key_caches, value_caches, strict=True
        ):
            x, residual = layer(
                x,
                residual,
                batch,
                local_rope if layer.sliding else rope,
                self.attention,
                plan,
                key_cache,
                value_cache,
            )
        assert residual is not None
        return x, residual

    def compute_logits(
        self, x: torch.Tensor, residual: torch.Tensor, batch: InputBatch
    ) -> torch.Tensor:  # [num_samples, vocab] float32
        """The final norm and the head over the rows ``batch.logits_indices`` names."""
        # Only the last token of each sampling request needs logits: a prefill chunk of 512
        # tokens would otherwise pay 512 vocab-sized matmul rows for nothing.
        if batch.logits_are_all_rows:  # decodes only: every row is its sequence's last token
            x = self.norm.add_norm_(x, residual)
        else:
            last = batch.logits_indices
            x = self.norm.add_norm_(x[last], residual[last])
        logits = self.lm_head(x).float()
        if self.config.final_logit_softcap is not None:
            logits = soft_cap(logits, self.config.final_logit_softcap)
        return logits

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF Llama checkpoint's tensors in (``checkpoint_sources``), fusing q/k/v
        and gate/up and transposing every matmul weight to ``Linear``'s ``[in, out]``."""
        own = self.state_dict()
        if any(self.config.layer_is_moe()):
            state = split_fused_experts(state, self.config)
        sources = checkpoint_sources(self.config)
        missing = own.keys() - sources.keys()
        if missing:
            raise KeyError(f"no checkpoint mapping for {sorted(missing)[:5]}")
        absent = [n for names in sources.values() for n in names if n not in state]
        if absent:
            raise KeyError(f"checkpoint lacks tensors for {absent[:5]}")
        linear_weights = {
            f"{name}.weight" for name, module in self.named_modules() if isinstance(module, Linear)
        }
        with torch.no_grad():
            for name, names in sources.items():
                parts = [state[n] for n in names]
                tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
                if own[name].dim() == 3:  # a mixture's experts, one after another
                    tensor = stack_experts(parts, own[name].shape[0])
                elif name.endswith("moe.router"):
                    tensor = tensor.t()  # [experts, hidden] -> [hidden, experts]
                elif name in linear_weights:
                    tensor = tensor.t()  # [out, in] -> [in, out]
                elif name.endswith("norm.weight") and self.config.norm_offset:
                    # Gemma's norms multiply by (1 + w): folded into the weight once, in
                    # float32 as transformers adds it.
                    tensor = tensor.float() + self.config.norm_offset
                own[name].copy_(tensor.to(own[name].dtype))


def checkpoint_sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each of the model's tensors -> the HF checkpoint tensors it is made of, concatenated
    along the output dimension in this order (q/k/v into ``qkv_proj``, gate/up into
    ``gate_up_proj``). The one place that knows the checkpoint's names: loading and the GGUF
    block mapping (``engine/gguf_blocks.py``) both read it."""
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    out: dict[str, tuple[str, ...]] = {
        "embed_tokens.weight": ("model.embed_tokens.weight",),
        "norm.weight": ("model.norm.weight",),
        "lm_head.weight": (head,),
    }
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "input_norm.weight"] = (src + "input_layernorm.weight",)
        if config.sandwich_norms:
            # Gemma: post_attention_layernorm norms the attention output; the MLP's input
            # norm is pre_feedforward_layernorm (Llama's post_attention_layernorm).
            out[dst + "attn_out_norm.weight"] = (src + "post_attention_layernorm.weight",)
            out[dst + "post_attention_norm.weight"] = (src + "pre_feedforward_layernorm.weight",)
            out[dst + "mlp_out_norm.weight"] = (src + "post_feedforward_layernorm.weight",)
        else:
            out[dst + "post_attention_norm.weight"] = (src + "post_attention_layernorm.weight",)
        if config.qk_norm:
            out[dst + "q_norm.weight"] = (attn + "q_norm.weight",)
            out[dst + "k_norm.weight"] = (attn + "k_norm.weight",)
        if config.fused_checkpoint:  # Phi-3: already [q | k | v] and [gate | up]
            out[dst + "qkv_proj.weight"] = (attn + "qkv_proj.weight",)
            out[dst + "o_proj.weight"] = (attn + "o_proj.weight",)
            out[dst + "gate_up_proj.weight"] = (mlp + "gate_up_proj.weight",)
            out[dst + "down_proj.weight"] = (mlp + "down_proj.weight",)
            continue
        out[dst + "qkv_proj.weight"] = tuple(attn + f"{p}_proj.weight" for p in "qkv")
        if config.attention_bias:
            out[dst + "qkv_proj.bias"] = tuple(attn + f"{p}_proj.bias" for p in "qkv")
        out[dst + "o_proj.weight"] = (attn + "o_proj.weight",)
        if config.layer_is_moe()[i]:
            router, gate_up, down = expert_sources(config, src)
            out[dst + "moe.router"], out[dst + "moe.gate_up"] = router, gate_up
            out[dst + "moe.down"] = down
            continue
        out[dst + "gate_up_proj.weight"] = (mlp + "gate_proj.weight", mlp + "up_proj.weight")
        out[dst + "down_proj.weight"] = (mlp + "down_proj.weight",)
        if config.mlp_bias:
            out[dst + "gate_up_proj.bias"] = (mlp + "gate_proj.bias", mlp + "up_proj.bias")
            out[dst + "down_proj.bias"] = (mlp + "down_proj.bias",)
    return out
