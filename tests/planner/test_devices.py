"""The device table and the CUDA-name lookup the metrics' MBU gauge reuses."""

from __future__ import annotations

import pytest

from planner.devices import DEVICES, device_for_cuda_name, get_device, with_overrides


@pytest.mark.parametrize(
    ("cuda_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("Tesla T4", "t4"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_cuda_names_map_to_table_entries(cuda_name: str, key: str) -> None:
    device = device_for_cuda_name(cuda_name)
    assert device is not None and device.name == key


def test_unknown_cuda_name_is_none() -> None:
    assert device_for_cuda_name("NVIDIA GeForce RTX 4090") is None


def test_table_holds_dense_not_sparse_peaks() -> None:
    # Datasheets print sparse figures (2x) beside dense ones; the table keeps the dense ones.
    assert DEVICES["h100-sxm"].peak_flops["bf16"] == pytest.approx(989.4e12)
    assert DEVICES["a100-80gb"].peak_flops["fp16"] == pytest.approx(312e12)
    assert DEVICES["a10"].peak_flops["fp16"] == pytest.approx(125e12)
    assert DEVICES["t4"].peak_flops["fp16"] == pytest.approx(65e12)
    assert "bf16" not in DEVICES["t4"].peak_flops  # Turing has no bf16
    assert "fp8" not in DEVICES["a100-80gb"].peak_flops  # nor Ampere fp8
    for device in DEVICES.values():
        # Tensor-core 16-bit beats fp32 everywhere; bandwidth and memory are sane.
        assert device.peak_flops["fp16"] > device.peak_flops["fp32"]
        assert 100e9 < device.memory_bandwidth < 10e12
        assert 8e9 < device.memory_bytes < 300e9


def test_guide_devices() -> None:
    assert DEVICES["t4"].memory_bandwidth == 300e9
    assert DEVICES["a10"].memory_bandwidth == 600e9 and DEVICES["a10"].memory_bytes == 24e9
    assert DEVICES["a100-80gb"].memory_bandwidth == 2039e9


def test_overrides_copy_the_entry() -> None:
    a10 = get_device("A10")
    changed = with_overrides(
        a10, bandwidth_gbps=500, tflops=100, tflops_dtype="fp16", memory_gb=20, price_per_hour=2.5
    )
    assert changed.memory_bandwidth == 500e9
    assert changed.peak_flops["fp16"] == 100e12
    assert changed.peak_flops["bf16"] == 125e12
    assert changed.memory_bytes == 20e9
    assert changed.price_per_hour == 2.5
    assert DEVICES["a10"].memory_bandwidth == 600e9  # the table is untouched
    assert with_overrides(a10) is a10


def test_unknown_device_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="h100-sxm"):
        get_device("b200")
