"""ModelConfig: the one-time translation of a Hugging Face Llama-family config.

Model code reads only this frozen dataclass, never the HF config, so the quirks of
``transformers`` versions (``rope_scaling`` vs ``rope_parameters``, missing ``head_dim``) are
handled here, once.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.spec_decode.config import SpeculativeConfig
from kernels.attention_tuning import attention_tuning_env
from kernels.matmul_tuning import matmul_tuning_env
from kernels.settings import decode_matmul_env, pdl_env


def cache_dir() -> Path:
    """Where converted models and measured machine peaks are cached:
    ``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``."""
    root = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root).expanduser()


class ModelError(Exception):
    """A ``--model`` the user must change (not found, not local, not supported), or a
    setting that cannot serve it (its subclasses): the command line reports its message as
    one line, without a traceback."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """No local checkpoint at the given place (pagedserve never downloads one)."""


class UnsupportedModelError(ModelError, ValueError):
    """A checkpoint pagedserve cannot serve (architecture, rope scaling, file format)."""


class KVCacheSettingError(ModelError, ValueError):
    """KV cache settings that cannot hold the model: a budget below one block of it, no
    device memory left for one, a cache dtype its head dim cannot take."""


@dataclass(frozen=True, slots=True)
class Family:
    """What a ``model_type`` changes in the shared decoder (``engine/llama.py``), where its
    config.json does not say so itself. Every field is read once by ``ModelConfig.from_hf``.

    - ``qkv_bias``: q/k/v projections carry biases (Qwen2).
    - ``qk_norm``: each query and key head is RMS-normed before RoPE (Qwen3, Gemma 3).
    - ``sandwich_norms``: the attention and MLP outputs are normed before their residual
      adds too (Gemma 2/3's post-attention and post-feedforward norms).
    - ``norm_offset``: norms multiply by ``offset + weight`` (Gemma's ``1 + w``).
    - ``scale_embeddings``: embeddings are multiplied by ``sqrt(hidden_size)`` (Gemma).
    - ``hidden_act``: the MLP's gate activation when config.json names none.
    - ``fused_checkpoint``: the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3).
    - ``sliding_pattern``: every n-th layer is global, the others slide (Gemma 2: 2,
      Gemma 3: 6), when config.json has no ``layer_types``; 0: every layer slides when
      config.json sets ``sliding_window`` (Mistral, Phi-3); None: sliding only by
      ``layer_types``.
    - ``query_pre_attn_scalar``: softmax scale is ``query_pre_attn_scalar ** -0.5``.
    - ``norm_topk_prob``: a mixture of experts renormalises its top-k routing weights
      whatever config.json says (Mixtral); False: as config.json's ``norm_topk_prob``.
    - ``rope_theta``: the RoPE base when config.json names none (transformers' default
      for the family: Gemma 3's global layers and Mixtral 1e6).
    - ``local_rope``: sliding layers rotate with their own default RoPE base, config.json's
      ``rope_local_base_freq`` (10000 if absent) or ``rope_parameters.sliding_attention``;
      ``rope_scaling`` then applies to the global layers only (Gemma 3).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_offset: float = 0.0
    scale_embeddings: bool = False
    hidden_act: str = "silu"
    fused_checkpoint: bool = False
    sliding_pattern: int | None = None
    query_pre_attn_scalar: bool = False
    norm_topk_prob: bool = False
    rope_theta: float = 10_000.0
    local_rope: bool = False


_GEMMA = Family(
    sandwich_norms=True,
    norm_offset=1.0,
    scale_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=True,
)
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(sliding_pattern=0),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "gemma2": dataclasses.replace(_GEMMA, sliding_pattern=2),
    "gemma3_text": dataclasses.replace(
        _GEMMA, qk_norm=True, sliding_pattern=6, rope_theta=1_000_000.0, local_rope=True
    ),
    # transformers' Phi-3 masks every layer by sliding_window, as Mistral's does
    # (Phi-3-mini-4k: 2047).
    "phi3": Family(fused_checkpoint=True, sliding_pattern=0),
    # Mixtures of experts (engine/moe.py): the attention of mistral and qwen3.
    "mixtral": Family(sliding_pattern=0, norm_topk_prob=True, rope_theta=1_000_000.0),
    "qwen3_moe": Family(qk_norm=True),
}
SUPPORTED_ARCHITECTURES = set(FAMILIES)
ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}
# How steps with prefill tokens replay CUDA graphs (EngineConfig.cuda_graph_prefill_mode,
# engine/prefill_graphs.py).
CUDA_GRAPH_PREFILL_MODES = ("full", "piecewise")
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope", "dynamic"}
# Whose frequencies transformers changes with the batch's longest sequence: served exactly
# only while every position stays within original_max_position_embeddings (engine/rope.py).
LENGTH_DEPENDENT_ROPE_TYPES = {"longrope", "dynamic"}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: cos/sin are multiplied by it; None: the variant's own formula
    attention_factor: float | None = None
    # longrope
    short_factor: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # What differs between families (``Family``), resolved from config.json.
    hidden_act: str = "silu"  # the MLP gate's: silu or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_offset: float = 0.0  # norms multiply by (norm_offset + weight)
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits
    sliding_window: int | None = None  # a sliding layer's query sees this many keys
    sliding_layers: tuple[bool, ...] = ()  # per layer: does it slide (empty: none does)
    sliding_rope_theta: float | None = None  # sliding layers' own RoPE base (Gemma 3)
    fused_checkpoint: bool = False  # qkv_proj / gate_up_proj stored fused (Phi-3)
    # A mixture of experts (engine/moe.py); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()  # per layer: is its MLP the mixture

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or None if it attends to all of its
        context."""
        if self.sliding_window is None or not self.sliding_layers:
            return None
        return self.sliding_window if self.sliding_layers[layer] else None

    def family_differences(self) -> str:
        """What this model computes beyond Llama's layer, in words ("" for none)."""
        found = {
            f"{self.hidden_act} MLP": self.hidden_act != "silu",
            "q/k norms": self.qk_norm,
            "norms on attention and MLP outputs": self.sandwich_norms,
            "(1 + w) norms": self.norm_offset != 0.0,
            "scaled embeddings": self.embed_scale != 1.0,
            "query_pre_attn_scalar": self.attn_scale is not None,
            "soft-capped scores": self.attn_logit_softcap is not None,
            "soft-capped logits": self.final_logit_softcap is not None,
            f"sliding window {self.sliding_window}": any(self.sliding_layers),
            "mixture of experts": any(self.moe_layers),
        }
        return ", ".join(name for name, differs in found.items() if differs)

    @property
    def is_plain_llama(self) -> bool:
        """Whether the model is Llama's math exactly (biases and tied heads aside): what
        the fused C++ stack (engine/backends/cpu.py) computes."""
        return not self.family_differences()

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Translate a ``transformers`` config object (or its dict) once."""
        d: dict[str, Any] = hf if isinstance(hf, dict) else hf.to_dict()
        model_type = d.get("model_type", "llama")
        if model_type == "gemma3" and isinstance(d.get("text_config"), dict):
            raise UnsupportedModelError(
                "unsupported architecture 'gemma3' (the multimodal Gemma3ForConditionalGeneration"
                "); pagedserve serves its text-only form, model_type 'gemma3_text' "
                "(Gemma3ForCausalLM): pass a text-only checkpoint"
            )
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} (config.json model_type); "
                f"pagedserve serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))} models: "
                "pass a checkpoint of one of those families"
            )
        family = FAMILIES[model_type]
        missing = [key for key in _REQUIRED_KEYS if key not in d]
        if missing:
            raise UnsupportedModelError(
                f"config.json lacks {', '.join(missing)}, which every {model_type} config "
                "has: pass a complete HF checkpoint"
            )
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        # transformers >= 5 folds rope_theta into rope_parameters; older versions keep both
        # rope_theta and an optional rope_scaling dict at the top level.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        # Gemma 3 keeps one set of RoPE parameters per layer type: transformers >= 5 as
        # rope_parameters.{full,sliding}_attention; hub configs written before it (such as
        # gemma-3-1b-it's) as rope_theta and rope_scaling for the global layers and
        # rope_local_base_freq for the sliding ones.
        sliding_rope: dict[str, Any] | None = None
        sliding_rope_theta: float | None = None
        if "full_attention" in rope or "sliding_attention" in rope:
            sliding_rope = rope.get("sliding_attention") or {}
            rope = rope.get("full_attention") or {}
        elif family.local_rope:
            sliding_rope = {}
        if sliding_rope is not None:
            if _rope_type(sliding_rope) != "default":
                raise UnsupportedModelError(
                    f"unsupported rope scaling {_rope_type(sliding_rope)!r} on sliding layers "
                    "(config.json rope_parameters.sliding_attention); pagedserve supports "
                    "default RoPE there"
                )
            sliding_rope_theta = float(
                sliding_rope.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))
            )
        rope_theta = rope.get("rope_theta", d.get("rope_theta", family.rope_theta))
        rope_type = _rope_type(rope)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r} (config.json); pagedserve supports "
                f"{', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
            )
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"unsupported partial_rotary_factor {partial} (config.json): pagedserve "
                "rotates whole heads only"
            )
        hidden_act = d.get("hidden_activation") or d.get("hidden_act") or family.hidden_act
        if hidden_act in ("gelu_tanh", "gelu_new"):  # the same tanh approximation
            hidden_act = "gelu_pytorch_tanh"
        if hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported activation {hidden_act!r} (config.json hidden_act); pagedserve "
                f"supports {', '.join(sorted(ACTIVATIONS))}"
            )
        num_layers = d["num_hidden_layers"]
        window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            window = None
        sliding = _sliding_layers(d, family, num_layers, window)
        if not any(sliding):
            sliding, window = (), None
        num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        moe_layers: tuple[bool, ...] = ()
        if num_experts and model_type in ("mixtral", "qwen3_moe"):
            step = int(d.get("decoder_sparse_step") or 1)
            dense = set(d.get("mlp_only_layers") or ())
            moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings")
                or d.get("original_max_position_embeddings")
                or d.get("max_position_embeddings", 8192)
            ),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=_optional_float(rope.get("mscale")),
            mscale_all_dim=_optional_float(rope.get("mscale_all_dim")),
            truncate=bool(rope.get("truncate", True)),
            attention_factor=_optional_float(rope.get("attention_factor")),
            short_factor=tuple(float(f) for f in rope.get("short_factor") or ()),
        )
        if rope_type in ("longrope", "yarn") and rope.get("factor") is None:
            # transformers' default: the ratio of the extended context to the original
            scaling = dataclasses.replace(
                scaling,
                factor=d.get("max_position_embeddings", 2048)
                / scaling.original_max_position_embeddings,
            )
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", family.qkv_bias)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            hidden_act=hidden_act,
            qk_norm=family.qk_norm,
            sandwich_norms=family.sandwich_norms,
            norm_offset=family.norm_offset,
            embed_scale=d["hidden_size"] ** 0.5 if family.scale_embeddings else 1.0,
            attn_scale=(
                float(d.get("query_pre_attn_scalar", head_dim)) ** -0.5
                if family.query_pre_attn_scalar
                else None
            ),
            attn_logit_softcap=_optional_float(d.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(d.get("final_logit_softcapping")),
            sliding_window=int(window) if window is not None else None,
            sliding_layers=sliding,
            sliding_rope_theta=sliding_rope_theta,
            fused_checkpoint=family.fused_checkpoint,
            num_experts=num_experts if moe_layers else 0,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if moe_layers else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"])
            if moe_layers
            else 0,
            norm_topk_prob=family.norm_topk_prob or bool(d.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
        )

    @property
    def num_params(self) -> int:  # the small per-head q/k and sandwich norms left out
        """Parameter count, counting tied embeddings once."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * i
        per_layer = attn + 2 * h
        moe = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        mlps = sum(moe if is_moe else mlp for is_moe in self.layer_is_moe())
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlps + embed + h

    def layer_is_moe(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is the mixture of experts."""
        return self.moe_layers or (False,) * self.num_layers

    @property
    def expert_params(self) -> int:
        """Weights of one expert of one layer (gate, up and down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) * layers * kv heads * head dim * bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default")) or "default"


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_layers(
    d: dict[str, Any], family: Family, num_layers: int, window: Any
) -> tuple[bool, ...]:
    """Per layer, whether it attends through the sliding window: config.json's
    ``layer_types`` where it has them, else the family's pattern."""
    if window is None:
        return ()
    types = d.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise UnsupportedModelError(
                f"config.json lists {len(types)} layer_types for {num_layers} layers"
            )
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(
                f"unsupported layer types {sorted(unknown)} (config.json layer_types); "
                "pagedserve supports sliding_attention and full_attention"
            )
        return tuple(t == "sliding_attention" for t in types)
    pattern = family.sliding_pattern
    if pattern is None:
        return ()
    if pattern == 0:
        return (True,) * num_layers
    pattern = int(d.get("sliding_window_pattern", pattern))
    return tuple(bool((i + 1) % pattern) for i in range(num_layers))


def check_environment(environ: Mapping[str, str]) -> None:
    """The environment variables the engine reads while it runs, checked before it starts:
    a bad value is a ValueError naming it (kernels/_common.py: ``PAGEDSERVE_PDL``, 0 or 1;
    ``PAGEDSERVE_DECODE_MATMUL``, library or triton; kernels/matmul_tuning.py:
    ``PAGEDSERVE_MATMUL_TUNING`` and kernels/attention_tuning.py:
    ``PAGEDSERVE_ATTENTION_TUNING``, readable tables)."""
    pdl_env(environ)
    decode_matmul_env(environ)
    matmul_tuning_env(environ)
    attention_tuning_env(environ)


# The devices the engine runs on: the CPU (C++ kernels) and CUDA GPUs (Triton kernels).
_DEVICE = re.compile(r"(?P<type>cpu|cuda)(:(?P<index>\d+))?")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What to load and where to run it.

    Args:
        model: "default" (the embedded SmolLM2-135M-Instruct), an HF directory
            (config.json + safetensors) or a .gguf file.
        dtype: "float32", "bfloat16" or "float16"; None picks float32 on CPU, bfloat16 on CUDA.
        device: "cpu", "cuda", "cuda:1"...; None picks CUDA when present.
        attention_backend: "auto" (Triton on CUDA; on CPU the C++ kernels for float32 when
            they build, else the torch reference), "triton", "cpu" or "torch".
        matmul_weights: "gguf" (default): when the model is a GGUF file and the C++ cpu
            kernels run, batches of up to max_quant_rows() rows (64 with AVX-512 VNNI, 12 with
            AVX-512, 8 with AVX2) multiply by the file's own
            Q4_0/Q4_1/Q8_0 blocks wherever they de-quantize to exactly the float32 weights
            (same greedy output, 4.8x fewer bytes read per decode step for the default
            model; engine/gguf_blocks.py); "float32": always the float32 copy.
        quantization: None (the checkpoint's dtype), "int8" or "fp8": every matmul weight
            (not the embedding) quantized at load, symmetric per output channel
            (engine/quantization.py); lossy, measured by ``python -m benchmarks.quality``.
            fp8 needs CUDA.
        max_model_len: longest prompt + output; None uses the model's max positions.
        seed: seed of the sampler's generator for requests that give no seed.
        load_format: "auto" reads the checkpoint; "dummy" fills the model with random
            weights of the right shapes and dtype (benchmarks where no weights can be
            fetched). With "dummy", ``model`` may also name a shape preset
            (engine/presets.py: "llama-3-8b", "llama-3.2-1b", "qwen2.5-7b", ...).
        tokenizer: a directory holding a tokenizer to use instead of the model's own
            (a dummy preset has none: without one it takes token-id prompts only).
        enforce_eager: never capture CUDA graphs; every step launches its kernels from
            Python (engine/cuda_graphs.py).
        cuda_graph_sizes: the batch sizes to capture a decode graph for; None picks
            1, 2, 4, 8, then steps of 8 up to 64 and of 16 up to ``max_num_seqs``.
        cuda_graph_max_prefill_tokens: steps with prefill (or speculative) rows of at most
            this many tokens replay CUDA graphs (engine/prefill_graphs.py); 0: such steps
            run eagerly.
        cuda_graph_prefill_mode: how those steps replay. "full" (the default): one graph of
            the whole forward where the step's attention runs in one launch (the decode
            kernel would split none of its decodes' contexts), pieces cut at attention
            elsewhere; "piecewise": always pieces, attention eager between them.
        generation_config: "auto": the checkpoint's generation_config.json sampling
            fields (temperature, top_p, top_k, min_p, repetition_penalty) are the defaults
            of requests that leave them unset; "none": pagedserve's own defaults
            (engine/generation_config.py). EOS ids are read from the checkpoint either way.
        tensor_parallel_size: ranks each layer is sharded over (engine/tensor_parallel.py);
            rank 0 schedules and samples, the others follow its step plan
            (engine/tp_group.py, engine/tp_launch.py). 1: no sharding, no process group.
        nnodes, node_rank, master_addr, master_port: the torch.distributed rendezvous of a
            tensor-parallel group over several hosts (each host runs
            ``tensor_parallel_size // nnodes`` ranks; node 0 serves HTTP). On one host
            master_port 0 picks a free port. torchrun's RANK/WORLD_SIZE/MASTER_ADDR/
            MASTER_PORT, when set, take their place.
        speculative: speculative decoding (engine/spec_decode/config.py); None: off.
        async_scheduling: schedule and launch each step while the one before still runs
            on the device, reading its tokens after (engine/llm_engine.py): the host's
            scheduling and input preparation hide behind the device's work. Same tokens;
            a request that meets EOS computes one row more than it keeps. Continuous
            batching only; not with speculative decoding yet. None (the default): on where
            it was measured to pay, one CUDA device with continuous batching and no
            speculative decoding (``async_scheduling_for``); off elsewhere.
    """

    model: str = "default"
    dtype: str | None = None
    device: str | None = None
    attention_backend: str = "auto"
    matmul_weights: str = "gguf"
    quantization: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    tokenizer: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    cuda_graph_max_prefill_tokens: int = 1024
    cuda_graph_prefill_mode: str = "full"
    generation_config: str = "auto"
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    speculative: SpeculativeConfig | None = None
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("--async-scheduling does not run with speculative decoding yet")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding does not run with tensor parallelism yet")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            # 0 would read as "unset" further on and serve the model's own length silently.
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"nnodes must divide tensor_parallel_size ({self.tensor_parallel_size} ranks "
                f"over {self.nnodes} nodes)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a tensor-parallel group over several nodes needs --master-port")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(
                f"generation_config must be auto or none, got {self.generation_config!r}"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.matmul_weights not in ("gguf", "float32"):
            raise ValueError(f"matmul_weights must be gguf or float32, got {self.matmul_weights!r}")
        if self.quantization not in (None, "int8", "fp8"):
            raise ValueError(f"quantization must be int8 or fp8, got {self.quantization!r}")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            # The sharded model's row-parallel matmuls and head are their own modules
            # (engine/tensor_parallel.py), which the quantization transform does not know.
            raise ValueError("--quantization does not combine with --tensor-parallel-size > 1 yet")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ValueError(
                f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes!r}"
            )
        if self.cuda_graph_max_prefill_tokens < 0:
            raise ValueError(
                "cuda_graph_max_prefill_tokens must be 0 (off) or a token count, "
                f"got {self.cuda_graph_max_prefill_tokens}"
            )
        if self.cuda_graph_prefill_mode not in CUDA_GRAPH_PREFILL_MODES:
            raise ValueError(
                f"cuda_graph_prefill_mode must be {' or '.join(CUDA_GRAPH_PREFILL_MODES)}, "
                f"got {self.cuda_graph_prefill_mode!r}"
            )
        if self.attention_backend not in ("auto", "triton", "cpu", "torch"):
            raise ValueError(
                "attention_backend must be auto, triton, cpu or torch, "
                f"got {self.attention_backend!r}"
            )
        if self.device is not None:
            spelled = _DEVICE.fullmatch(self.device)
            if spelled is None:
                raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
            if spelled["index"] is not None and self.tensor_parallel_size > 1:
                # Each rank takes the GPU of its rank on the host (engine/builder.py).
                raise ValueError(
                    f"device {self.device!r} names one GPU, but tensor parallelism puts each "
                    f"rank on its own: give {spelled['type']!r}"
                )

    def resolved_device(self) -> str:
        """The device the engine runs on: ``device`` as given, else CUDA where torch sees a
        GPU, else the CPU."""
        import torch

        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def check_device(self) -> None:
        """Raise ValueError, in one line saying what to change, where this machine lacks the
        device asked for: CUDA in a torch without it or with no GPU visible, ``cuda:N`` past
        the GPUs there are, or fewer GPUs on the host than its tensor-parallel ranks. Called
        before anything loads (the server's start-up, ``engine.builder.pick_device``)."""
        import torch

        device = self.resolved_device()
        spelled = _DEVICE.fullmatch(device)
        assert spelled is not None  # __post_init__ checked the spelling
        if spelled["type"] != "cuda":
            return
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                raise ValueError(
                    f"device {device!r}: this torch ({torch.__version__}) is built without "
                    "CUDA; install a CUDA build of torch, or serve on the CPU (no --device)"
                )
            raise ValueError(
                f"device {device!r}: torch {torch.__version__} sees no CUDA device (driver, "
                f"or CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}?)"
            )
        count = torch.cuda.device_count()
        index = spelled["index"]
        if index is not None and int(index) >= count:
            raise ValueError(
                f"device {device!r}: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
        local_ranks = self.tensor_parallel_size // self.nnodes
        if local_ranks > count:
            raise ValueError(
                f"tensor parallelism on CUDA runs {local_ranks} ranks on this host, one GPU "
                f"each, but it has {count} CUDA device(s)"
            )

    def async_scheduling_for(self, device_type: str, batching: str) -> bool:
        """Whether steps run asynchronously on ``device_type`` with ``batching``: as set, or
        for None, on one CUDA device with continuous batching and no speculative decoding.
        Those are where it was measured faster (benchmarks/RESULTS.md). On the CPU the forward
        pass runs on the calling thread, so there is nothing to hide and each token comes a
        step later; tensor parallelism runs it only when asked (not yet measured on GPUs)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (
            device_type == "cuda"
            and batching == "continuous"
            and self.speculative is None
            and self.tensor_parallel_size == 1
        )
