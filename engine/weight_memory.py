"""Whether a model's weights can fit the memory of the device they load onto, asked before
any weight is read.

Without the question a model larger than the machine fails late and badly: on the CPU
loading runs the host out of memory (a random fill or a checkpoint read touches page after
page) and the kernel's out-of-memory killer ends a process, which says nothing; on CUDA an
out-of-memory traceback comes from deep inside loading. The answer is a lower bound, so it
never refuses a model that would load: the weights' own bytes in the serving dtype
(``ModelConfig.num_params``; the model loads whole in that dtype even with
``--quantization``, which converts it a weight at a time afterwards), against what the
device has free now. The KV cache, activations and graphs need more on top; those are sized
after loading from what is left (engine/builder.py).

Only a hard limit refuses: a GPU's free memory, or the room under a cgroup's memory limit
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

from engine.cgroups import CGROUP_ROOT, controller_directories, read_text
from engine.config import ModelConfig, ModelError

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
    match = re.search(r"^MemAvailable:\s+(\d+) kB", read_text(meminfo) or "", re.M)
    if match is None:
        return None
    return Room(int(match.group(1)) * 1024, "available to this process (MemAvailable)", False)


# Per cgroup version: the limit's file, the memory.stat key of what the kernel cannot take
# back for a new allocation (anonymous memory: usage would also count the page cache, such
# as a checkpoint read earlier, which is reclaimed under the limit), and usage's file, read
# where memory.stat lacks the key. v1's limit reads as about 2**63 where there is none.
_V2 = ("memory.max", "anon", "memory.current")
_V1 = ("memory.limit_in_bytes", "total_rss", "memory.usage_in_bytes")
_NO_LIMIT = 2**62


def _read_int(path: Path) -> int | None:
    text = read_text(path)
    return int(text) if text is not None and text.isdigit() else None  # v2's "max": no limit


def _limit_room(directory: Path, files: tuple[str, str, str]) -> int | None:
    """Bytes left under ``directory``'s memory limit; None where it has none."""
    limit_file, stat_key, usage_file = files
    limit = _read_int(directory / limit_file)
    if limit is None or limit >= _NO_LIMIT:
        return None
    stat = read_text(directory / "memory.stat") or ""
    match = re.search(rf"^{stat_key} (\d+)$", stat, re.M)
    used = int(match.group(1)) if match else _read_int(directory / usage_file)
    return None if used is None else max(0, limit - used)


def _cgroup_room(proc_cgroup: Path, root: Path) -> Room | None:
    """The least room under a memory limit of this process's cgroup or a parent's (cgroup
    v2, or v1's memory controller)."""
    best: Room | None = None
    for directory, v2 in controller_directories("memory", ("memory",), proc_cgroup, root):
        files = _V2 if v2 else _V1
        room = _limit_room(directory, files)
        if room is not None and (best is None or room < best.bytes):
            best = Room(room, f"left under the memory limit {directory / files[0]}", True)
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
