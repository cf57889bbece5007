"""The ``cpu`` device: this machine's memory bandwidth and matmul FLOP/s, measured once.

No datasheet says what a shared, virtualised CPU delivers, so it is measured: a STREAM-like
pass over a tensor far larger than the caches (reads: ``x.sum()``, a matrix-vector product
and the engine's own one-row product; a copy, ``y.copy_(x)`` counted as read + write), and a
square matmul. Each is timed a few times and
the best run is kept: the aim is the attainable peak, and other processes only ever slow a
run down. The result is cached as JSON in ``$PAGEDSERVE_CACHE/cpu_peaks.json`` (default
``~/.cache/pagedserve``), keyed by CPU model, thread count and torch version, so later plans
(and the server's MBU gauge) reuse it; ``--bandwidth-gbps`` / ``--tflops`` override it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.config import cache_dir
from planner.devices import Device, physical_memory_bytes

CACHE_FILE = "cpu_peaks.json"
# Bumped when the read probes change: a cached read bandwidth from older probes is measured
# again (2: the engine's one-row packed matmul joined x.sum() and torch.mv; 3: the probes
# read huge pages, as the engine's weights and KV cache do).
READ_PROBES_VERSION = 3
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True, slots=True)
class CpuPeaks:
    """Measured peaks of this machine.

    Attributes:
        bandwidth: best of read and copy bandwidth, bytes/s.
        flops: matmul FLOP/s per dtype that was measured.
        read_bandwidth: the best read probe (see ``measure_bandwidth``), bytes/s.
        copy_bandwidth: ``y.copy_(x)``, counting 2 x bytes, bytes/s.
    """

    bandwidth: float
    flops: dict[str, float]
    read_bandwidth: float
    copy_bandwidth: float


def cpu_fingerprint() -> str:
    """What the cached figures depend on: the CPU model, the torch threads, the torch build."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} | threads={torch.get_num_threads()} | torch={torch.__version__}"


def _best_seconds(fn: Callable[[], object], min_repeats: int, budget_s: float = 1.0) -> float:
    """Best wall time of ``fn`` over at least ``min_repeats`` runs and about ``budget_s``.

    Best, not mean: on a shared machine other work only ever makes a run slower, so the
    fastest run is the closest to what the hardware can do. The time budget buys more
    chances at a quiet moment.
    """
    fn()  # warm-up: page faults, thread-pool start, allocator
    best = float("inf")
    runs = 0
    deadline = time.perf_counter() + budget_s
    while runs < min_repeats or (time.perf_counter() < deadline and runs < 100):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best


def measure_bandwidth(
    num_bytes: int = 512 << 20, repeats: int = 5, budget_s: float = 1.0
) -> tuple[float, float]:
    """STREAM-like read and copy bandwidth over a ``num_bytes`` float32 tensor.

    Read bandwidth is the best of a reduction (``x.sum()``), a matrix-vector product over
    the same bytes, and, when the C++ CPU kernels build, the engine's own one-row product
    over packed weights: the latter two are what a batch-1 decode step does with every
    weight, and on some machines they stream memory faster than the reduction (the packed
    product's several streams per thread beat both with one thread here). A peak below what
    the model itself achieves would report an MBU above 1. For the same reason the tensors
    are on huge pages where the OS gives them, as the engine's weights and KV cache are
    (``kvpool/host_memory.py``: a reduction reads faster on 2 MiB pages than on 4 KiB ones).

    Returns:
        (read bytes/s, copy bytes/s); copy counts the bytes read plus the bytes written.
    """
    import torch

    from kvpool import host_memory

    x = host_memory.zeros((num_bytes // 4,), torch.float32).fill_(1.0)
    y = host_memory.zeros((num_bytes // 4,), torch.float32)
    matrix = x.view(-1, 1024)
    vector = torch.ones(1024)
    read_sum = num_bytes / _best_seconds(lambda: x.sum(), repeats, budget_s)
    read_mv = num_bytes / _best_seconds(lambda: torch.mv(matrix, vector), repeats, budget_s)
    copy = 2 * num_bytes / _best_seconds(lambda: y.copy_(x), repeats, budget_s)
    read = max(read_sum, read_mv, _packed_row_read(matrix, repeats, budget_s))
    return read, copy


def _packed_row_read(matrix: Any, repeats: int, budget_s: float) -> float:
    """Bytes/s of the C++ kernels' one-row product over ``matrix`` packed as a weight
    (``kernels/cpu/csrc/gemm.cpp``), or 0.0 when the kernels are not available."""
    import torch

    from kernels import cpu as cpu_kernels

    ops = cpu_kernels.load()
    if ops is None:
        return 0.0
    from kvpool import host_memory

    packed = ops.pack_weight(matrix)
    packed = host_memory.zeros(packed.shape, packed.dtype).copy_(packed)
    row = torch.ones(1, matrix.shape[0])
    n = matrix.shape[1]
    seconds = _best_seconds(lambda: ops.packed_linear(row, packed, n, None), repeats, budget_s)
    return matrix.numel() * 4 / seconds


def measure_matmul_flops(
    dtype: str = "fp32", n: int = 1024, repeats: int = 5, budget_s: float = 1.0
) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` (2 n^3 FLOPs)."""
    import torch

    torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
    a = torch.randn(n, n).to(torch_dtype)
    b = torch.randn(n, n).to(torch_dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeats, budget_s)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measure_cpu_peaks(
    dtypes: tuple[str, ...] = ("fp32",),
    *,
    refresh: bool = False,
    measure_bw: Callable[[], tuple[float, float]] | None = None,
    measure_flops: Callable[[str], float] | None = None,
) -> CpuPeaks:
    """This machine's peaks, from the cache when it has them, else measured and cached.

    Args:
        dtypes: matmul dtypes needed (``fp32``, ``bf16``, ``fp16``); only missing ones run.
        refresh: measure again even if cached.
        measure_bw / measure_flops: the measurements; None means the real ones, looked up
            at call time so tests can monkeypatch this module.
    """
    measure_bw = measure_bw or measure_bandwidth
    measure_flops = measure_flops or measure_matmul_flops
    path = cache_dir() / CACHE_FILE
    cache = _read_cache(path)
    key = cpu_fingerprint()
    entry: dict[str, Any] = {} if refresh else dict(cache.get(key) or {})
    flops: dict[str, float] = dict(entry.get("flops") or {})
    changed = False
    if (
        "read_bandwidth" not in entry
        or "copy_bandwidth" not in entry
        or entry.get("read_probes_version") != READ_PROBES_VERSION
    ):
        entry["read_bandwidth"], entry["copy_bandwidth"] = measure_bw()
        entry["read_probes_version"] = READ_PROBES_VERSION
        changed = True
    for dtype in dtypes:
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"cannot measure {dtype} matmuls on CPU; use {sorted(_TORCH_DTYPES)}")
        if dtype not in flops:
            flops[dtype] = measure_flops(dtype)
            changed = True
    if changed:
        entry["flops"] = flops
        entry["measured_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        cache[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=2, sort_keys=True), encoding="utf-8")
            tmp.replace(path)  # atomic: a concurrent reader never sees half a file
        except OSError:
            pass  # a read-only home still gets a plan, just re-measured next time
    read, copy = float(entry["read_bandwidth"]), float(entry["copy_bandwidth"])
    return CpuPeaks(
        bandwidth=max(read, copy), flops=flops, read_bandwidth=read, copy_bandwidth=copy
    )


def cpu_device(dtypes: tuple[str, ...] = ("fp32",), *, refresh: bool = False) -> Device:
    """The ``cpu`` device built from measured (or cached) peaks and this machine's RAM."""
    peaks = measure_cpu_peaks(dtypes, refresh=refresh)
    return Device(
        name="cpu",
        description=f"this machine's CPU (measured: {cpu_fingerprint()})",
        memory_bandwidth=peaks.bandwidth,
        memory_bytes=physical_memory_bytes(),
        peak_flops=dict(peaks.flops),
        price_per_hour=None,
        measured=True,
    )
