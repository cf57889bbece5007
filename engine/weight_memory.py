"""Whether a model's weights can fit the memory of the device they load onto, asked before
any weight is read.

Without the question a model larger than the machine fails late and badly: on the CPU the
kernel's out-of-memory killer ends the process mid-load with no message (a random fill or a
checkpoint read touches page after page), on CUDA an out-of-memory traceback comes from
deep inside loading. The answer is a lower bound, so it never refuses a model that would
load: the weights' own bytes in the serving dtype (``ModelConfig.num_params``; the model
loads whole in that dtype even with ``--quantization``, which converts it a weight at a
time afterwards), against what the device has free now. The KV cache, activations and
graphs need more on top; those are sized after loading from what is left (engine/builder.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.config import ModelConfig, ModelError
from engine.threads import CGROUP_ROOT, cgroup_ancestors


class ModelTooLargeError(ModelError, ValueError):
    """The model's weights alone exceed the memory free on the device: the command line
    reports it as one line, before loading."""


def _host_available(
    meminfo: Path = Path("/proc/meminfo"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    root: Path = CGROUP_ROOT,
) -> tuple[int, str] | None:
    """Bytes the host can still give this process, and where that was read: MemAvailable,
    or the room left under a cgroup v2 memory limit (a container's ``--memory``) where
    that is less. None where neither can be read (not Linux)."""
    best: tuple[int, str] | None = None
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.M)
    except OSError:
        match = None
    if match:
        best = (int(match.group(1)) * 1024, "MemAvailable")
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if not line.startswith("0::"):  # cgroup v2's one hierarchy
            continue
        for directory in cgroup_ancestors(root, line[3:]):
            try:
                limit = (directory / "memory.max").read_text().strip()
                used = (directory / "memory.current").read_text().strip()
            except OSError:
                continue
            if limit.isdigit() and used.isdigit():
                room = max(0, int(limit) - int(used))
                if best is None or room < best[0]:
                    best = (room, f"the cgroup limit {directory / 'memory.max'}")
    return best


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """Bytes free for weights on ``device`` and a phrase naming where that was read; None
    where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type == "cpu":
        found = _host_available()
        if found is None:
            return None
        return found[0], f"available to this process ({found[1]})"
    return None


def check_weights_fit(
    model_id: str, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> None:
    """Raise ``ModelTooLargeError`` where ``model_id``'s weights in ``dtype`` are more bytes
    than ``device`` has free, naming both and what would help."""
    found = available_bytes(device)
    if found is None:
        return
    available, where = found
    params = config.num_params
    needed = params * dtype.itemsize
    if needed <= available:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    helps = ["a smaller model"]
    if dtype.itemsize > 2 and params * 2 <= available:
        helps.insert(0, "--dtype bfloat16 (half the bytes)")
    if device.type == "cuda":
        helps.insert(0, "--tensor-parallel-size N (a shard on each of N GPUs)")
    raise ModelTooLargeError(
        f"model {model_id!r} needs {needed / 2**30:.1f} GiB for its {params / 1e9:.2f}B "
        f"weights in {dtype_name}, but {available / 2**30:.1f} GiB is {where}: "
        f"try {' or '.join(helps)}"
    )
