"""The device table: peak dense FLOP/s per dtype, memory bandwidth, memory size, price.

Figures are the vendors' datasheet peaks **without** 2:4 structured sparsity (datasheets
print the sparse figure, twice the dense one, next to it; dense matmuls never reach it).
Memory sizes are the nameplate "GB" taken as 10^9 bytes, as the inference guide's worked
example does (24 GB - 14 GB = 10 GB); real cards usually have that many GiB (7 % more), which
the driver, the CUDA context and activations eat into, so the decimal figure is a fair
usable budget. ``--gpu-memory`` overrides it.

Prices are **examples only**: typical on-demand list prices in USD per GPU-hour (late 2024,
one public cloud or GPU cloud each); they vary by provider, region and commitment. Pass
``--price-per-hour`` for your own.

``cpu`` is not in the table: its bandwidth and FLOP/s are measured on this machine (see
:mod:`planner.cpu`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or this machine's CPU).

    Attributes:
        name: the table key, e.g. ``a10``.
        description: the marketing name and memory type.
        memory_bandwidth: peak memory bandwidth in bytes/s.
        memory_bytes: memory size in bytes (nameplate GB x 1e9).
        peak_flops: dense peak FLOP/s (or OP/s for int8) per dtype; a dtype the device has
            no fast path for is absent.
        price_per_hour: example on-demand USD per hour, or None.
        measured: True when the figures come from a measurement (``cpu``), not a datasheet.
    """

    name: str
    description: str
    memory_bandwidth: float
    memory_bytes: float
    peak_flops: Mapping[str, float] = field(hash=False)
    price_per_hour: float | None = None
    measured: bool = False


def _tflops(**per_dtype: float) -> dict[str, float]:
    return {dtype: value * TERA for dtype, value in per_dtype.items()}


# fmt: off
DEVICES: dict[str, Device] = {d.name: d for d in [
    # Turing has no bf16 and no tf32. NVIDIA's T4 page says 300 GB/s (the datasheet "320+"):
    # the guide's worked example uses 300.
    Device("t4", "NVIDIA T4 16GB GDDR6", 300 * GIGA, 16 * GIGA,
           _tflops(fp32=8.1, fp16=65, int8=130), 0.35),
    Device("a10", "NVIDIA A10 24GB GDDR6", 600 * GIGA, 24 * GIGA,
           _tflops(fp32=31.2, tf32=62.5, fp16=125, bf16=125, int8=250), 0.75),
    # AWS's variant (G5 instances): same memory, about half the tensor throughput. NVIDIA
    # publishes no datasheet; these are the commonly cited figures.
    Device("a10g", "NVIDIA A10G 24GB GDDR6 (AWS G5)", 600 * GIGA, 24 * GIGA,
           _tflops(fp32=35, tf32=35, fp16=70, bf16=70, int8=140), 1.01),
    Device("l4", "NVIDIA L4 24GB GDDR6", 300 * GIGA, 24 * GIGA,
           _tflops(fp32=30.3, tf32=60, fp16=121, bf16=121, fp8=242, int8=242), 0.71),
    Device("l40s", "NVIDIA L40S 48GB GDDR6", 864 * GIGA, 48 * GIGA,
           _tflops(fp32=91.6, tf32=183, fp16=362, bf16=362, fp8=733, int8=733), 1.00),
    Device("a100-40gb", "NVIDIA A100 40GB HBM2 (SXM4)", 1555 * GIGA, 40 * GIGA,
           _tflops(fp32=19.5, tf32=156, fp16=312, bf16=312, int8=624), 1.29),
    Device("a100-80gb", "NVIDIA A100 80GB HBM2e (SXM4)", 2039 * GIGA, 80 * GIGA,
           _tflops(fp32=19.5, tf32=156, fp16=312, bf16=312, int8=624), 1.79),
    Device("a100-80gb-pcie", "NVIDIA A100 80GB HBM2e (PCIe)", 1935 * GIGA, 80 * GIGA,
           _tflops(fp32=19.5, tf32=156, fp16=312, bf16=312, int8=624), None),
    Device("h100-sxm", "NVIDIA H100 80GB HBM3 (SXM5)", 3350 * GIGA, 80 * GIGA,
           _tflops(fp32=67, tf32=494.7, fp16=989.4, bf16=989.4, fp8=1978.9, int8=1978.9),
           2.99),
    Device("h100-pcie", "NVIDIA H100 80GB HBM2e (PCIe)", 2000 * GIGA, 80 * GIGA,
           _tflops(fp32=51, tf32=378, fp16=756, bf16=756, fp8=1513, int8=1513), 2.49),
    Device("h200", "NVIDIA H200 141GB HBM3e (SXM)", 4800 * GIGA, 141 * GIGA,
           _tflops(fp32=67, tf32=494.7, fp16=989.4, bf16=989.4, fp8=1978.9, int8=1978.9),
           3.50),
    Device("mi300x", "AMD Instinct MI300X 192GB HBM3", 5300 * GIGA, 192 * GIGA,
           _tflops(fp32=163.4, tf32=653.7, fp16=1307.4, bf16=1307.4, fp8=2614.9,
                   int8=2614.9), None),
]}
# fmt: on

DEVICE_NAMES = (*DEVICES, "cpu")

# torch.cuda.get_device_name() spellings -> table key, first match wins, so the more specific
# patterns come first ("a100" contains "a10"; "l40s" contains "l4"). Examples of real names:
# "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe",
# "NVIDIA A100-SXM4-40GB", "NVIDIA A10G", "NVIDIA A10", "NVIDIA L40S", "NVIDIA L4", "Tesla T4",
# "AMD Instinct MI300X".
_CUDA_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h200", "h200"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100-sxm"),  # SXM (HBM3) and NVL, whose figures are closer to SXM than PCIe
    (r"a100.*80\s*gb.*pcie", "a100-80gb-pcie"),
    (r"a100.*80\s*gb", "a100-80gb"),
    (r"a100", "a100-40gb"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bl40s\b", "l40s"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
    (r"mi300x", "mi300x"),
)


def device_for_cuda_name(cuda_name: str) -> Device | None:
    """The table entry for a ``torch.cuda.get_device_name()`` string, or None if unknown.

    >>> device_for_cuda_name("NVIDIA H100 80GB HBM3").name
    'h100-sxm'
    """
    lowered = cuda_name.lower()
    for pattern, key in _CUDA_NAME_PATTERNS:
        if re.search(pattern, lowered):
            return DEVICES[key]
    return None


def physical_memory_bytes() -> float:
    """This machine's RAM, the KV budget ceiling of the ``cpu`` device."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX: the planner still runs
        return 16 * GIGA


def get_device(name: str) -> Device:
    """A table entry by name (case-insensitive). ``cpu`` is built by :func:`planner.cpu`."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_NAMES)}")
    return DEVICES[key]


def with_overrides(
    device: Device,
    *,
    bandwidth_gbps: float | None = None,
    tflops: float | None = None,
    tflops_dtype: str | None = None,
    memory_gb: float | None = None,
    price_per_hour: float | None = None,
) -> Device:
    """A copy of ``device`` with the user's flags applied (the table itself never changes).

    Args:
        bandwidth_gbps: memory bandwidth in GB/s (10^9 bytes/s).
        tflops: peak TFLOP/s for ``tflops_dtype`` (the dtype the plan computes in).
        memory_gb: usable memory in GB (10^9 bytes).
        price_per_hour: USD per hour.
    """
    changes: dict[str, object] = {}
    if bandwidth_gbps is not None:
        changes["memory_bandwidth"] = bandwidth_gbps * GIGA
    if tflops is not None:
        if tflops_dtype is None:
            raise ValueError("tflops needs the dtype it applies to")
        changes["peak_flops"] = {**device.peak_flops, tflops_dtype: tflops * TERA}
    if memory_gb is not None:
        changes["memory_bytes"] = memory_gb * GIGA
    if price_per_hour is not None:
        changes["price_per_hour"] = price_per_hour
    return replace(device, **changes) if changes else device  # type: ignore[arg-type]


# --------------------------------------------------------------------------- GPU-to-GPU links


@dataclass(frozen=True, slots=True)
class Link:
    """The interconnect tensor parallelism's all-reduces cross.

    Attributes:
        name: the table key, e.g. ``nvlink4``.
        description: what it is.
        bandwidth: bytes/s one GPU can send while it receives as much (one direction; the
            datasheets' "900 GB/s" for NVLink 4 counts both directions). NCCL's "bus
            bandwidth" of a ring all-reduce approaches this figure, so
            t >= 2 (N - 1) / N * S / bandwidth for an all-reduce of S bytes over N GPUs.
    """

    name: str
    description: str
    bandwidth: float


# PCIe x16 per direction: lanes x transfer rate x 128/130 encoding / 8 bits.
# fmt: off
LINKS: dict[str, Link] = {link.name: link for link in [
    Link("nvlink4", "NVLink 4 (H100/H200 SXM: 18 links, 900 GB/s both directions)",
         450 * GIGA),
    Link("nvlink3", "NVLink 3 (A100 SXM: 12 links, 600 GB/s both directions)", 300 * GIGA),
    Link("nvlink-bridge-h100", "NVLink bridge between two H100 PCIe (600 GB/s both directions)",
         300 * GIGA),
    Link("infinity-fabric", "AMD Infinity Fabric (MI300X: 7 links, 896 GB/s both directions)",
         448 * GIGA),
    Link("pcie5", "PCIe 5.0 x16 (32 GT/s per lane)", 63 * GIGA),
    Link("pcie4", "PCIe 4.0 x16 (16 GT/s per lane)", 31.5 * GIGA),
    Link("pcie3", "PCIe 3.0 x16 (8 GT/s per lane)", 15.75 * GIGA),
]}
# fmt: on

# The link GPUs of a table entry talk over in the usual server: SXM boards through NVLink
# switches; PCIe cards through the PCIe bus of their generation (no bridge assumed).
DEFAULT_LINKS: dict[str, str] = {
    "t4": "pcie3",
    "a10": "pcie4",
    "a10g": "pcie4",
    "l4": "pcie4",
    "l40s": "pcie4",
    "a100-40gb": "nvlink3",
    "a100-80gb": "nvlink3",
    "a100-80gb-pcie": "pcie4",
    "h100-sxm": "nvlink4",
    "h100-pcie": "pcie5",
    "h200": "nvlink4",
    "mi300x": "infinity-fabric",
}


def get_link(name: str) -> Link:
    key = name.strip().lower()
    if key not in LINKS:
        raise ValueError(f"unknown link {name!r}; choose one of {', '.join(LINKS)}")
    return LINKS[key]


def default_link(device_name: str) -> Link:
    """The link of ``device_name``'s usual server; PCIe 4.0 for devices not in the table."""
    return LINKS[DEFAULT_LINKS.get(device_name, "pcie4")]
