"""Which GGUF files pagedserve serves, decided from the file's metadata before converting it.

A GGUF file is served through transformers' GGUF reader (``engine/loader.py`` converts it
once into an HF checkpoint). That reader maps only some llama.cpp architectures, and maps
some of them into a model that is not the one the file holds; this module refuses those at
start-up, with one line naming the architecture, instead of after a long conversion or with
silently different weights:

- an architecture transformers converts into no family pagedserve runs (``falcon``,
  ``qwen2moe``, ...), or cannot read at all;
- Mixtral, which llama.cpp writes as ``llama`` with ``expert_count`` experts: transformers
  reads it as a dense Llama and leaves its MLPs at random initial values;
- a Qwen3 whose head_dim is not Qwen3Config's default (128): transformers' reader does not
  read ``attention.key_length`` for qwen3, and its weights then do not fit.

What transformers does read is served as transformers reads it: where its reader leaves out
a setting the file states (Gemma's ``query_pre_attn_scalar``, a RoPE scaling, Phi-3's sliding
window), both run the config class's default (README, "Model families").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import UnsupportedModelError

# general.architecture -> the model_type transformers' reader converts it to: those that
# are a family of engine/config.py's FAMILIES (tests/engine/test_gguf_families.py).
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}


def _value(field: Any) -> Any:
    """A GGUFReader field's scalar or string value, across gguf versions."""
    if hasattr(field, "contents"):
        return field.contents()
    # Older gguf: parts holds raw numpy arrays, data indexes the value's part.
    from gguf import GGUFValueType

    part = field.parts[field.data[0]]
    if field.types and field.types[-1] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def check_gguf_family(path: Path) -> str:
    """The model_type transformers will convert the GGUF file at ``path`` to.

    Raises:
        UnsupportedModelError: the file's architecture is not one pagedserve serves from
            GGUF (its message names it).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise UnsupportedModelError(
            f"could not read {str(path)!r} as a GGUF model ({exc}): pass a GGUF file or an HF "
            "directory"
        ) from exc
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    arch = str(_value(arch_field)) if arch_field is not None else "(none)"
    served = ", ".join(sorted(GGUF_ARCHITECTURES))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r} (general.architecture of {path.name}); "
            f"pagedserve serves GGUF files of {served} through transformers' GGUF reader: pass "
            "one of those, or an HF directory"
        )
    experts = fields.get(f"{arch}.expert_count")
    if arch == "llama" and experts is not None and int(_value(experts)) > 0:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture 'mixtral' ({path.name}: llama with "
            f"{int(_value(experts))} experts): transformers' GGUF reader reads it as a dense "
            "llama without its experts; pass the HF directory of the checkpoint instead"
        )
    key_length = fields.get(f"{arch}.attention.key_length")
    if arch == "qwen3" and key_length is not None:
        # transformers' reader does not map Qwen3's head_dim: Qwen3Config's default applies.
        import transformers

        default = transformers.Qwen3Config().head_dim
        if int(_value(key_length)) != default:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture 'qwen3' with head_dim {int(_value(key_length))} "
                f"({path.name}: attention.key_length): transformers' GGUF reader takes "
                f"Qwen3's default {default}; pass the HF directory of the checkpoint instead"
            )
    return GGUF_ARCHITECTURES[arch]
