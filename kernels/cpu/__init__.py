"""C++ CPU kernels: paged decode attention read in place, fused layer elementwise ops, and
a float32 matmul for decode-sized batches against weights packed into column panels, and one
against a GGUF file's own quantized blocks, de-quantized exactly in registers.

Owns: the build of the extension (compiled on first use with the machine's compiler and
``-march=native``, cached under ``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``; ``build.py`` says how a crash or a race is kept from wedging
it) and nothing else. ``PAGEDSERVE_CPU_MARCH`` names
another target (``x86-64-v3`` is AVX2 + FMA, ``x86-64`` the portable vector code): the
kernels have AVX-512, AVX2 and portable paths, and this is how a machine with AVX-512 tests
and times the other two. Each target builds under its own extension name, so the caches
never mix.

Why C++ rather than the PyTorch reference: on a CPU, the reference gathers every decoding
sequence's context into a padded copy before two batched matmuls (read, write, read again),
and a decoder layer is ~30 small ops whose dispatch and thread wake-ups cost as much as the
arithmetic at decode batch sizes. These kernels read K/V through the block table and fuse
the elementwise work; ``kernels.reference`` stays the oracle they are tested against.

``load()`` returns ``None`` (and logs why once) when the extension cannot be built, for
example without a C++ compiler: callers then use the reference.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SOURCES = (
    "paged_attention.cpp",
    "layer_ops.cpp",
    "gemm.cpp",
    "gemm_q.cpp",
    "decoder_layer.cpp",
    "register.cpp",
)
# The kernels of one decoder layer, in the order the fused stack runs them and its step
# profile (``step_profile`` / ``step_profile_read``, decoder_layer.cpp: enum StepKernel)
# reports them, then the final norm and head the stack ends with in a decode-only step.
STEP_KERNELS = (
    "input_norm",
    "qkv_proj",
    "rope_store",
    "attention",
    "o_proj",
    "post_norm",
    "gate_up_proj",
    "silu_mul",
    "down_proj",
    "head",
)
_lock = threading.Lock()
_state: dict[str, Any] = {}


def load() -> Any | None:
    """``torch.ops.pagedserve_cpu`` once built and loaded, or None if it cannot be."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        _state["ops"] = _build()
        return _state["ops"]


def _build() -> Any | None:
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        log.info("C++ CPU kernels disabled by PAGEDSERVE_CPU_KERNELS=0")
        return None
    import torch

    from kernels.cpu.build import BuildUnavailable, load_or_build, one_line

    csrc = Path(__file__).parent / "csrc"
    march = march_flag()
    safe = "".join(c if c.isalnum() else "_" for c in march)
    suffix = "" if march == "native" else "_" + safe
    try:
        _state["path"] = load_or_build(
            "pagedserve_cpu" + suffix,
            sources=[csrc / s for s in _SOURCES],
            include_dirs=[csrc],
            cflags=["-O3", f"-march={march}", "-fopenmp", "-std=c++17"],
            ldflags=["-fopenmp"],
        )
        ops = torch.ops.pagedserve_cpu
        # The team narrows to the CPUs other processes leave free (csrc/contention.h);
        # PAGEDSERVE_CPU_ADAPT_THREADS=0 keeps the whole team whatever the neighbours do.
        if os.environ.get("PAGEDSERVE_CPU_ADAPT_THREADS", "1").strip() == "0":
            ops.set_stack_adapt_threads(False)
        return ops
    except BuildUnavailable as exc:
        log.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference", exc)
    except Exception as exc:  # noqa: BLE001 - any load failure means "use the reference"
        log.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference",
                    one_line(str(exc) or type(exc).__name__))  # fmt: skip
    return None


def library_path() -> Path | None:
    """The file the loaded extension came from; None before ``load()`` or without one."""
    with _lock:
        path: Path | None = _state.get("path")
        return path


def stack_slots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The fused stack's ``weights`` layout, read from the source the extension is built
    from (``csrc/decoder_layer.cpp``): each layer's slots (``enum Slot``), then the model's
    own after the last layer (``enum HeadSlot``), each name without its ``k`` and in snake
    case (``kQkvPacked`` -> ``qkv_packed``). Callers assert that the list they build has
    this order (``engine/backends/cpu.py``); the C++ side checks only the total count."""
    text = (Path(__file__).parent / "csrc" / "decoder_layer.cpp").read_text()

    def enum(name: str) -> tuple[str, ...]:
        match = re.search(r"enum " + name + r"\s*\{(.*?)\}", text, re.S)
        if match is None:
            raise ValueError(f"decoder_layer.cpp has no enum {name}")
        body = re.sub(r"//[^\n]*", "", match.group(1))
        names = [n.strip() for n in body.split(",") if n.strip()]
        if not names or not names[-1].startswith("kNum") or "=" in "".join(names):
            raise ValueError(f"enum {name} is not a plain list ending in its count: {names}")
        return tuple(re.sub(r"(?<!^)(?=[A-Z])", "_", n[1:]).lower() for n in names[:-1])

    return enum("Slot"), enum("HeadSlot")


def march_flag() -> str:
    """The ``-march`` the extension is built for: ``native`` unless ``PAGEDSERVE_CPU_MARCH``
    names another target."""
    return os.environ.get("PAGEDSERVE_CPU_MARCH", "").strip() or "native"


def supports(*, head_dim: int, hidden_size: int, intermediate_size: int) -> bool:
    """The shapes the kernels are written for: whole vectors everywhere, of up to 16 floats
    (RoPE rotates half-rows, hence head_dim % 32), and the head sizes the attention
    instantiates."""
    return (
        head_dim in (32, 64, 96, 128, 256) and hidden_size % 16 == 0 and intermediate_size % 16 == 0
    )
