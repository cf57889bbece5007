"""Host values onto the device without waiting for it.

``torch.tensor(values, device=cuda)`` synchronises with the device's queue, so the host could
not run ahead of the step it samples for (or feeds: ``engine.model_runner.feed_pending``).
Building the tensor on the host and copying it with ``non_blocking=True`` queues the copy
behind the device's work instead; on the CPU the host tensor is used as it is.
"""

from __future__ import annotations

from typing import Any

import torch


def on_device(
    device: torch.device, values: list[Any] | torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting (module docstring)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
