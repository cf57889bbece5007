"""The ``cpu`` device: this machine's memory bandwidth and matmul FLOP/s, measured once.

No datasheet says what a shared, virtualised CPU delivers, so it is measured: a STREAM-like
pass over a tensor far larger than the caches (reads: ``x.sum()``, a matrix-vector product
and the engine's own one-row product; a copy, ``y.copy_(x)`` counted as read + write), and a
square matmul. Each is timed a few times and
the best run is kept: the aim is the attainable peak, and other processes only ever slow a
run down. The figures are cached as JSON in ``$PAGEDSERVE_CACHE/cpu_peaks.json`` (default
``~/.cache/pagedserve``), keyed by CPU model, thread count and torch version, each with when
it was measured and how much of the machine other processes used meanwhile (``/proc/stat``).
Every later call re-probes quickly and keeps the highest figure from a quiet probe: a probe
taken under load never replaces a quiet figure, and a figure known only from a busy moment
is replaced by the first quiet probe (``measure_cpu_peaks``). ``--bandwidth-gbps`` /
``--tflops`` override the figures.
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
        measured_at: when the bandwidth figure was measured (UTC, ISO 8601).
        under_load: some figure returned comes only from probes taken while other work
            used the machine (no quiet probe yet): it is likely too low.
        others_fraction: the busiest such probe's share of the machine used by others.
    """

    bandwidth: float
    flops: dict[str, float]
    read_bandwidth: float
    copy_bandwidth: float
    measured_at: str | None = None
    under_load: bool = False
    others_fraction: float | None = None

    def load_reason(self) -> str:
        """Why ``under_load`` figures are suspect, for the warning that reports them."""
        if self.others_fraction is not None:
            return f"other processes used {self.others_fraction:.0%} of the CPUs"
        return "figures cached before loads were recorded, or probes under load"


def cpu_model_name() -> str:
    """The CPU's model name as ``lscpu`` prints it (/proc/cpuinfo), or the platform's
    processor string where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_fingerprint() -> str:
    """What the cached figures depend on: the CPU model, the torch threads, the torch build."""
    import torch

    return f"{cpu_model_name()} | threads={torch.get_num_threads()} | torch={torch.__version__}"


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


# ---------------------------------------------------------------- load during a probe

# A probe counts as quiet when the rest of the machine (other processes, and the hypervisor's
# steal time) used at most this fraction of all CPUs' time while it ran. Other work only
# slows a probe down, so a figure taken under load is too low, and an MBU divided by it too
# high (the issue-33 cache said 13.8 GB/s where quiet probes read 23-33).
QUIET_MAX_OTHERS_FRACTION = 0.10
# How many probe records the cache keeps per machine, newest last (for the record only).
PROBE_HISTORY = 8
# The quick re-probe of every start that finds its figures cached: few passes, no time
# budget; it replaces a figure taken under load when it is quiet, else can only raise one.
QUICK_REPEATS = 2


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """One sample of the clocks that tell how busy the machine was between two samples.

    Attributes:
        wall_s: a monotonic clock.
        busy_s: CPU time all CPUs spent not idle (user, nice, system, irq, softirq, steal;
            ``/proc/stat``), summed over CPUs; None where /proc/stat is unreadable.
        self_s: CPU time of this process, all its threads.
        num_cpus: CPUs ``/proc/stat`` sums over.
    """

    wall_s: float
    busy_s: float | None
    self_s: float
    num_cpus: int


def read_cpu_times() -> CpuTimes:
    """The clocks now (monkeypatched in tests to fake a loaded machine)."""
    busy: float | None = None
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        if fields and fields[0] == "cpu":
            # user nice system idle iowait irq softirq steal (guest is inside user already)
            ticks = [int(v) for v in fields[1:9]]
            busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = None
    return CpuTimes(time.monotonic(), busy, time.process_time(), os.cpu_count() or 1)


def _loadavg_1m() -> float | None:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True, slots=True)
class ProbeLoad:
    """How busy the rest of the machine was while a probe ran.

    Attributes:
        others_fraction: CPU time used by other processes (and stolen by the hypervisor)
            over all CPUs' time, 0-1; None where it cannot be read (then taken as quiet:
            nothing says otherwise).
        loadavg_1m: ``/proc/loadavg`` when the probe ended (for the record: it lags by a
            minute and counts the probe itself, so it decides nothing).
    """

    others_fraction: float | None
    loadavg_1m: float | None

    @property
    def quiet(self) -> bool:
        return self.others_fraction is None or self.others_fraction <= QUIET_MAX_OTHERS_FRACTION


def _load_between(before: CpuTimes, after: CpuTimes) -> ProbeLoad:
    wall = after.wall_s - before.wall_s
    if before.busy_s is None or after.busy_s is None or wall <= 0:
        return ProbeLoad(None, _loadavg_1m())
    others = (after.busy_s - before.busy_s) - (after.self_s - before.self_s)
    fraction = min(1.0, max(0.0, others / (wall * after.num_cpus)))
    return ProbeLoad(round(fraction, 4), _loadavg_1m())


def _timed_under_load(
    probe: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, ProbeLoad]:
    """``probe(*args, **kwargs)`` and the load of the rest of the machine while it ran."""
    before = read_cpu_times()
    result = probe(*args, **kwargs)
    return result, _load_between(before, read_cpu_times())


# ---------------------------------------------------------------- the cache of figures


def _figure(value: float, load: ProbeLoad, at: str, kind: str) -> dict[str, Any]:
    return {
        "value": float(value),
        "measured_at": at,
        "quiet": load.quiet,
        "others_fraction": load.others_fraction,
        "loadavg_1m": load.loadavg_1m,
        "probe": kind,
    }


def _better(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The figure to keep: a quiet one beats one taken under load, then the higher wins
    (other work only ever slows a probe, so the highest quiet figure is the truest)."""
    if old is None or bool(new["quiet"]) != bool(old.get("quiet")):
        return new if old is None or new["quiet"] else old
    return new if new["value"] > old["value"] else old


def _entry_figures(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The cached figures of one machine by name (``read``, ``copy``, ``flops:fp32``, ...).

    An entry written before loads were recorded holds bare numbers at its top level; they
    are kept as taken under load (nothing says otherwise), so any quiet probe replaces
    them. A read or copy figure from older read probes is dropped: measured again.
    """
    figures = {
        name: dict(f)
        for name, f in (entry.get("figures") or {}).items()
        if isinstance(f, dict) and isinstance(f.get("value"), (int, float))
    }
    legacy = {
        "read": entry.get("read_bandwidth"),
        "copy": entry.get("copy_bandwidth"),
        **{f"flops:{d}": v for d, v in (entry.get("flops") or {}).items()},
    }
    for name, value in legacy.items():
        if name not in figures and isinstance(value, (int, float)):
            figures[name] = {
                "value": float(value),
                "measured_at": entry.get("measured_at") or "unknown",
                "quiet": False,
                "others_fraction": None,
                "loadavg_1m": None,
                "probe": "unrecorded",
            }
    if entry.get("read_probes_version") != READ_PROBES_VERSION:
        figures.pop("read", None)
        figures.pop("copy", None)
    return figures


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=2, sort_keys=True), encoding="utf-8")
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    except OSError:
        pass  # a read-only home still gets its figures, just measured again next time


def measure_cpu_peaks(
    dtypes: tuple[str, ...] = ("fp32",),
    *,
    refresh: bool = False,
    measure_bw: Callable[..., tuple[float, float]] | None = None,
    measure_flops: Callable[..., float] | None = None,
) -> CpuPeaks:
    """This machine's peaks: the best quiet figures measured so far, re-probed each call.

    Every figure (read and copy bandwidth, each dtype's matmul FLOP/s) is kept in the cache
    with when it was measured and how busy the rest of the machine was meanwhile
    (``ProbeLoad``). A figure missing from the cache is measured in full (about a second
    each); a cached one gets a quick re-probe (``QUICK_REPEATS`` passes, no time budget),
    skipped when every figure is quiet and the machine is busy now (``load_now``: such a
    probe could change nothing). A quiet probe replaces a figure taken under load, and
    otherwise the higher figure stays: a busy moment can lower nothing, and a later quiet
    start corrects a figure taken while the machine was busy.

    Args:
        dtypes: matmul dtypes needed (``fp32``, ``bf16``, ``fp16``).
        refresh: forget the cached figures of this machine and measure in full.
        measure_bw / measure_flops: the probes, called as ``measure_bw(**quick)`` and
            ``measure_flops(dtype, **quick)`` (``quick`` empty for a full probe); None
            means the real ones, looked up at call time so tests can monkeypatch them.
    """
    measure_bw = measure_bw or measure_bandwidth
    measure_flops = measure_flops or measure_matmul_flops
    for dtype in dtypes:
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"cannot measure {dtype} matmuls on CPU; use {sorted(_TORCH_DTYPES)}")
    path = cache_dir() / CACHE_FILE
    cache = _read_cache(path)
    key = cpu_fingerprint()
    old_entry = cache.get(key)
    old_entry = old_entry if isinstance(old_entry, dict) else {}
    figures = {} if refresh else _entry_figures(old_entry)
    history = list(old_entry.get("probes") or [])
    quick = {"repeats": QUICK_REPEATS, "budget_s": 0.0}

    def needs_full(*names: str) -> bool:
        return any(name not in figures for name in names)

    def record(kind: str, load: ProbeLoad, values: dict[str, float]) -> None:
        at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for name, value in values.items():
            figures[name] = _better(figures.get(name), _figure(value, load, at, kind))
        history.append(
            {"at": at, "probe": kind, "quiet": load.quiet, "others_fraction":
             load.others_fraction, "loadavg_1m": load.loadavg_1m, **values}
        )  # fmt: skip

    wanted = ["read", "copy", *(f"flops:{d}" for d in dtypes)]
    if all(name in figures and figures[name]["quiet"] for name in wanted) and not (
        load_now().quiet
    ):
        # Every figure is quiet and a probe now would be taken under load, so it could
        # change nothing: skip it rather than slow a busy machine's start down.
        return _peaks(figures, dtypes)
    kind = "full" if needs_full("read", "copy") else "quick"
    (read, copy), load = _timed_under_load(measure_bw, **({} if kind == "full" else quick))
    record(kind, load, {"read": read, "copy": copy})
    for dtype in dtypes:
        kind = "full" if needs_full(f"flops:{dtype}") else "quick"
        flops, load = _timed_under_load(
            measure_flops, dtype, **({} if kind == "full" else quick)
        )
        record(kind, load, {f"flops:{dtype}": flops})

    cache[key] = {
        "read_probes_version": READ_PROBES_VERSION,
        "figures": figures,
        "probes": history[-PROBE_HISTORY:],
    }
    _write_cache(path, cache)
    return _peaks(figures, dtypes)


def load_now(window_s: float = 0.2) -> ProbeLoad:
    """The load of the rest of the machine over the next ``window_s`` seconds."""
    return _timed_under_load(time.sleep, window_s)[1]


def _peaks(figures: dict[str, dict[str, Any]], dtypes: tuple[str, ...]) -> CpuPeaks:
    bandwidth = max(figures["read"], figures["copy"], key=lambda f: f["value"])
    used = [figures["read"], figures["copy"], *(figures[f"flops:{d}"] for d in dtypes)]
    loaded = [f["others_fraction"] for f in used if not f["quiet"]]
    return CpuPeaks(
        bandwidth=bandwidth["value"],
        flops={
            name.split(":", 1)[1]: f["value"]
            for name, f in figures.items()
            if name.startswith("flops:")
        },
        read_bandwidth=figures["read"]["value"],
        copy_bandwidth=figures["copy"]["value"],
        measured_at=bandwidth["measured_at"],
        under_load=bool(loaded),
        others_fraction=max((x for x in loaded if x is not None), default=None),
    )


def max_quant_rows() -> int:
    """The most rows a matmul multiplies by GGUF blocks on this machine, as the C++ kernels
    built for it decide (``kMaxQuantRows``, kernels/cpu/csrc/gemm.cpp): 64 with VNNI, 12
    with AVX-512 without it, else 8. Read from the CPU's flags and ``PAGEDSERVE_CPU_MARCH``
    (an ``x86-64-v3`` build is AVX2 on any machine), without building the kernels."""
    march = os.environ.get("PAGEDSERVE_CPU_MARCH", "").strip() or "native"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if march != "native":
        return 8  # the portable targets the README names build AVX2 without VNNI
    if "avx512f" in flags:
        return 64 if "avx512_vnni" in flags else 12
    return 64 if "avx_vnni" in flags else 8  # VNNI as the build's macros define it


def l3_cache_bytes() -> int | None:
    """The last-level (L3) cache this process's CPUs share, summed over the distinct caches
    (one per socket or core complex), from ``/sys/devices/system/cpu``; None if unknown.

    A step whose weights fit in it may read them faster than the DRAM bandwidth probe
    (512 MB, far larger), so an MBU against that probe can exceed 1 at batch 1.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    seen: dict[str, int] = {}
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    for cpu_id in cpus:
        root = Path(f"/sys/devices/system/cpu/cpu{cpu_id}/cache")
        for index in root.glob("index*"):
            try:
                if (index / "level").read_text().strip() != "3":
                    continue
                shared = (index / "shared_cpu_list").read_text().strip()
                size = (index / "size").read_text().strip()
            except OSError:
                continue
            scale = units.get(size[-1:].upper(), 1)
            digits = size[:-1] if size[-1:].upper() in units else size
            if digits.isdigit():
                seen[shared] = int(digits) * scale
    return sum(seen.values()) or None


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
