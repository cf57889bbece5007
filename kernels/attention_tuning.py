"""The decode attention kernel's tuning rows (``DecodeTuning``), and tables of them read from
a JSON file named by ``PAGEDSERVE_ATTENTION_TUNING``.

``kernels/paged_attention.DECODE_TUNING`` holds the rows every launch takes by default.
``python -m benchmarks.kernels --sweep --write-tuning FILE`` writes, on a GPU, the rows that
reproduce each swept case's fastest launch (its ``DecodeTuning`` lines); with the variable
set, ``choose_launch`` reads those rows before ``DECODE_TUNING``'s, and the server's warm-up
compiles their launches, so a sweep's findings run in the kernel benchmark and the engine in
the same session, before anyone copies them into ``DECODE_TUNING``. Like the matmul tables
(``kernels/matmul_tuning.py``) a table is for the device it was swept on: its launches run
anywhere, but are only known fastest there.

Format (``format`` 1)::

    {"format": 1, "device": "NVIDIA H100 80GB HBM3", "source": "how it was made",
     "entries": [
        {"head_dim": 128, "kv_dtype": "bfloat16", "num_heads": 32, "num_kv_heads": 8,
         "batch": 1, "context_len": 512,
         "row": {"waves_below": 0.061, "max_context_len": 512, "target_waves": 0.97,
                 "min_tokens_per_split": 32, "max_splits": 16, "one_launch": false,
                 "num_warps": 4, "num_stages": 2, "tile_n": 32, "early_v": true,
                 "prefetch_ids": true, "pdl": false},
         "us": 5.1, "default_us": 6.2},
        {"head_dim": 128, "kv_dtype": "bfloat16", "num_heads": 32, "num_kv_heads": 8,
         "batch": 64, "context_len": 512,
         "row": {"waves_below": null, "max_context_len": 512, "target_waves": 0, ...}}]}

``row`` is a ``DecodeTuning``'s fields (``waves_below`` null: any number of waves). A row
decides only calls on a cache of its ``head_dim`` and ``kv_dtype`` (the cache's element type,
by torch's name), where the entry gives them: a launch swept at one shape may not even build
at another (a tile of 128 tokens of head dim 256 in three stages needs more shared memory
than an SM has), and is only known fast at its own. The rows go in the order a call meets
them: those with a bound on waves first, in the file's order,
then ``DECODE_TUNING``'s rows but its last, then the rows for any number of waves (an
unsplit launch for a context bound: the split-K catch-all row before them still takes the
grids that underfill the device), then ``DECODE_TUNING``'s last row, which covers every call.
``num_heads``, ``num_kv_heads``, ``batch``, ``context_len``, ``us`` and ``default_us`` are
the case the sweep timed and what its best and today's launch took, for reading only.
Imports no triton: the server checks the file before anything runs
(``engine/config.check_environment``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kernels._tuning_file import (
    FORMAT,
    check_keys,
    check_whole,
    named_table,
    read_table,
    table_entries,
)
from kernels.settings import next_power_of_2

__all__ = [
    "ATTENTION_TUNING_ENV",
    "FORMAT",
    "AttentionTuning",
    "DecodeTuning",
    "KV_DTYPES",
    "TableRow",
    "attention_tuning_env",
    "load_tuning",
    "parse_tuning",
    "row_fields",
]

ATTENTION_TUNING_ENV = "PAGEDSERVE_ATTENTION_TUNING"


@dataclass(frozen=True, slots=True)
class DecodeTuning:
    """One row of ``DECODE_TUNING`` (kernels/paged_attention.py): the launch of the calls it
    covers.

    A row covers a call whose unsplit grid (``num_seqs * num_kv_heads`` programs) has fewer
    than ``waves_below`` programs per SM and whose context bound is at most
    ``max_context_len``; the first row that covers a call decides it. Its split count is 1
    when ``target_waves`` is 0, else enough splits for about ``target_waves`` programs per
    SM, at most ``max_context_len // min_tokens_per_split`` (of the call's bound) and
    ``max_splits``.
    """

    waves_below: float
    max_context_len: int
    target_waves: float
    min_tokens_per_split: int
    max_splits: int
    one_launch: bool
    num_warps: int
    num_stages: int
    tile_n: int
    early_v: bool = False
    prefetch_ids: bool = False
    pdl: bool = False


ROW_FIELDS = tuple(f.name for f in fields(DecodeTuning))
# Fields a row may leave out (DecodeTuning's defaults then: off).
_OPTIONAL_FIELDS = ("early_v", "prefetch_ids", "pdl")
_REQUIRED_FIELDS = tuple(name for name in ROW_FIELDS if name not in _OPTIONAL_FIELDS)
_BOOL_FIELDS = ("one_launch", *_OPTIONAL_FIELDS)
_WHOLE_FIELDS = ("max_context_len", "min_tokens_per_split", "max_splits", "num_warps",
                 "num_stages", "tile_n")  # fmt: skip
_ENTRY_KEYS = ("row", "head_dim", "kv_dtype", "num_heads", "num_kv_heads", "batch",
               "context_len", "us", "default_us")  # fmt: skip
# A KV cache's element types, by torch's names (kernels/kv_quant.py: int8 and fp8 rows).
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn")


def row_fields(row: DecodeTuning) -> dict[str, Any]:
    """``row`` as a table entry's ``row`` (``waves_below`` null for any number of waves)."""
    out = asdict(row)
    if math.isinf(row.waves_below):
        out["waves_below"] = None
    return out


def _number(name: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _row(raw: Any) -> DecodeTuning:
    """A ``DecodeTuning`` from a table entry's ``row``: every field, launches the kernel
    takes (powers of two, tiles of at least 16 tokens, ``pdl`` with ``prefetch_ids``)."""
    if not isinstance(raw, dict):
        raise ValueError("row is not an object")
    check_keys("row", raw, required=_REQUIRED_FIELDS, allowed=ROW_FIELDS)
    for name in _BOOL_FIELDS:
        if not isinstance(raw.get(name, False), bool):
            raise ValueError(f"{name} must be true or false, got {raw[name]!r}")
    for name in _WHOLE_FIELDS:
        check_whole(name, raw[name])
    for name in ("num_warps", "tile_n"):
        if raw[name] != next_power_of_2(raw[name]):
            raise ValueError(f"{name} must be a power of two, got {raw[name]}")
    if raw["tile_n"] < 16:
        raise ValueError(f"tile_n must be at least 16 (one tl.dot tile), got {raw['tile_n']}")
    if raw.get("pdl", False) and not raw.get("prefetch_ids", False):
        raise ValueError("pdl needs prefetch_ids (what a dependent launch loads before it waits)")
    waves = raw["waves_below"]
    values = dict(raw)
    values["waves_below"] = math.inf if waves is None else _number("waves_below", waves, True)
    values["target_waves"] = _number("target_waves", raw["target_waves"], False)
    return DecodeTuning(**values)


@dataclass(frozen=True, slots=True)
class TableRow:
    """A table's row and the calls it is for: a head dim and a KV cache element type
    (``None``: any), those it was swept at."""

    row: DecodeTuning
    head_dim: int | None = None
    kv_dtype: str | None = None  # a torch dtype's name: "bfloat16", "int8", ...

    def serves(self, head_dim: int | None, kv_dtype: str | None) -> bool:
        """Whether the row may decide a call on this cache (a caller that does not say its
        shape gets only the rows for any)."""
        return (self.head_dim is None or self.head_dim == head_dim) and (
            self.kv_dtype is None or self.kv_dtype == kv_dtype
        )


@dataclass(frozen=True, eq=False)  # hashed by identity: load_tuning makes one per file
class AttentionTuning:
    """A loaded table: its rows in the file's order."""

    source: str  # the file
    device: str  # what the file says it was swept on
    entries: tuple[TableRow, ...]

    def __len__(self) -> int:
        return len(self.entries)

    def rows(
        self, defaults: Sequence[DecodeTuning], head_dim: int | None = None,
        kv_dtype: str | None = None,
    ) -> tuple[DecodeTuning, ...]:  # fmt: skip
        """``defaults`` (``DECODE_TUNING``) with this table's rows for a cache of
        ``head_dim`` and ``kv_dtype`` in their places (the module docstring): rows with a
        bound on waves first, rows for any number of waves before the last default row,
        which stays last."""
        return _merged(self, tuple(defaults), head_dim, kv_dtype)


@functools.lru_cache(maxsize=32)  # choose_launch asks on every eager decode call
def _merged(
    table: AttentionTuning, defaults: tuple[DecodeTuning, ...], head_dim: int | None,
    kv_dtype: str | None,
) -> tuple[DecodeTuning, ...]:  # fmt: skip
    mine = [e.row for e in table.entries if e.serves(head_dim, kv_dtype)]
    first = [row for row in mine if not math.isinf(row.waves_below)]
    before_last = [row for row in mine if math.isinf(row.waves_below)]
    return (*first, *defaults[:-1], *before_last, *defaults[-1:])


def parse_tuning(data: Any, source: str) -> AttentionTuning:
    """A table from a file's decoded JSON; a ValueError says what is wrong (without the
    file's name: ``load_tuning`` adds it)."""
    entries = table_entries(data, "decode attention")
    rows: list[TableRow] = []
    for index, raw in enumerate(entries):
        where = f"entry {index}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} is not an object")
        check_keys(f"{where}:", raw, required=("row",), allowed=_ENTRY_KEYS)
        try:
            row = _row(raw["row"])
            head_dim = raw.get("head_dim")
            if head_dim is not None:
                check_whole("head_dim", head_dim)
            kv_dtype = raw.get("kv_dtype")
            if kv_dtype is not None and kv_dtype not in KV_DTYPES:
                kinds = ", ".join(KV_DTYPES)
                raise ValueError(f"kv_dtype must be one of {kinds}, got {kv_dtype!r}")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        rows.append(TableRow(row, head_dim, kv_dtype))
    return AttentionTuning(
        source=source, device=str(data.get("device", "unknown")), entries=tuple(rows)
    )


@functools.lru_cache(maxsize=4)
def load_tuning(path: str) -> AttentionTuning:
    """The table in the file at ``path`` (read once per path and process); a ValueError
    names the file and what is wrong with it."""
    return read_table(path, ATTENTION_TUNING_ENV, parse_tuning)


def attention_tuning_env(environ: Mapping[str, str] | None = None) -> AttentionTuning | None:
    """The table ``PAGEDSERVE_ATTENTION_TUNING`` in ``environ`` (default: the process's)
    names, None where it is unset or empty; a ValueError where the file cannot be read or
    is not a table."""
    return named_table(ATTENTION_TUNING_ENV, load_tuning, environ)
