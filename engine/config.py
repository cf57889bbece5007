"""ModelConfig: the one-time translation of a Hugging Face Llama-family config.

Model code reads only this frozen dataclass, never the HF config, so the quirks of
``transformers`` versions (``rope_scaling`` vs ``rope_parameters``, missing ``head_dim``) are
handled here, once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.spec_decode.config import SpeculativeConfig


def cache_dir() -> Path:
    """Where converted models and measured machine peaks are cached:
    ``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``."""
    root = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root).expanduser()


class ModelError(Exception):
    """A ``--model`` the user must change (not found, not local, not supported): the
    command line reports its message as one line, without a traceback."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """No local checkpoint at the given place (pagedserve never downloads one)."""


class UnsupportedModelError(ModelError, ValueError):
    """A checkpoint pagedserve cannot serve (architecture, rope scaling, file format)."""


SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}
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

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Translate a ``transformers`` config object (or its dict) once."""
        d: dict[str, Any] = hf if isinstance(hf, dict) else hf.to_dict()
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} (config.json model_type); "
                f"pagedserve serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))} models: "
                "pass a checkpoint of one of those families"
            )
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
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r} (config.json); pagedserve supports "
                f"{', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
            )
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
            ),
        )
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )

    @property
    def num_params(self) -> int:
        """Parameter count, counting tied embeddings once."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) * layers * kv heads * head dim * bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


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
        tensor_parallel_size: ranks each layer is sharded over (engine/tensor_parallel.py);
            rank 0 schedules and samples, the others follow its step plan
            (engine/tp_group.py, engine/tp_launch.py). 1: no sharding, no process group.
        nnodes, node_rank, master_addr, master_port: the torch.distributed rendezvous of a
            tensor-parallel group over several hosts (each host runs
            ``tensor_parallel_size // nnodes`` ranks; node 0 serves HTTP). On one host
            master_port 0 picks a free port. torchrun's RANK/WORLD_SIZE/MASTER_ADDR/
            MASTER_PORT, when set, take their place.
        speculative: speculative decoding (engine/spec_decode/config.py); None: off.
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
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding does not run with tensor parallelism yet")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"nnodes must divide tensor_parallel_size ({self.tensor_parallel_size} ranks "
                f"over {self.nnodes} nodes)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a tensor-parallel group over several nodes needs --master-port")
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
        if self.attention_backend not in ("auto", "triton", "cpu", "torch"):
            raise ValueError(
                "attention_backend must be auto, triton, cpu or torch, "
                f"got {self.attention_backend!r}"
            )
