"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain PyTorch.

It differs from ``transformers``' model in one way only: attention writes each step's K/V
into the paged cache and reads the context back through block tables, for a flat batch that
mixes prefill chunks and decode tokens of many requests. Q/K/V and gate/up projections are
fused into single matmuls (one weight read each instead of three and two), and every
matmul weight is stored input-major (``Linear`` below).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionPlan, PagedAttention
from engine.config import ModelConfig
from engine.input_batch import InputBatch
from engine.layer_ops import TorchLayerOps
from engine.rope import RotaryEmbedding
from kvpool import host_memory


class Linear(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` stored ``[in_features, out_features]``.

    ``nn.Linear`` keeps ``[out, in]`` and multiplies by its transpose. On CPUs (MKL/oneDNN
    float32 sgemm, AVX2), the transposed-B case is 2-3x slower for 4 to 48 rows, exactly the
    decode batch sizes a server runs (16 rows: 138 ms vs 44 ms for this model's matmuls
    on 2 cores), while 1 row and large prefill chunks are the same speed either way
    (a matmul sweep over the model's weight shapes, ``benchmarks/mfu.py``). The
    checkpoint's ``[out, in]`` tensors are transposed once at load.
    """

    # Bumped whenever any Linear gets a packed copy or GGUF blocks: the model's cached list of
    # every layer's tensors (LlamaForCausalLM.fused_weights) is rebuilt when it moved.
    generation = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None
        self._quant: torch.Tensor | None = None
        self._cpu_ops: Any = None

    def pack_for_cpu(self, ops: Any) -> None:
        """Keep a second copy of the weight in the C++ matmul's panel layout
        (``kernels/cpu/csrc/gemm.cpp``) for batches of up to 256 rows, where it is 1.05-1.5x
        faster than the library on 2 cores; the engine runs larger steps in passes of 256
        rows (``engine/layer_ops.py``), so only the Python forward's larger batches use
        ``weight``.
        Costs one more copy of the weights in memory; no step reads both."""
        self._packed = ops.pack_weight(self.weight.detach())
        self._cpu_ops = ops
        Linear.generation += 1

    def use_quantized_panels(self, panels: torch.Tensor) -> None:
        """Serve small batches from the checkpoint's own GGUF blocks (``engine/gguf_blocks.py``
        packs them and checks that they de-quantize to exactly ``weight``); a step with at
        most ``max_quant_rows()`` rows (64 with AVX-512 VNNI, 12 with AVX-512, 8 with AVX2) then
        reads 6 (Q4) or 9 (Q8) bits a weight instead of 32. Needs ``pack_for_cpu``."""
        assert self._cpu_ops is not None, "pack_for_cpu first"
        self._quant = panels
        Linear.generation += 1

    @classmethod
    def gather_cpu_copies(cls, modules: Iterable[nn.Module]) -> int:
        """Move the packed panels of every ``Linear`` among ``modules``, and their GGUF blocks
        if any, into one buffer each, laid out in the order given (``model.modules()`` is
        forward order: layer by layer, q/k/v, o, gate/up, down, then the head). Returns the bytes
        moved.

        Why: a batch-1 decode step streams every weight once, and the hardware prefetchers read
        one long run at a time. Copies allocated one by one land wherever the allocator puts
        them; in one buffer each matmul's weights start where the previous one's end. The
        model's 121 one-row float32 matmuls chained (2 threads, one process, separate copies and
        one buffer alternating, rounds classified by an x.sum() probe): 11.17 -> 10.96 ms in
        1,203 rounds of fast bandwidth periods, 16.48 -> 16.29 in 297 slow ones; the AVX2 build
        10.74 -> 10.35 and 17.26 -> 17.03. The GGUF blocks' matmuls, compute-bound here, neither
        gain nor lose (4.37 vs 4.33 ms over 1,500 rounds). Costs the copies' size once more, for
        the moment of the move. The buffer is on huge pages where the OS gives them
        (kvpool/host_memory.py)."""
        linears = [m for m in modules if isinstance(m, cls)]
        moved = 0
        for attr in ("_packed", "_quant"):
            owners = [m for m in linears if getattr(m, attr) is not None]
            if not owners:
                continue
            dtypes = {getattr(m, attr).dtype for m in owners}
            assert len(dtypes) == 1, f"{attr} copies of several dtypes: {dtypes}"
            total = sum(getattr(m, attr).numel() for m in owners)
            buffer = host_memory.zeros((total,), dtypes.pop())  # huge pages: fewer TLB misses
            offset = 0
            for m in owners:
                t = getattr(m, attr)
                view = buffer[offset : offset + t.numel()].view(t.shape)
                view.copy_(t)
                setattr(m, attr, view)  # the separate copy is freed here
                offset += t.numel()
            moved += buffer.numel() * buffer.element_size()
        cls.generation += 1
        return moved

    @property
    def packed(self) -> torch.Tensor | None:
        return self._packed

    @property
    def quantized(self) -> torch.Tensor | None:
        return self._quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        if self._packed is not None:  # the C++ op picks blocks, panels or library by batch size
            return self._cpu_ops.linear(x, self.weight, self._packed, self._quant, self.bias)
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; bitwise equal to the formula below in float32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # In float32 whatever the model dtype, cast back before the weight (as transformers).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
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
        self.gate_up_proj = Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, h, bias=config.mlp_bias)

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
        ops: TorchLayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, residual stream)
        # The residual add of each sublayer is deferred into the next norm (one fused op):
        # the stream is residual + x until add_rms_norm_ folds x in.
        t = x.shape[0]
        if residual is None:
            residual = x
            h = ops.rms_norm(x, self.input_norm)
        else:
            h = ops.add_rms_norm_(x, residual, self.input_norm)
        q = ops.rope_and_store(
            self.qkv_proj(h),
            rope,
            attention,
            key_cache,
            value_cache,
            batch.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )
        o = attention(q, key_cache, value_cache, plan)  # [num_tokens, num_heads, head_dim]
        h = ops.add_rms_norm_(
            self.o_proj(o.reshape(t, self.q_size)), residual, self.post_attention_norm
        )
        return self.down_proj(ops.silu_mul(self.gate_up_proj(h))), residual

    def fused_weights(self) -> list[torch.Tensor | None]:
        """This layer's tensors in the order of the fused C++ layer's ``weights`` argument
        (``kernels/cpu/csrc/decoder_layer.cpp``, enum Slot): for each matmul its
        plain weight, packed copy, GGUF blocks and bias."""
        weights: list[torch.Tensor | None] = [
            self.input_norm.weight,
            self.post_attention_norm.weight,
        ]
        for linear in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
            weights += [linear.weight, linear.packed, linear.quantized, linear.bias]
        return weights


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: PagedAttention,
        rope: RotaryEmbedding,
        ops: TorchLayerOps | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention = attention
        self.ops = ops or TorchLayerOps()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Never shares storage with the embedding, even for tied checkpoints: the embedding
        # is looked up by rows of [vocab, hidden], the head multiplies by [hidden, vocab]
        # (see Linear). A tied model pays one extra copy (vocab x hidden) of memory.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.rope = rope
        self._fused_weights: tuple[int, list[torch.Tensor | None]] | None = None

    def fused_weights(self) -> list[torch.Tensor | None]:
        """Every layer's ``DecoderLayer.fused_weights``, layer after layer, then the model's
        own: the embedding, the final norm, and the head's weight, packed copy, GGUF blocks
        and bias (decoder_layer.cpp, enum HeadSlot). The ``weights`` of the fused C++ stack.
        Built once and kept (30 layers' lists cost ~0.6 ms to gather, a twentieth of a
        batch-1 step); rebuilt when a matmul got a packed copy or GGUF blocks since
        (``Linear.generation``). Parameters are updated in place (``load_*`` copies into
        them), so the tensors listed stay the model's."""
        if self._fused_weights is None or self._fused_weights[0] != Linear.generation:
            weights = [w for layer in self.layers for w in layer.fused_weights()]
            head = self.lm_head
            weights += [self.embed_tokens.weight, self.norm.weight]
            weights += [head.weight, head.packed, head.quantized, head.bias]
            self._fused_weights = (Linear.generation, weights)
        return self._fused_weights[1]

    @torch.inference_mode()
    def forward(
        self,
        batch: InputBatch,
        key_caches: list[
            torch.Tensor
        ],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        value_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [num_samples, vocab] float32
        _, block_size, num_kv_heads, _ = key_caches[0].shape
        plan = self.attention.plan(batch.attn, block_size, num_kv_heads)
        if self.ops.fuses_layers:
            # The C++ stack also looks up the embeddings and RoPE rows, and in a decode-only
            # step (every row is its sequence's last token) ends with the final norm and the
            # head: each Python-level op here costs tens of microseconds once the weights
            # have streamed through the caches (decoder_layer.cpp).
            x, residual, is_logits = self.ops.decoder_layers(
                self, batch, plan, key_caches, value_caches, logits=batch.logits_are_all_rows
            )
            if is_logits:
                return x
        else:
            x = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
            rope = self.rope.lookup(batch.positions, x.dtype)
            residual = None
            for layer, key_cache, value_cache in zip(
                self.layers, key_caches, value_caches, strict=True
            ):
                x, residual = layer(
                    x, residual, batch, rope, self.attention, plan, key_cache, value_cache, self.ops
                )
        # Only the last token of each sampling request needs logits: a prefill chunk of 512
        # tokens would otherwise pay 512 vocab-sized matmul rows for nothing.
        if batch.logits_are_all_rows:
            # Decodes only: every row is its sequence's last token. Two gathers cost ~0.1
            # ms of a 6 ms batch-1 step (cold after the weights streamed by).
            x = self.ops.add_rms_norm_(x, residual, self.norm)
        else:
            last = batch.logits_indices
            x = self.ops.add_rms_norm_(x[last], residual[last], self.norm)
        return self.lm_head(x).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF Llama checkpoint's tensors in, fusing q/k/v and gate/up and
        transposing every matmul weight to ``Linear``'s ``[in, out]``."""
        own = self.state_dict()
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        mapped: dict[str, torch.Tensor] = {
            "embed_tokens.weight": state["model.embed_tokens.weight"],
            "norm.weight": state["model.norm.weight"],
            "lm_head.weight": state[head],
        }
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn, mlp = src + "self_attn.", src + "mlp."
            mapped[dst + "input_norm.weight"] = state[src + "input_layernorm.weight"]
            mapped[dst + "post_attention_norm.weight"] = state[
                src + "post_attention_layernorm.weight"
            ]
            mapped[dst + "qkv_proj.weight"] = torch.cat(
                [state[attn + f"{p}_proj.weight"] for p in "qkv"]
            )
            if self.config.attention_bias:
                mapped[dst + "qkv_proj.bias"] = torch.cat(
                    [state[attn + f"{p}_proj.bias"] for p in "qkv"]
                )
            mapped[dst + "o_proj.weight"] = state[attn + "o_proj.weight"]
            mapped[dst + "gate_up_proj.weight"] = torch.cat(
                [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]
            )
            mapped[dst + "down_proj.weight"] = state[mlp + "down_proj.weight"]
            if self.config.mlp_bias:
                mapped[dst + "gate_up_proj.bias"] = torch.cat(
                    [state[mlp + "gate_proj.bias"], state[mlp + "up_proj.bias"]]
                )
                mapped[dst + "down_proj.bias"] = state[mlp + "down_proj.bias"]
        missing = own.keys() - mapped.keys()
        if missing:
            raise KeyError(f"checkpoint lacks tensors for {sorted(missing)[:5]}")
        linear_weights = {
            f"{name}.weight" for name, module in self.named_modules() if isinstance(module, Linear)
        }
        with torch.no_grad():
            for name, tensor in mapped.items():
                if name in linear_weights:
                    tensor = tensor.t()  # [out, in] -> [in, out]
                own[name].copy_(tensor.to(own[name].dtype))
