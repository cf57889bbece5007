"""The compute kernels: paged attention over the KV cache, KV stores, and the CPU fast path.

Owns: no state. Two families:

- The Triton kernels (paged decode and prefill attention, the KV store). Each exists twice
  with one signature: the plain-PyTorch reference, ``kernels.reference`` (the CPU fallback
  and the test oracle), and a Triton launcher, one file per kernel, imported explicitly by
  whoever chose it::

      from kernels.store_kv import store_kv
      from kernels.paged_attention import paged_attention_decode  # + split-K, num_splits=
      from kernels.prefill_attention import paged_attention_prefill
      from kernels.rms_norm import add_rms_norm_, rms_norm  # the decoder layer's fused ops
      from kernels.rope_and_store import rope_and_store_
      from kernels.silu_mul import silu_mul

- The C++ CPU kernels, ``kernels.cpu``: paged decode attention, the fused layer elementwise
  ops, float32 matmuls on packed weight panels and on a GGUF file's quantized blocks, and
  the fused decoder-layer stack; built on first use.

This module must not import triton, so CPU code paths never need it at import time, nor
torch: importing ``kernels.settings`` (the launch switches ``engine/config.py`` reads) runs
this file first, and the capacity planner imports that config without torch. It re-exports
only the reference *module*, loaded on first use: re-exporting its functions would clash with
the ``kernels.store_kv`` submodule of the same name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels import reference

__all__ = ["reference"]


def __getattr__(name: str) -> Any:
    if name == "reference":
        return importlib.import_module("kernels.reference")
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
