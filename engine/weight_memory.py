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

Only a hard limit refuses: a GPU's free memory, or the room under a cgroup v2 memory limit
(a container's ``--memory``). The host's MemAvailable only warns: a virtual machine whose
memory balloon gives back pages as the guest needs them (a Firecracker microVM's) reports
less than it can hold, and a refusal there would be wrong with no way around it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig, ModelError
from engine.threads import CGROUP_ROOT, cgroup_ancestors

logger = logging.getLogger(__name__)


class ModelTooLargeError(ModelError, ValueError):
    """The model's weights alone exceed a hard limit of the device's memory: the command
    line reports it as one line, before loading."""


@dataclass(frozen=True, slots=True)
class Room:
    """Bytes free for the weights, where that was read, and whether it is a hard limit."""

    bytes: int
    where: str
    hard: bool


def _memavailable(meminfo: Path) -> Room | None:
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.M)
    except OSError:
        return None
    if match is None:
        return None
    return Room(int(match.group(1)) * 1024, "available to this process (MemAvailable)", False)


def _cgroup_room(proc_cgroup: Path, root: Path) -> Room | None:
    """The least room under a cgroup v2 memory limit of this process's group or a parent."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: Room | None = None
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
                if best is None or room < best.bytes:
                    where = f"left under the memory limit {directory / 'memory.max'}"
                    best = Room(room, where, True)
    return best


def host_rooms(
    meminfo: Path = Path("/proc/meminfo"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    root: Path = CGROUP_ROOT,
) -> list[Room]:
    """What the host can still give this process: MemAvailable (soft) and a cgroup limit's
    room (hard), each where it can be read (Linux)."""
    return [r for r in (_memavailable(meminfo), _cgroup_room(proc_cgroup, root)) if r]


def device_rooms(device: torch.device) -> list[Room]:
    """What ``device`` has free for weights; empty where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return [Room(free, f"free on {device}", True)]
    if device.type == "cpu":
        return host_rooms()
    return []


def check_weights_fit(
    model_id: str, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> None:
    """Raise ``ModelTooLargeError`` where ``model_id``'s weights in ``dtype`` are more bytes
    than a hard limit of ``device`` leaves; warn where they are more than a soft reading
    (MemAvailable). Each names both figures and what would help."""
    params = config.num_params
    needed = params * dtype.itemsize
    short = [room for room in device_rooms(device) if room.bytes < needed]
    if not short:
        return
    room = min(short, key=lambda r: (not r.hard, r.bytes))  # a hard limit first
    helps = ["a smaller model"]
    if dtype.itemsize > 2 and params * 2 <= room.bytes:
        helps.insert(0, "--dtype bfloat16 (half the bytes)")
    if device.type == "cuda":
        helps.insert(0, "--tensor-parallel-size N (a shard on each of N GPUs)")
    message = (
        f"model {model_id!r} needs {needed / 2**30:.1f} GiB for its {params / 1e9:.2f}B "
        f"weights in {str(dtype).removeprefix('torch.')}, but {room.bytes / 2**30:.1f} GiB "
        f"is {room.where}"
    )
    if room.hard:
        raise ModelTooLargeError(f"{message}: try {' or '.join(helps)}")
    logger.warning(
        "%s: loading it may run the host out of memory (the process is then killed); "
        "if it fails, try %s",
        message,
        " or ".join(helps),
    )
