"""A table of swept decode-matmul launches, per weight format and shape, read from a JSON
file named by ``PAGEDSERVE_MATMUL_TUNING``.

``python -m benchmarks.kernels --quant-matmul --write-tuning FILE`` writes one on a GPU: for
each (weight, K, N, rows) it timed, the fastest split-K launch, or for a weight in the
activations' dtype ``"library"`` where the library's matmul was faster than every launch.
With the variable set, ``quant_matmul`` and ``dense_matmul`` take a batch's launch from the
table where it has the shape, and ``choose_launch``'s rules elsewhere (other models, other
row counts), so a sweep's findings run in the engine in the same session, before anyone
turns them into rules. Like vLLM's tuned fused-MoE configs, a table is for the device it was
swept on: the launches run anywhere, but are only known fastest there.

Format (``format`` 1)::

    {"format": 1, "device": "NVIDIA H100 80GB HBM3", "source": "how it was made",
     "entries": [
        {"weight": "bfloat16", "k": 4096, "n": 6144, "rows": 1,
         "launch": {"block_m": 1, "block_n": 256, "block_k": 32, "num_splits": 11,
                    "num_warps": 8, "num_stages": 3, "dot": false,
                    "prefetch": true, "one_launch": false},
         "us": 14.6, "library_us": 21.9},
        {"weight": "bfloat16", "k": 4096, "n": 128256, "rows": 16, "launch": "library"}]}

A launch is ``SplitKLaunch``'s fields; ``maxnreg`` (a cap on a thread's registers, 0: none)
may be left out. ``weight`` is the weight's storage: ``int8``, ``fp8`` (e4m3), or the
activations' dtype for ``dense_matmul`` (``bfloat16``, ``float16``, ``float32``). An entry
serves batches of at most ``rows`` rows down to the next smaller entry's (a batch takes the
entry with the fewest rows that still covers it); ``us`` and ``library_us`` are what the
sweep measured, for reading only. Imports no triton: the server checks the file before anything runs
(``engine/config.check_environment``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernels._tuning_file import (
    FORMAT,
    check_keys,
    check_whole,
    named_table,
    read_table,
    table_entries,
)
from kernels.settings import DECODE_ROWS, next_power_of_2

__all__ = [
    "FORMAT",
    "LIBRARY",
    "MATMUL_TUNING_ENV",
    "SPLIT_K_FIELDS",
    "WEIGHT_KINDS",
    "MatmulTuning",
    "check_split_k_fields",
    "load_tuning",
    "matmul_tuning_env",
    "parse_tuning",
]

MATMUL_TUNING_ENV = "PAGEDSERVE_MATMUL_TUNING"
# A dense weight's entry may say this instead of a launch: the library's matmul.
LIBRARY = "library"
QUANTIZED_KINDS = ("int8", "fp8")
DENSE_KINDS = ("bfloat16", "float16", "float32")
WEIGHT_KINDS = (*QUANTIZED_KINDS, *DENSE_KINDS)
# kernels.quant_matmul.SplitKLaunch's fields, in order (a test holds the two together).
SPLIT_K_FIELDS = (
    "block_m", "block_n", "block_k", "num_splits", "num_warps", "num_stages", "dot",
    "prefetch", "one_launch", "maxnreg",
)  # fmt: skip
# Fields a launch may leave out (the kernel's default then: the compiler's registers).
_OPTIONAL_FIELDS = ("maxnreg",)
# ptxas's bounds on a thread's registers (.maxnreg); 0 in a launch: no cap.
MAXNREG_RANGE = (16, 255)
_BOOL_FIELDS = ("dot", "prefetch", "one_launch")
_ENTRY_REQUIRED = ("weight", "k", "n", "rows", "launch")
_ENTRY_KEYS = (*_ENTRY_REQUIRED, "us", "library_us")  # the sweep's times, for reading

# A table's launch: SplitKLaunch's fields, or LIBRARY.
Launch = Mapping[str, int | bool] | str


def check_split_k_fields(fields: Mapping[str, Any]) -> None:
    """A split-K launch the kernel accepts, as fields: every one of ``SPLIT_K_FIELDS`` but
    ``maxnreg`` (0 or ptxas's range where given), the tile sizes powers of two, ``dot``
    tiles of at least 16 rows and 16 K, and counts of at least 1. A ValueError says what
    is wrong."""
    required = [name for name in SPLIT_K_FIELDS if name not in _OPTIONAL_FIELDS]
    check_keys("a split-K launch", fields, required=required, allowed=SPLIT_K_FIELDS)
    for name in _BOOL_FIELDS:
        if not isinstance(fields[name], bool):
            raise ValueError(f"{name} must be true or false, got {fields[name]!r}")
    for name in required:
        if name not in _BOOL_FIELDS:
            check_whole(name, fields[name])
    maxnreg = fields.get("maxnreg", 0)
    check_whole("maxnreg", maxnreg, least=0)
    low, high = MAXNREG_RANGE
    if maxnreg and not low <= maxnreg <= high:
        raise ValueError(f"maxnreg must be 0 (no cap) or {low}-{high}, got {maxnreg}")
    for name in ("block_m", "block_n", "block_k", "num_warps"):
        if fields[name] != next_power_of_2(fields[name]):
            raise ValueError(f"{name} must be a power of two, got {fields[name]}")
    if fields["dot"] and (fields["block_m"] < 16 or fields["block_k"] < 16):
        raise ValueError("tl.dot needs at least 16 rows and 16 K a tile (block_m, block_k)")


@dataclass(frozen=True, eq=False)  # hashed by identity: load_tuning makes one per file
class MatmulTuning:
    """A loaded table: (weight, k, n) -> [(rows, launch)] by rows, ascending."""

    source: str  # the file
    device: str  # what the file says it was swept on
    shapes: Mapping[tuple[str, int, int], tuple[tuple[int, Launch], ...]]

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.shapes.values())

    def lookup(self, weight: str, rows: int, n: int, k: int) -> Launch | None:
        """The launch for a batch of ``rows`` rows of ``[rows, k] @ [k, n]`` on a ``weight``
        weight: the entry with the fewest rows that covers it, or None where the table has
        no such entry."""
        for covered, launch in self.shapes.get((weight, k, n), ()):
            if rows <= covered:
                return launch
        return None


def _entry(raw: Any, index: int) -> tuple[tuple[str, int, int], int, Launch]:
    where = f"entry {index}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not an object")
    check_keys(f"{where}:", raw, required=_ENTRY_REQUIRED, allowed=_ENTRY_KEYS)
    weight = raw["weight"]
    if weight not in WEIGHT_KINDS:
        kinds = ", ".join(WEIGHT_KINDS)
        raise ValueError(f"{where}: weight must be one of {kinds}, got {weight!r}")
    try:
        for name in ("k", "n", "rows"):
            check_whole(name, raw[name])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if raw["rows"] > DECODE_ROWS:
        raise ValueError(
            f"{where}: rows must be at most {DECODE_ROWS} (more take the tiled kernel or the "
            f"library), got {raw['rows']}"
        )
    launch = raw["launch"]
    if launch == LIBRARY:
        if weight in QUANTIZED_KINDS:
            raise ValueError(f"{where}: an {weight} weight has no library matmul to take")
    elif isinstance(launch, dict):
        try:
            check_split_k_fields(launch)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        launch = dict(launch)
    else:
        raise ValueError(f"{where}: launch must be an object of split-K fields or {LIBRARY!r}")
    return (weight, raw["k"], raw["n"]), raw["rows"], launch


def parse_tuning(data: Any, source: str) -> MatmulTuning:
    """A table from a file's decoded JSON; a ValueError says what is wrong (without the
    file's name: ``load_tuning`` adds it)."""
    entries = table_entries(data, "matmul")
    shapes: dict[tuple[str, int, int], dict[int, Launch]] = {}
    for index, raw in enumerate(entries):
        key, rows, launch = _entry(raw, index)
        if rows in shapes.setdefault(key, {}):
            weight, k, n = key
            raise ValueError(f"entry {index}: a second entry for {weight} {k}x{n} at {rows} rows")
        shapes[key][rows] = launch
    return MatmulTuning(
        source=source,
        device=str(data.get("device", "unknown")),
        shapes={key: tuple(sorted(rows.items())) for key, rows in shapes.items()},
    )


@functools.lru_cache(maxsize=4)
def load_tuning(path: str) -> MatmulTuning:
    """The table in the file at ``path`` (read once per path and process); a ValueError
    names the file and what is wrong with it."""
    return read_table(path, MATMUL_TUNING_ENV, parse_tuning)


def matmul_tuning_env(environ: Mapping[str, str] | None = None) -> MatmulTuning | None:
    """The table ``PAGEDSERVE_MATMUL_TUNING`` in ``environ`` (default: the process's) names,
    None where it is unset or empty; a ValueError where the file cannot be read or is not a
    table."""
    return named_table(MATMUL_TUNING_ENV, load_tuning, environ)
