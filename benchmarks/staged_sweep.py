"""The driver the launch sweeps share (``benchmarks/decode_sweep.py``,
``benchmarks/quant_matmul_sweep.py``): stages of candidate launches timed row by row within
a time budget, then each row's best confirmed against its baseline, interleaved.

A stage is a function of a row giving the launches to time; later stages read the row's
earlier results (e.g. vary the warps of stage A's best), so every row finishes a stage before
any starts the next. The budget counts from ``start`` (the caller's, so its own set-up counts
too) and compiles are part of it: once it is spent no new launch is timed, and the rows are
confirmed only while ``confirm_reserve_s`` more are left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

Launch = TypeVar("Launch")
Launch_contra = TypeVar("Launch_contra", contravariant=True)
Out = Callable[[str], None]


def print_line(line: str) -> None:
    """The sweeps' default ``out``: each line as it comes (a run cut by a timeout keeps it)."""
    print(line, flush=True)


class SweepRow(Protocol[Launch_contra]):
    def measure(self, launch: Launch_contra, out: Out) -> None:
        """Time one launch on this row (compiling it first), print its line, keep it."""

    def confirm(self, out: Out) -> None:
        """Re-time the row's baseline and best interleaved, print the result."""


class Stages(Generic[Launch]):
    """Named stages of launches, run over rows by ``run``."""

    def __init__(self, stages: Sequence[tuple[str, Callable[..., list[Launch]]]]) -> None:
        self.stages = list(stages)

    @property
    def names(self) -> str:
        return "/".join(name for name, _ in self.stages)

    def run(
        self,
        rows: Sequence[SweepRow[Launch]],
        *,
        start: float,
        budget_s: float,
        confirm_reserve_s: float,
        confirm_note: str,
        out: Out,
        after_row: Callable[[], None] | None = None,
    ) -> None:
        """Time every stage's launches on every row, then confirm the rows (see the module
        docstring); ``after_row`` runs after each row's part of a stage (e.g. to give back
        the device memory its inputs held)."""
        skipped = 0
        for name, stage in self.stages:
            out(f"# stage {name}")
            for row in rows:
                for launch in stage(row):
                    if time.perf_counter() - start > budget_s:
                        skipped += 1
                        continue
                    row.measure(launch, out)
                if after_row is not None:
                    after_row()
        if skipped:
            out(f"# budget of {budget_s:.0f} s spent: {skipped} launches not timed")
        out(f"# confirm: {confirm_note}, interleaved")
        for row in rows:
            if time.perf_counter() - start > budget_s + confirm_reserve_s:
                out("# no time left to confirm the remaining rows")
                break
            try:
                row.confirm(out)
            except Exception as e:  # keep the first measurements; the summary still prints
                out(f"# confirm failed: {type(e).__name__}: {str(e)[:150]}")
        out(f"# sweep took {time.perf_counter() - start:.0f} s")
