"""The kernels' settings that need no torch: the environment switches that choose launches
(``PAGEDSERVE_PDL``, ``PAGEDSERVE_DECODE_MATMUL``) and the size rules the launchers and the
tuning tables share.

Imports nothing but the standard library: ``engine/config.py`` reads these switches, and the
capacity planner and the server's flag parsing import that without paying for torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "DECODE_MATMULS",
    "DECODE_MATMUL_ENV",
    "DECODE_ROWS",
    "PDL_ENV",
    "decode_matmul_env",
    "next_power_of_2",
    "pdl_env",
]

# Matmul batches of at most this many rows take the split-K decode kernel
# (kernels/quant_matmul.py): one tl.dot tile of rows (16, its minimum), so the weight is read
# once; above it the tiled kernel reuses each weight tile over 32-64 rows without partials
# to write.
DECODE_ROWS = 16
# "1": every Triton kernel of a decoder layer launches as a programmatic dependent launch
# where the device runs them; "0": none does; unset: the defaults (DECODE_TUNING's rows for
# decode attention; the fused layer ops plain). For A/B runs on a GPU (kernels/README.md).
PDL_ENV = "PAGEDSERVE_PDL"
# "triton": a CUDA engine's dense matmuls of decode batches (at most 16 rows) run the
# split-K Triton kernel (kernels/quant_matmul.dense_matmul), which with PAGEDSERVE_PDL=1
# chains with the layer's other kernels; "library" (or unset): the library's (cuBLAS). For
# A/B runs on a GPU until one is measured faster (kernels/README.md).
DECODE_MATMUL_ENV = "PAGEDSERVE_DECODE_MATMUL"
DECODE_MATMULS = ("library", "triton")


def pdl_env(environ: Mapping[str, str] | None = None) -> bool | None:
    """``PAGEDSERVE_PDL`` in ``environ`` (default: the process's): True ("1"), False ("0"),
    None (unset or empty); any other value is a ValueError naming it (the server checks it
    before anything runs, engine/config.check_environment)."""
    value = (os.environ if environ is None else environ).get(PDL_ENV, "")
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def decode_matmul_env(environ: Mapping[str, str] | None = None) -> str:
    """``PAGEDSERVE_DECODE_MATMUL`` in ``environ`` (default: the process's): "library"
    (unset or empty too) or "triton"; any other value is a ValueError naming it."""
    value = (os.environ if environ is None else environ).get(DECODE_MATMUL_ENV, "") or "library"
    if value not in DECODE_MATMULS:
        raise ValueError(f"{DECODE_MATMUL_ENV} must be library or triton, got {value!r}")
    return value


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())
