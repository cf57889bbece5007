"""benchmarks/speed.py: the bytes its default server row is judged by, and the warning
printed when the machine's peaks were probed under load."""

from __future__ import annotations

import pytest

from benchmarks.speed import peaks_warning
from planner.cpu import CpuPeaks


def test_the_served_decode_bytes_are_the_gguf_blocks_of_the_default_model() -> None:
    """What the default server reads per decode step, counted as engine/builder.py counts
    it (112 MB of GGUF blocks and float32 norms, not 538 MB of float32 weights)."""
    from benchmarks.mfu import model_config
    from benchmarks.speed import served_decode_weight_bytes
    from engine.loader import default_model_gguf, resolve_model

    try:
        default_model_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    resolved = resolve_model("default")
    config = model_config(resolved.path)
    served = served_decode_weight_bytes(config, resolved.gguf)
    float32 = served_decode_weight_bytes(config, None)
    assert float32 == pytest.approx(538.06e6, rel=1e-3)
    assert served == pytest.approx(111.6e6, rel=1e-3)


def test_peaks_probed_under_load_print_a_warning() -> None:
    quiet = CpuPeaks(30e9, {"fp32": 300e9}, 30e9, 25e9)
    assert peaks_warning(quiet) is None
    busy = CpuPeaks(14e9, {"fp32": 90e9}, 14e9, 12e9, under_load=True, others_fraction=0.62)
    line = peaks_warning(busy)
    assert line is not None and len(line.splitlines()) == 1
    assert line.startswith("warning: CPU peaks: no quiet probe yet on this machine")
    assert "other processes used 62% of the CPUs" in line and "MBU/MFU high" in line
    unknown = CpuPeaks(14e9, {"fp32": 90e9}, 14e9, 12e9, under_load=True)
    assert "figures cached before loads were recorded" in (peaks_warning(unknown) or "")
