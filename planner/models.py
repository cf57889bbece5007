"""Model configs for the planner: presets, HF directories and GGUF files.

Everything becomes an ``engine.config.ModelConfig`` through ``ModelConfig.from_hf`` (the one
translation of an HF config), so the planner plans exactly the model the server would load.
Only the config is read: a GGUF file's metadata, never its weights, and ``--model default``
uses the SmolLM2 preset instead of the slow GGUF conversion the server does once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.presets import PRESETS as SHAPE_PRESETS

# The engine's shape presets (engine/presets.py: the config.json of each model, also what
# ``--load-format dummy`` serves), and ``default`` for the server's embedded model.
PRESETS: dict[str, dict[str, Any]] = {**SHAPE_PRESETS, "default": SHAPE_PRESETS["smollm2-135m"]}


@dataclass(frozen=True, slots=True)
class GgufBlocks:
    """What the server's default CPU path reads instead of float32 for small batches: the
    GGUF file's own Q4/Q8 blocks (``engine/gguf_blocks.py``; ``--matmul-weights gguf``).

    Attributes:
        path: the GGUF file.
        body_block_bytes / body_float32_bytes: the decoder layers' matmuls that get blocks
            (a fused q/k/v or gate/up only when its parts share one supported type), packed
            as the kernel reads them (6 bits a weight for Q4_0/Q4_1, 9 for Q8_0), and the
            float32 bytes they replace.
        lm_head_block_bytes / lm_head_float32_bytes: the same for the LM head (the tied
            embedding table for the default model); None when it stays float32.
    """

    path: str
    body_block_bytes: int
    body_float32_bytes: int
    lm_head_block_bytes: int | None
    lm_head_float32_bytes: int

    @property
    def body_saved_bytes(self) -> int:
        return self.body_float32_bytes - self.body_block_bytes

    @property
    def lm_head_saved_bytes(self) -> int:
        if self.lm_head_block_bytes is None:
            return 0
        return self.lm_head_float32_bytes - self.lm_head_block_bytes


# Packed bits a weight of each ggml block type the C++ kernels read (kernels/cpu/csrc/gemm_q.cpp
# packs Q4 blocks with float32 scales at 6 bits a weight, Q8 ones at 9).
_PACKED_BITS = {2: 6, 3: 6, 8: 9}  # Q4_0, Q4_1, Q8_0
# The server's fused matmuls and the GGUF tensors each is made of (engine/gguf_blocks.py).
_FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def gguf_blocks(path: str | Path, config: ModelConfig) -> GgufBlocks:
    """The block bytes the server's small batches read for the GGUF file at ``path``, from
    its tensor directory only (milliseconds; no weight is read)."""
    from engine.gguf_blocks import read_tensor_index

    _, tensors = read_tensor_index(Path(path))

    def packed(names: list[str]) -> tuple[int, int] | None:
        """(block bytes, float32 bytes) of one fused matmul, or None if it stays float32."""
        infos = [tensors.get(f"{name}.weight") for name in names]
        if any(i is None or i.qtype not in _PACKED_BITS for i in infos):
            return None
        if len({i.qtype for i in infos if i is not None}) != 1:
            return None
        numel = sum(math.prod(i.shape) for i in infos if i is not None)
        return numel * _PACKED_BITS[infos[0].qtype] // 8, numel * 4  # type: ignore[union-attr]

    body_blocks = body_float32 = 0
    for layer in range(config.num_layers):
        for parts in _FUSED:
            got = packed([f"blk.{layer}.{part}" for part in parts])
            if got is not None:
                body_blocks += got[0]
                body_float32 += got[1]
    head = packed(["output" if "output.weight" in tensors else "token_embd"])
    head_float32 = config.vocab_size * config.hidden_size * 4
    return GgufBlocks(str(path), body_blocks, body_float32, head[0] if head else None, head_float32)


@dataclass(frozen=True, slots=True)
class PlannedModel:
    """A model config and where it came from (for the report).

    ``gguf`` is the GGUF file the server would read blocks from (``--model default``: the
    embedded model's, when its package is installed; a ``.gguf`` path: that file)."""

    name: str
    source: str
    config: ModelConfig
    gguf: str | None = None


def _default_gguf() -> str | None:
    from engine.config import ModelNotFoundError
    from engine.loader import default_model_gguf

    try:
        return str(default_model_gguf())
    except ModelNotFoundError:
        return None


def load_model(spec: str) -> PlannedModel:
    """Resolve ``--model``: ``default``, a preset name, an HF directory, a config.json or a GGUF.

    Raises:
        ValueError: ``spec`` is none of these.
    """
    key = spec.strip().lower()
    if key in PRESETS:
        name = "smollm2-135m" if key == "default" else key
        gguf = _default_gguf() if key == "default" else None
        return PlannedModel(name, "preset", ModelConfig.from_hf(dict(PRESETS[key])), gguf)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        hf = json.loads(path.read_text(encoding="utf-8"))
        return PlannedModel(path.parent.name or str(path), str(path), ModelConfig.from_hf(hf))
    if path.is_file() and path.suffix.lower() == ".gguf":
        config = ModelConfig.from_hf(gguf_to_hf_config(path))
        return PlannedModel(path.stem, str(path), config, str(path))
    raise ValueError(
        f"--model {spec!r} is not a preset ({', '.join(sorted(PRESETS))}), an HF directory "
        "with a config.json, or a .gguf file"
    )


def _field_value(field: Any) -> Any:
    """A GGUFReader field's Python value (scalar, string or list) across gguf versions."""
    if hasattr(field, "contents"):
        return field.contents()
    # Older gguf: parts holds raw numpy arrays, data indexes the value parts, types the kind.
    from gguf import GGUFValueType

    is_string = bool(field.types) and field.types[-1] == GGUFValueType.STRING
    values = [
        bytes(field.parts[i]).decode("utf-8") if is_string else field.parts[i].tolist()[0]
        for i in field.data
    ]
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return values
    return values[0]


def gguf_to_hf_config(path: str | Path) -> dict[str, Any]:
    """Translate a GGUF file's metadata into an HF config dict (no tensor data is read).

    GGUF stores Llama-family hyperparameters as ``{arch}.block_count``,
    ``{arch}.embedding_length`` and so on; Mistral files use ``llama`` as their arch.
    Tied embeddings show as a missing ``output.weight`` tensor.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = reader.fields

    def get(name: str, default: Any = None) -> Any:
        return _field_value(fields[name]) if name in fields else default

    arch = get("general.architecture", "llama")
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        # Older files: the vocabulary is the token list (or the embedding's row count).
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            vocab = len(tokens.data)
        else:
            embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
            vocab = int(embed.shape[-1])
    hf: dict[str, Any] = {
        "model_type": arch,  # from_hf rejects architectures the server cannot serve
        "hidden_size": hidden,
        "intermediate_size": int(get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(
            get(f"{arch}.attention.key_length")
            or get(f"{arch}.rope.dimension_count")
            or hidden // heads
        ),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get(f"{arch}.context_length", 2048)),
        "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
    }
    scaling_type = get(f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        hf["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(get(f"{arch}.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                get(f"{arch}.rope.scaling.original_context_length", hf["max_position_embeddings"])
            ),
        }
    return hf
