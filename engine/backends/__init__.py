"""Backends: a device's fast path, applied to a built and loaded model from outside.

The model (``engine/llama.py``) is plain math on PyTorch ops and runs anywhere. A backend
takes that model once it holds its weights and returns the callable the runner runs in its
place, with the model's own contract::

    forward(batch, key_caches, value_caches) -> logits   # [num_samples, vocab] float32

- ``cpu.py``: the C++ kernels of ``kernels.cpu``: packed weight panels, the checkpoint's GGUF
  blocks, every decoder layer of a step in one C++ call.
- ``cuda.py``: the model's norms and SiLU-times-up swapped for fused Triton kernels; the
  runner then replays decode steps from CUDA graphs (``engine/cuda_graphs.py``).

Without a backend the runner calls the model itself (the torch and Triton attention
backends). A backend owns the copies of the weights it makes; the model never holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

from engine.input_batch import InputBatch

# The model's forward, or a backend's replacement for it.
ModelForward: TypeAlias = Callable[
    [InputBatch, list[torch.Tensor], list[torch.Tensor]], torch.Tensor
]

__all__ = ["ModelForward"]
