"""The peak memory bandwidth and FLOP/s that MBU and MFU divide by.

Where the figures come from, first match wins, per figure:

1. ``--peak-bandwidth-gbps`` / ``--peak-tflops`` (source ``flag``);
2. on CUDA, the device table of ``planner/devices.py`` looked up by
   ``torch.cuda.get_device_name()`` (source ``table``: datasheet peaks, dense, no sparsity);
3. on CPU, a short measurement (``planner/cpu.py``: a STREAM-like read and copy over 512 MB
   and a 1024² matmul, best of several runs, about 3 s) cached in
   ``$PAGEDSERVE_CACHE/cpu_peaks.json`` per CPU model, torch thread count and torch version,
   with when and under what load each figure was taken. Later starts re-probe quickly and
   keep the highest quiet figure; a probe taken while other processes used the machine
   never replaces a quiet one (source ``measured``). The start-up log gives the figures and
   the L3 cache size beside them;
4. otherwise unknown: MBU / MFU are not exported, and a warning says which flag to pass.

The table and the CPU measurement are the capacity planner's (``pagedserve plan``), reused
rather than copied, so a plan and a running server divide by the same peaks. ``planner``
imports nothing from the server; ``planner.devices`` is plain data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from planner.devices import GIGA, TERA, device_for_cuda_name

logger = logging.getLogger(__name__)

# torch dtype name -> the planner's dtype key of a peak FLOP/s figure. float32 matmuls are
# counted at the fp32 (not tf32) peak: torch computes them in full fp32 unless told otherwise.
_FLOPS_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True, slots=True)
class Peaks:
    """Peak figures in use and where they came from.

    Attributes:
        device: the table key (``h100-sxm``), ``cpu``, or the raw device name if unknown.
        bandwidth: bytes/s, or None if unknown.
        flops: FLOP/s in the serving dtype, or None if unknown.
        bandwidth_source / flops_source: ``flag``, ``table``, ``measured`` or ``unknown``.
    """

    device: str
    bandwidth: float | None
    flops: float | None
    bandwidth_source: str
    flops_source: str


def resolve_peaks(
    device: str,
    dtype: str,
    *,
    bandwidth_gbps: float | None = None,
    tflops: float | None = None,
) -> Peaks:
    """The peaks for a torch device string (``cpu``, ``cuda``, ``cuda:1``) and dtype name."""
    flops_dtype = _FLOPS_DTYPE.get(dtype, dtype)
    name = device
    bandwidth = bandwidth_gbps * GIGA if bandwidth_gbps is not None else None
    flops = tflops * TERA if tflops is not None else None
    bandwidth_source = "flag" if bandwidth is not None else "unknown"
    flops_source = "flag" if flops is not None else "unknown"
    if bandwidth is None or flops is None:
        found_bw, found_flops, source, name = _lookup(device, flops_dtype)
        if bandwidth is None and found_bw is not None:
            bandwidth, bandwidth_source = found_bw, source
        if flops is None and found_flops is not None:
            flops, flops_source = found_flops, source
    if bandwidth is None or flops is None:
        logger.warning(
            "no peak %s known for device %r (%s): MBU/MFU are not exported; pass %s",
            "bandwidth" if bandwidth is None else "FLOP/s",
            name,
            dtype,
            "--peak-bandwidth-gbps" if bandwidth is None else "--peak-tflops",
        )
    return Peaks(name, bandwidth, flops, bandwidth_source, flops_source)


def _lookup(device: str, flops_dtype: str) -> tuple[float | None, float | None, str, str]:
    """(bandwidth, flops, source, device name) from the table or the CPU measurement."""
    if device.startswith("cuda"):
        import torch  # only here: the server otherwise leaves tensors to the engine

        cuda_name = torch.cuda.get_device_name(device)
        entry = device_for_cuda_name(cuda_name)
        if entry is None:
            return None, None, "unknown", cuda_name
        return entry.memory_bandwidth, entry.peak_flops.get(flops_dtype), "table", entry.name
    if device == "cpu":
        from planner.cpu import l3_cache_bytes, measure_cpu_peaks

        logger.info("CPU peaks: probing (in full the first time on this machine, else quickly)")
        try:
            peaks = measure_cpu_peaks((flops_dtype,))
        except ValueError:  # a dtype the measurement does not cover: bandwidth only
            peaks = measure_cpu_peaks(())
        flops = peaks.flops.get(flops_dtype)
        l3 = l3_cache_bytes()
        logger.info(
            "CPU peaks: read %.1f GB/s, copy %.1f GB/s, %s matmul %s (bandwidth measured %s); "
            "L3 cache %s: a step whose weights fit in it can read faster than the DRAM "
            "probe, so batch-1 MBU may exceed 1",
            peaks.read_bandwidth / GIGA,
            peaks.copy_bandwidth / GIGA,
            flops_dtype,
            f"{flops / GIGA:.0f} GFLOP/s" if flops else "not measured",
            peaks.measured_at,
            f"{l3 / 2**20:.0f} MiB" if l3 else "size unknown",
        )
        if peaks.under_load:
            logger.warning(
                "CPU peaks: no quiet probe yet on this machine (%s): the figures may be low "
                "and MBU/MFU high; the next start on a quieter machine replaces them",
                peaks.load_reason(),
            )
        return peaks.bandwidth, flops, "measured", "cpu"
    return None, None, "unknown", device
