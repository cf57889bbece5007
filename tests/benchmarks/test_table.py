"""Ratios, targets and the printed table of benchmarks.table, on synthetic results."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks.table import Check, checks, format_checks, format_table, ratio


def point(tok_s: float, ttft: float, tpot: float, itl_p99: float, **kw: Any) -> dict[str, Any]:
    return {
        "output_tok_s": tok_s,
        "ttft_p50_s": ttft,
        "tpot_p50_s": tpot,
        "itl_p99_s": itl_p99,
        **kw,
    }


def result(with_vllm: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "floors": {"decode_s": 0.010, "prefill_s": 0.100},
        "pagedserve": {
            "points": {
                "1": point(30.0, 0.150, 0.020, 0.030),
                "16": point(240.0, 0.400, 0.060, 0.200, mfu=0.25, overhead_fraction=0.125),
                "64": point(330.0, 1.500, 0.180, 0.900, mfu=0.40),
            }
        },
        "transformers": {
            "ttft_s": 0.200,
            "tpot_s": 0.040,
            "tok_s_c1": 20.0,
            "static_tok_s": {"16": 120.0, "64": 300.0},
        },
    }
    if with_vllm:
        out["vllm"] = {
            "points": {
                "1": point(20.0, 0.100, 0.040, 0.050),
                "16": point(160.0, 0.500, 0.080, 0.150),
                "64": point(320.0, 2.000, 0.200, 1.000),
            }
        }
    return out


def by_label(items: list[Check]) -> dict[str, Check]:
    return {item.label: item for item in items}


def test_ratio_guards_missing_and_zero() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None
    assert ratio(math.inf, 1.0) is None


def test_checks_against_speed_targets() -> None:
    items = by_label(checks(result(), [1, 16, 64]))
    static16 = items["c=16 tok/s pagedserve / transformers static b=16"]
    assert static16.value == pytest.approx(2.0) and static16.target == 1.5 and static16.passed
    static64 = items["c=64 tok/s pagedserve / transformers static b=64"]
    assert static64.value == pytest.approx(1.1) and static64.passed is False
    b1 = items["c=1 tok/s pagedserve / transformers b=1"]
    assert b1.value == pytest.approx(1.5) and b1.target is None and b1.passed is None

    assert items["c=16 tok/s pagedserve / vLLM"].value == pytest.approx(1.5)
    assert items["c=16 tok/s pagedserve / vLLM"].passed is True  # >= 1.2
    assert items["c=64 tok/s pagedserve / vLLM"].value == pytest.approx(330 / 320)
    assert items["c=64 tok/s pagedserve / vLLM"].passed is False  # < 1.1
    assert items["c=1 tok/s pagedserve / vLLM"].target is None
    assert items["c=1 TPOT p50 vLLM / pagedserve"].value == pytest.approx(2.0)
    assert items["c=1 TPOT p50 vLLM / pagedserve"].passed is True  # >= 1.6

    # TTFT and ITL p99: pagedserve must be no worse (ratio <= 1).
    assert items["c=1 TTFT p50 pagedserve / vLLM"].passed is False  # 150 vs 100 ms
    assert items["c=16 TTFT p50 pagedserve / vLLM"].passed is True
    assert items["c=16 ITL p99 pagedserve / vLLM"].value == pytest.approx(200 / 150)
    assert items["c=16 ITL p99 pagedserve / vLLM"].passed is False

    assert items["c=16 MFU pagedserve"].value == 0.25
    assert items["c=64 MFU pagedserve"].value == 0.40
    assert items["c=16 step time outside the model forward"].value == 0.125


def test_checks_without_vllm_or_phase_metrics() -> None:
    data = result(with_vllm=False)
    del data["pagedserve"]["points"]["16"]["overhead_fraction"]
    items = by_label(checks(data, [1, 16]))
    assert not any("vLLM" in label for label in items)
    overhead = items["c=16 step time outside the model forward"]
    assert overhead.value is None and overhead.passed is None
    assert "n/a" in format_checks([overhead])


def test_format_checks_shows_value_target_and_verdict() -> None:
    text = format_checks(
        [
            Check("c=16 tok/s pagedserve / vLLM", 1.5, 1.2),
            Check("c=1 TTFT p50 pagedserve / vLLM", 1.25, 1.0, op="<="),
            Check("c=16 MFU pagedserve", 0.25, unit="%"),
        ]
    )
    lines = text.splitlines()
    assert "1.50x" in lines[1] and ">= 1.2x" in lines[1] and lines[1].endswith("ok")
    assert "1.25x" in lines[2] and "<= 1x" in lines[2] and lines[2].endswith("MISSED")
    assert lines[3].endswith("25.0%")


def test_format_table_rows_per_concurrency() -> None:
    text = format_table(result(), [1, 16, 64])
    names = [line[:28].strip() for line in text.splitlines()[1:]]
    assert names == [
        "pagedserve",
        "vLLM (CPU)",
        "transformers.generate() b=1",
        "pagedserve",
        "vLLM (CPU)",
        "transformers static b=16",
        "pagedserve",
        "vLLM (CPU)",
        "transformers static b=64",
    ]
    first = text.splitlines()[1].split()
    # conc, TTFT 150 ms (1.50x the 100 ms floor), TPOT 20.0 ms (2.00x), ITL p99 30.0,
    # 30.0 tok/s, MBU 10/20 = 0.50, no server MBU, no MFU at c=1.
    assert first[1:] == ["1", "150", "1.50", "20.0", "2.00", "30.0", "30.0", "0.50", "n/a", "n/a"]
    assert "25.0%" in text.splitlines()[4]


def test_format_table_keeps_columns_apart_when_mfu_passes_100_percent() -> None:
    """An MFU above 100% (the packed matmul beats the library's ceiling) and a server MBU
    must stay two fields, as they did not when the MFU column was 6 wide."""
    r = result()
    r["pagedserve"]["points"]["16"].update(mfu=1.424, server_mbu=0.44)
    row = format_table(r, [1, 16, 64]).splitlines()[4].split()
    assert row[-2:] == ["0.44", "142.4%"]


def test_batch1_decode_checks_read_the_floor_and_each_configurations_gauge() -> None:
    """The batch-1 target two ways: TPOT against the float32 floor, and MBU on the bytes
    each configuration reads (the default's GGUF blocks; the float32-weights row's floats)."""
    data = result()
    data["pagedserve"]["points"]["1"].update(server_mbu=0.27)
    data["pagedserve_f32"] = {"points": {"1": point(25.0, 0.160, 0.013, 0.020, server_mbu=0.75)}}
    items = by_label(checks(data, [1, 16]))
    tpot = items["c=1 TPOT p50 pagedserve / decode floor"]
    assert tpot.value == pytest.approx(2.0) and tpot.op == "<=" and tpot.passed is False
    gauge = items["c=1 MBU pagedserve (gauge, bytes read)"]
    assert gauge.value == 0.27 and gauge.target == 0.7 and gauge.passed is False
    assert format_checks([gauge]).splitlines()[1].split()[-4:] == ["0.27", ">=", "0.7", "MISSED"]
    f32_tpot = items["c=1 TPOT p50 pagedserve float32 weights / decode floor"]
    assert f32_tpot.value == pytest.approx(1.3) and f32_tpot.passed is True
    assert items["c=1 MBU pagedserve float32 weights (gauge, bytes read)"].passed is True

    # the float32 row is printed at concurrency 1 only, after the default's
    names = [line[:28].strip() for line in format_table(data, [1, 16]).splitlines()[1:]]
    assert names[:3] == ["pagedserve", "pagedserve float32 weights", "vLLM (CPU)"]
    assert names.count("pagedserve float32 weights") == 1

    # without the row (--skip-float32-row), only the default's two checks
    del data["pagedserve_f32"]
    assert not any("float32 weights" in label for label in by_label(checks(data, [1])))


def test_batch1_floor_uses_the_bandwidth_probed_beside_the_point() -> None:
    """A point probed for bandwidth is judged by that bandwidth's floor, in the checks and in
    the table's xfloor and MBU columns; a point without a probe keeps the run's floor."""
    data = result()
    data["weight_bytes"] = 500e6
    # the run's first probe: 50 GB/s (decode floor 10 ms); beside the point: 25 GB/s (20 ms)
    data["pagedserve"]["points"]["1"].update(bandwidth_bytes_s=25e9)
    items = by_label(checks(data, [1, 16]))
    assert items["c=1 TPOT p50 pagedserve / decode floor"].value == pytest.approx(1.0)
    line = format_table(data, [1, 16]).splitlines()[1].split()
    # pagedserve 1 | TTFT 150 1.50 | TPOT 20.0 1.00 | ITL 30.0 | 30.0 tok/s | MBU 1.00
    assert line[0] == "pagedserve" and line[4:6] == ["20.0", "1.00"] and line[8] == "1.00"
    # vLLM's c=1 point carries no probe: the run's 10 ms floor
    vllm_line = format_table(data, [1, 16]).splitlines()[2].split()
    assert vllm_line[:2] == ["vLLM", "(CPU)"] and vllm_line[6] == "4.00"


def test_gauge_mbu_moves_to_the_bandwidth_beside_the_point() -> None:
    """The gauge divides by the peak the server read at start-up (60 GB/s here); beside the
    point the probe read 30: the same bytes/s are an MBU twice as high. Without a probe or
    a known server peak the gauge stays as read."""
    from benchmarks.table import gauge_mbu

    row = {"server_mbu": 0.4, "server_peak_bandwidth_bytes_s": 60e9, "bandwidth_bytes_s": 30e9}
    assert gauge_mbu(row) == pytest.approx(0.8)
    assert gauge_mbu({"server_mbu": 0.4, "bandwidth_bytes_s": 30e9}) == 0.4
    assert gauge_mbu({"server_mbu": 0.4, "server_peak_bandwidth_bytes_s": 60e9}) == 0.4
    assert gauge_mbu({}) is None
    data = result()
    data["pagedserve"]["points"]["1"].update(row)
    check = by_label(checks(data, [1]))["c=1 MBU pagedserve (gauge, bytes read)"]
    assert check.value == pytest.approx(0.8) and check.passed is True


def test_mbu_counts_the_bytes_each_row_reads() -> None:
    """The MBU column divides the bytes a row's decode step reads: the server's own gauge
    figure where it exported one; else, for the default pagedserve row, the run's count of
    the GGUF blocks it reads (benchmarks.speed.served_decode_weight_bytes); else (vLLM,
    transformers) the float32 weights the floor counts."""
    data = result()
    data["weight_bytes"] = 500e6  # float32: the 10 ms floor at 50 GB/s
    data["decode_weight_bytes"] = 100e6  # GGUF blocks: 2 ms
    lines = format_table(data, [1]).splitlines()
    paged, vllm = lines[1].split(), lines[2].split()
    assert paged[0] == "pagedserve" and paged[8] == "0.10"  # 2 ms / 20.0 ms TPOT
    assert vllm[:2] == ["vLLM", "(CPU)"] and vllm[9] == "0.25"  # 10 ms / 40.0 ms
    data["pagedserve"]["points"]["1"]["decode_weight_bytes"] = 150e6  # the server's gauge
    assert format_table(data, [1]).splitlines()[1].split()[8] == "0.15"
