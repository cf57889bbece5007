"""``PAGEDSERVE_MATMUL_TUNING`` (kernels/matmul_tuning.py): the table's reader and its rules,
and ``quant_matmul`` / ``dense_matmul`` taking a decode batch's launch from it.

CPU: the Triton launches run under the interpreter (conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.quantization import quantize_weight
from kernels import quant_matmul as qm
from kernels.matmul_tuning import (
    LIBRARY,
    MATMUL_TUNING_ENV,
    SPLIT_K_FIELDS,
    parse_tuning,
)
from tests.split_k_calls import SplitKCall, record_split_k_calls

ONE = qm.SplitKLaunch(1, 256, 32, 11, 8, 3, dot=False, prefetch=True)
SIXTEEN = qm.SplitKLaunch(16, 128, 64, 11, 4, 3, dot=True)
INT8 = qm.SplitKLaunch(4, 256, 32, 16, 8, 3, dot=False)


def _entry(weight: str, k: int, n: int, rows: int, launch: Any) -> dict[str, Any]:
    if isinstance(launch, qm.SplitKLaunch):
        launch = asdict(launch)
    return {"weight": weight, "k": k, "n": n, "rows": rows, "launch": launch}


def _table(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"format": 1, "device": "NVIDIA H100 80GB HBM3", "entries": list(entries)}


def _write(tmp_path: Path, table: dict[str, Any]) -> str:
    path = tmp_path / f"tuning-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_the_table_speaks_of_split_k_launch_fields():
    assert SPLIT_K_FIELDS == tuple(f.name for f in fields(qm.SplitKLaunch))


def test_a_batch_takes_the_entry_with_the_fewest_rows_that_covers_it():
    table = parse_tuning(
        _table(
            _entry("bfloat16", 4096, 6144, 16, SIXTEEN),
            _entry("bfloat16", 4096, 6144, 1, ONE),
            _entry("int8", 4096, 6144, 4, INT8),
            _entry("bfloat16", 4096, 128256, 16, LIBRARY),
        ),
        "t.json",
    )
    assert len(table) == 4 and table.device == "NVIDIA H100 80GB HBM3"
    assert table.lookup("bfloat16", 1, 6144, 4096) == asdict(ONE)
    for rows in (2, 7, 16):
        assert table.lookup("bfloat16", rows, 6144, 4096) == asdict(SIXTEEN)
    assert table.lookup("bfloat16", 17, 6144, 4096) is None
    assert [table.lookup("int8", rows, 6144, 4096) for rows in (1, 4, 5)] == [
        asdict(INT8), asdict(INT8), None,
    ]  # fmt: skip
    assert table.lookup("bfloat16", 1, 128256, 4096) == LIBRARY
    # another shape (K and N are not interchangeable), another weight
    assert table.lookup("bfloat16", 1, 4096, 6144) is None
    assert table.lookup("float16", 1, 6144, 4096) is None
    assert table.lookup("fp8", 1, 6144, 4096) is None


def _with(launch: Any = None, **entry: Any) -> dict[str, Any]:
    base = _entry("int8", 64, 64, 1, INT8 if launch is None else launch)
    return _table({**base, **entry})


@pytest.mark.parametrize(
    "table,says",
    [
        ({"format": 2, "entries": []}, "format 1"),
        ({"format": 1, "entries": {}}, "entries must be a list"),
        (_with(block=1), "takes no ['block']"),
        (_with(rows=17), "rows must be at most 16"),
        (_with(rows=0), "rows must be a whole number >= 1"),
        (_with(k=64.0), "k must be a whole number"),
        (_with(weight="int4"), "weight must be one of int8, fp8, bfloat16"),
        (_with(LIBRARY), "an int8 weight has no library matmul"),
        (_with("cublas"), "launch must be an object of split-K fields"),
        (_with({**asdict(INT8), "block_n": 48}), "block_n must be a power of two"),
        (_with({**asdict(INT8), "num_warps": 3}), "num_warps must be a power of two"),
        (_with({**asdict(INT8), "num_splits": 0}), "num_splits must be a whole number >= 1"),
        (_with({**asdict(INT8), "dot": True}), "16 rows and 16 K"),
        (_with({**asdict(INT8), "prefetch": 1}), "prefetch must be true or false"),
        (_with({**asdict(INT8), "maxnreg": 8}), "maxnreg must be 0 (no cap) or 16-255, got 8"),
        (_with({**asdict(INT8), "maxnreg": 128.0}), "maxnreg must be a whole number >= 0"),
        (_with({k: v for k, v in asdict(INT8).items() if k != "num_stages"}),
         "needs ['num_stages']"),
        (_table(_entry("int8", 64, 64, 1, INT8), _entry("int8", 64, 64, 1, INT8)),
         "entry 1: a second entry for int8 64x64 at 1 rows"),
    ],
)  # fmt: skip
def test_a_bad_table_is_refused_saying_why(table, says):
    with pytest.raises(ValueError) as info:
        parse_tuning(table, "t.json")
    assert says in str(info.value), info.value


@pytest.fixture
def calls(monkeypatch) -> list[SplitKCall]:
    """Every split-K call the launchers make (they still run it)."""
    return record_split_k_calls(monkeypatch)


def test_the_launchers_take_the_tables_launch_where_it_has_the_shape(
    device, monkeypatch, tmp_path, calls
):
    k, n = 96, 80
    g = torch.Generator().manual_seed(0)
    w = torch.randn(k, n, generator=g)
    q, scale = (t.to(device) for t in quantize_weight(w, "int8"))
    x = torch.randn(3, k, generator=g).to(device)
    w = w.to(device)
    # Launches choose_launch would not pick (off CUDA it never splits).
    int8_one = qm.SplitKLaunch(1, 32, 32, 2, 4, 2, dot=False)
    dense_four = qm.SplitKLaunch(16, 64, 16, 3, 4, 2, dot=True, prefetch=True)
    path = _write(tmp_path, _table(
        _entry("int8", k, n, 1, int8_one), _entry("float32", k, n, 4, dense_four),
    ))  # fmt: skip
    defaults = [qm.quant_matmul(x[:m], q, scale) for m in (1, 3)]  # choose_launch's
    default_launches = [call.launch for call in calls]
    calls.clear()
    monkeypatch.setenv(MATMUL_TUNING_ENV, path)
    tuned_int8 = [qm.quant_matmul(x[:m], q, scale) for m in (1, 3)]
    tuned_dense = [qm.dense_matmul(x[:m], w) for m in (1, 3)]
    # int8: 1 row from the table, 3 rows past its entry: choose_launch's; dense: both rows
    # within the 4-row entry.
    launched = [call.launch for call in calls]
    assert launched == [int8_one, default_launches[1], dense_four, dense_four]
    # Each the product that launch gives when passed by hand.
    monkeypatch.delenv(MATMUL_TUNING_ENV)
    assert torch.equal(tuned_int8[0], qm.quant_matmul(x[:1], q, scale, launch=int8_one))
    assert torch.equal(tuned_int8[1], defaults[1])
    for m, got in zip((1, 3), tuned_dense, strict=True):
        assert torch.equal(got, qm.dense_matmul(x[:m], w, launch=dense_four))


def test_a_library_entry_sends_dense_batches_to_the_library(device, monkeypatch, tmp_path, calls):
    k, n = 96, 80
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(k, n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    x = torch.randn(2, k, generator=g).to(device)
    table = _table(_entry("float32", k, n, 16, LIBRARY))
    monkeypatch.setenv(MATMUL_TUNING_ENV, _write(tmp_path, table))
    assert torch.equal(qm.dense_matmul(x, w, b), torch.addmm(b, x, w))
    assert torch.equal(qm.dense_matmul(x[:1], w), x[:1] @ w)
    assert calls == []
    # A launch passed by hand still runs the kernel.
    qm.dense_matmul(x, w, launch=qm.SplitKLaunch(1, 32, 32, 1, 4, 2, dot=False))
    assert len(calls) == 1


def test_a_launch_may_leave_out_its_register_cap():
    """``maxnreg`` is the one field a launch may leave out (tables written before it): the
    compiler's registers then; given, it reaches the launch."""
    fields = {k: v for k, v in asdict(INT8).items() if k != "maxnreg"}
    capped = {**asdict(INT8), "maxnreg": 128}
    table = parse_tuning(_table(_entry("int8", 64, 64, 1, fields),
                                _entry("int8", 64, 64, 4, capped)), "t.json")  # fmt: skip
    assert qm.SplitKLaunch(**table.lookup("int8", 1, 64, 64)) == INT8  # type: ignore[arg-type]
    launch = qm.SplitKLaunch(**table.lookup("int8", 4, 64, 64))  # type: ignore[arg-type]
    assert launch == qm.SplitKLaunch(**capped) and launch.maxnreg == 128
