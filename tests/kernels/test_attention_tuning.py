"""``PAGEDSERVE_ATTENTION_TUNING`` (kernels/attention_tuning.py): the table's reader and its
rules, ``choose_launch`` reading its rows in their places before ``DECODE_TUNING``'s, and the
warm-up's launches including them. The decode kernel running a table's launches is checked
in tests/engine/test_triton_backend.py (greedy tokens against transformers)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import kernels.paged_attention as decode_module
from kernels.attention_tuning import (
    ATTENTION_TUNING_ENV,
    DecodeTuning,
    parse_tuning,
    row_fields,
)
from kernels.paged_attention import DECODE_TUNING, DecodeLaunch, choose_launch, tuned_launches

CUDA = torch.device("cuda")
# The 1 x 512 case of an H100 (132 SMs, 8 KV heads): 8 splits of 64 tokens, early V loads
# and prefetched ids; it covers grids of at most 8 programs over contexts of <= 512.
SHORT = DecodeTuning(
    waves_below=0.061, max_context_len=512, target_waves=0.485, min_tokens_per_split=64,
    max_splits=8, one_launch=True, num_warps=2, num_stages=1, tile_n=64, early_v=True,
    prefetch_ids=True,
)  # fmt: skip
# An unsplit launch for every grid over contexts of <= 512 (the batch-64 x 512 case).
UNSPLIT = DecodeTuning(
    waves_below=math.inf, max_context_len=512, target_waves=0, min_tokens_per_split=64,
    max_splits=1, one_launch=False, num_warps=8, num_stages=2, tile_n=128,
)  # fmt: skip


def _table(*rows: DecodeTuning | dict[str, Any]) -> dict[str, Any]:
    entries = [{"row": row_fields(r) if isinstance(r, DecodeTuning) else r} for r in rows]
    return {"format": 1, "device": "NVIDIA H100 80GB HBM3", "source": "test", "entries": entries}


def _use(monkeypatch, tmp_path: Path, table: dict[str, Any]) -> str:
    path = tmp_path / f"attention-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(ATTENTION_TUNING_ENV, str(path))
    return str(path)


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)


def test_a_row_goes_through_the_file_unchanged():
    table = parse_tuning(json.loads(json.dumps(_table(SHORT, UNSPLIT))), "t.json")
    assert [e.row for e in table.entries] == [SHORT, UNSPLIT]
    assert len(table) == 2 and table.device == "NVIDIA H100 80GB HBM3"
    assert row_fields(UNSPLIT)["waves_below"] is None  # JSON has no infinity


def test_rows_with_a_bound_on_waves_go_first_and_the_others_before_the_last():
    """The split-K catch-all row (fewer than 2 waves) still takes small grids of a context an
    unsplit row covers, and the last default row still covers every call."""
    table = parse_tuning(_table(UNSPLIT, SHORT), "t.json")
    rows = table.rows(DECODE_TUNING)
    assert rows == (SHORT, *DECODE_TUNING[:-1], UNSPLIT, DECODE_TUNING[-1])
    assert table.rows(DECODE_TUNING) is rows  # cached: choose_launch asks on every call


def test_a_row_swept_at_a_shape_decides_only_calls_on_such_a_cache(monkeypatch, tmp_path, h100):
    """An entry's head_dim and kv_dtype (what the sweep ran at) bound the calls its row
    decides: another head dim or cache type, or a caller that does not say, keeps
    DECODE_TUNING's launch (a swept launch may not even build at another shape)."""
    plain = choose_launch(1, 8, 512, CUDA, head_dim=128, kv_dtype=torch.bfloat16)
    entry = {"row": row_fields(SHORT), "head_dim": 128, "kv_dtype": "bfloat16"}
    _use(monkeypatch, tmp_path, {"format": 1, "device": "d", "entries": [entry]})
    tuned = DecodeLaunch(8, True, 2, 1, 64, True, True)
    assert choose_launch(1, 8, 512, CUDA, head_dim=128, kv_dtype=torch.bfloat16) == tuned
    for head_dim, kv_dtype in ((256, torch.bfloat16), (128, torch.float16),
                               (128, torch.int8), (None, None)):  # fmt: skip
        chosen = choose_launch(1, 8, 512, CUDA, head_dim=head_dim, kv_dtype=kv_dtype)
        assert chosen == plain, (head_dim, kv_dtype)
    assert tuned not in tuned_launches(head_dim=64, kv_dtype=torch.bfloat16)
    assert replace(tuned, num_splits=1, one_launch=False) in tuned_launches(
        head_dim=128, kv_dtype=torch.bfloat16
    )


def test_choose_launch_takes_the_tables_rows(monkeypatch, tmp_path, h100):
    before = {
        case: choose_launch(*case, CUDA)
        for case in ((1, 8, 512), (24, 8, 512), (64, 8, 512), (64, 8, 4096))
    }
    _use(monkeypatch, tmp_path, _table(SHORT, UNSPLIT))
    assert choose_launch(1, 8, 512, CUDA) == DecodeLaunch(8, True, 2, 1, 64, True, True)
    assert choose_launch(64, 8, 512, CUDA) == DecodeLaunch(1, False, 8, 2, 128)
    # Cases neither row covers keep DECODE_TUNING's launches: 24 x 512 is under 2 waves
    # (the split-K catch-all row), 64 x 4,096 is past the rows' contexts.
    for case in ((24, 8, 512), (64, 8, 4096)):
        assert choose_launch(*case, CUDA) == before[case], case
    monkeypatch.delenv(ATTENTION_TUNING_ENV)
    assert choose_launch(1, 8, 512, CUDA) == before[(1, 8, 512)]


def test_the_warm_up_compiles_the_tables_launches(monkeypatch, tmp_path):
    """compile_variants compiles tuned_launches(): with a table, its rows' launches too (an
    unsplit one, and each split bound of a split row), so no request meets a compile."""
    plain = set(tuned_launches())
    _use(monkeypatch, tmp_path, _table(SHORT, UNSPLIT))
    added = set(tuned_launches()) - plain
    params = (2, 1, 64, True, True, False)
    assert added == {DecodeLaunch(1, False, *params), DecodeLaunch(2, True, *params),
                     DecodeLaunch(3, True, *params), DecodeLaunch(5, True, *params),
                     DecodeLaunch(1, False, 8, 2, 128)}  # fmt: skip


def _bad(**change: Any) -> dict[str, Any]:
    fields = row_fields(SHORT)
    fields.update(change)
    return {name: value for name, value in fields.items() if value != "drop"}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"format": 2, "entries": []}, "not a decode attention tuning table of format 1"),
        ([], "not a decode attention tuning table"),
        ({"format": 1, "entries": {}}, "entries must be a list"),
        ({"format": 1, "entries": [3]}, "entry 0 is not an object"),
        ({"format": 1, "entries": [{"batch": 1}]}, r"entry 0: needs \['row'\]"),
        ({"format": 1, "entries": [{"row": row_fields(SHORT), "speed": 1}]},
         r"entry 0: takes no \['speed'\]"),
        (_table(_bad(tile_n="drop")), r"entry 0: row needs \['tile_n'\]"),
        (_table(_bad(splits=4)), r"entry 0: row takes no \['splits'\]"),
        (_table(_bad(num_warps=3)), "num_warps must be a power of two, got 3"),
        (_table(_bad(tile_n=8)), "tile_n must be at least 16"),
        (_table(_bad(max_splits=0)), "max_splits must be a whole number >= 1, got 0"),
        (_table(_bad(num_stages=True)), "num_stages must be a whole number >= 1, got True"),
        (_table(_bad(one_launch=1)), "one_launch must be true or false, got 1"),
        (_table(_bad(waves_below=0)), "waves_below must be > 0, got 0"),
        (_table(_bad(waves_below="many")), "waves_below must be a number, got 'many'"),
        (_table(_bad(target_waves=-1)), "target_waves must be >= 0, got -1"),
        (_table(_bad(pdl=True, prefetch_ids=False)), "pdl needs prefetch_ids"),
        ({"format": 1, "entries": [{"row": row_fields(SHORT), "head_dim": 0}]},
         "entry 0: head_dim must be a whole number >= 1, got 0"),
        ({"format": 1, "entries": [{"row": row_fields(SHORT), "kv_dtype": "bf16"}]},
         "entry 0: kv_dtype must be one of float32, .*, got 'bf16'"),
    ],
)  # fmt: skip
def test_what_is_wrong_with_a_table_is_said(table, message):
    with pytest.raises(ValueError, match=message):
        parse_tuning(table, "t.json")


def test_the_optional_fields_default_as_in_decode_tuning():
    fields = {k: v for k, v in row_fields(SHORT).items()
              if k not in ("early_v", "prefetch_ids", "pdl")}  # fmt: skip
    table = parse_tuning(_table(fields), "t.json")
    assert [e.row for e in table.entries] == [replace(SHORT, early_v=False, prefetch_ids=False)]
    assert (table.entries[0].head_dim, table.entries[0].kv_dtype) == (None, None)
