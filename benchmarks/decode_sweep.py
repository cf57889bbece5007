"""Launch sweep of the Triton decode kernel (``python -m benchmarks.kernels --sweep``).

For each of the issue's decode rows (Llama-3-8B shape, bf16, ``TARGET_ROWS``) it times launches
of ``kernels.paged_attention.paged_attention_decode`` (``launch=DecodeLaunch(...)``) as CUDA
graphs, exactly as ``--targets`` times the default one, and prints per row the fastest launch
beside today's (the launch ``DECODE_TUNING`` picks), with its time and % of HBM peak, and a
``DecodeTuning`` row to start the table from.

The grid is searched in stages, all rows at each stage before the next, so that a run cut
short still has every row's first stage::

    A  merge {one-launch, two-launch} x split counts {1, 2, 4, ..., 64} (whole tiles of the
       context, at most 8 waves of programs), at today's warps / stages / tile
    B  num_warps {2, 4, 8} x num_stages {1, 2, 3} at each row's best of A
    C  tile {32, 128} tokens at the best of B (and twice its splits at 32; both merges
       when it is unsplit)
    D  the best of C with each tile's V load issued beside its K load (``early_v``), or
       not: one round trip less per tile where nothing pipelines the loads (1 stage)
    E  the best of D with the first tile's block ids loaded beside the context length
       (``prefetch_ids``), and that as programmatic dependent launches (``pdl``, where
       the GPU runs them): a short split's chain of dependent round trips, shortened

Every timing line is printed (and flushed) as it is measured, with the launch's error
against the reference (``MISMATCH`` launches are never "best"; a launch that fails to
compile or run prints its error and the sweep goes on). ``--budget-s`` bounds the stages,
compiles included: past it, the remaining launches are skipped. Then each row's best and
today's launch are timed again, interleaved (A, B, A, B: the figures compared come from the
same minutes), and the summary printed.

``--sweep-rows`` replaces the issue's rows with others, e.g. ``64x512,256x512``: the engine's
decode steps at batch 64 and 256 over 512-token contexts (issue 35's batch-64 step, 1.36x
its floor against 1.3x; their attention is the unsplit catch-all launch, never swept).

CPU: only with ``TRITON_INTERPRET=1`` (``--quick``: one small row, or ``--sweep-rows`` at the
small shape, stage A at two split counts, timed by wall clock: a smoke test of this code, not
a measurement).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.decode_cases import (
    TARGET_ROWS,
    Config,
    Inputs,
    make_inputs,
    num_input_sets,
    time_sets,
)
from benchmarks.staged_sweep import Stages, print_line
from kernels import reference

if TYPE_CHECKING:
    from kernels.paged_attention import DecodeLaunch, DecodeTuning

SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (1, 2, 3)
SWEEP_TILES = (32, 128)  # besides today's
# Split counts whose grid stays within this many programs per SM (more only adds partials).
MAX_SWEEP_WAVES = 8
# |launch - reference| above this (bf16 outputs of magnitude <= ~1) marks a wrong launch.
MISMATCH_ABOVE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
DEFAULT_BUDGET_S = 100.0
# The confirmation step (two more timings of two launches per row) runs within this much
# past the budget: its launches are compiled already, so it takes a few seconds.
CONFIRM_RESERVE_S = 20.0


@dataclass
class Measured:
    launch: DecodeLaunch
    seconds: float
    error: float
    ok: bool


def effective(launch: DecodeLaunch, context_len: int) -> DecodeLaunch:
    """The launch as the launcher runs it: splits rounded to whole tiles and recounted, and
    an unsplit launch's merge mode normalised (it has none)."""
    per_split = -(-context_len // launch.num_splits)
    tokens = max(launch.tile_n, -(-per_split // launch.tile_n) * launch.tile_n)
    num_splits = max(1, -(-context_len // tokens))
    return replace(launch, num_splits=num_splits, one_launch=launch.one_launch and num_splits > 1)


def describe(launch: DecodeLaunch) -> str:
    merge = "unsplit" if launch.num_splits == 1 else ("one" if launch.one_launch else "two")
    return (f"{merge:<7} splits={launch.num_splits:<2} w={launch.num_warps} "
            f"s={launch.num_stages} tile={launch.tile_n:<3}"
            f"{' early-v' if launch.early_v else '':<8}"
            f"{' ids' if launch.prefetch_ids else '':<4}"
            f"{' pdl' if launch.pdl else '':<4}")  # fmt: skip


class RowSweep:
    """One decode row: its inputs, reference output and every launch measured on it."""

    def __init__(self, cfg: Config, device: torch.device, peak: float | None, quick: bool) -> None:
        from kernels.paged_attention import choose_launch

        self.cfg = cfg
        self.device = device
        self.peak = peak  # GB/s
        self.scale = cfg.head_dim**-0.5
        count = 1 if quick else num_input_sets(cfg.bytes_moved(), device)
        self.sets = [make_inputs(cfg, device) for _ in range(count)]
        x = self.sets[0]
        self.expected = reference.paged_attention_decode(
            x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, self.scale
        ).float()
        tuned = choose_launch(cfg.batch, cfg.num_kv_heads, cfg.context_len, device,
                              head_dim=cfg.head_dim, kv_dtype=x.key_cache.dtype)  # fmt: skip
        self.default = effective(tuned, cfg.context_len)
        self.results: dict[DecodeLaunch, Measured] = {}
        # Each line's case: batch x context, and the heads where the sweep has more shapes.
        self.shape = ""

    @property
    def case(self) -> str:
        return f"{self.cfg.batch:>4} x {self.cfg.context_len:<5}{self.shape}"

    def valid_splits(self, tile_n: int) -> list[int]:
        """Split counts of whole tiles, within MAX_SWEEP_WAVES of programs per SM."""
        from kernels._common import num_compute_units

        programs = self.cfg.batch * self.cfg.num_kv_heads
        max_programs = max(programs, MAX_SWEEP_WAVES * num_compute_units(self.device))
        tiles = -(-self.cfg.context_len // tile_n)
        return [n for n in SWEEP_SPLITS if n <= tiles and programs * n <= max_programs]

    def best(self) -> Measured | None:
        ok = [m for m in self.results.values() if m.ok]
        return min(ok, key=lambda m: m.seconds) if ok else None

    def impl(self, launch: DecodeLaunch) -> Callable[[Inputs], torch.Tensor]:
        from kernels.paged_attention import paged_attention_decode

        return lambda i: paged_attention_decode(
            i.query, i.key_cache, i.value_cache, i.block_tables, i.seq_lens, self.scale,
            launch=launch,
        )  # fmt: skip

    def measure(self, launch: DecodeLaunch, out: Callable[[str], None]) -> None:
        """Time ``launch`` (as the launcher will run it) unless it was, and print the line."""
        launch = effective(launch, self.cfg.context_len)
        if launch in self.results:
            return
        label = f"{self.case} {describe(launch)}"
        try:
            seconds = time_sets(self.impl(launch), self.sets, self.device)
            error = float((self.impl(launch)(self.sets[0]).float() - self.expected).abs().max())
        except Exception as e:  # a launch the device cannot run (shared memory, registers)
            out(f"{label}  failed: {type(e).__name__}: {str(e)[:150]}")
            self.results[launch] = Measured(launch, math.inf, math.inf, False)
            return
        ok = error <= MISMATCH_ABOVE[self.cfg.dtype]
        self.results[launch] = Measured(launch, seconds, error, ok)
        mark = " default" if launch == self.default else ""
        out(f"{label} {seconds * 1e6:>9.1f} us {self.percent(seconds):>7} "
            f"err {error:.1e}{'' if ok else ' MISMATCH'}{mark}")  # fmt: skip

    def confirm(self, out: Callable[[str], None]) -> None:
        """Time today's launch and the best again, interleaved (A, B, A, B), so the two
        figures the summary compares come from the same minutes; each keeps its least."""
        best = self.best()
        default = self.results.get(self.default)
        if best is None or default is None or not default.ok or best.launch == self.default:
            return
        for _ in range(2):
            for m in (default, best):
                m.seconds = min(m.seconds, time_sets(self.impl(m.launch), self.sets, self.device))
        out(f"{self.case} today {default.seconds * 1e6:.1f} "
            f"us, best {best.seconds * 1e6:.1f} us")  # fmt: skip

    def percent(self, seconds: float) -> str:
        """Achieved bandwidth as a fraction of peak (the bytes ``--targets`` counts)."""
        if not self.peak or not math.isfinite(seconds):
            return "n/a"
        return f"{100 * self.cfg.bytes_moved() / seconds / 1e9 / self.peak:.1f}%"


def stage_a(row: RowSweep) -> list[DecodeLaunch]:
    """Today's launch, then each merge at each split count at today's launch parameters."""
    from kernels.paged_attention import DecodeLaunch

    d = row.default
    launches = [d]
    for n in row.valid_splits(d.tile_n):
        for one_launch in (True, False):
            launches.append(DecodeLaunch(n, one_launch, d.num_warps, d.num_stages, d.tile_n))
    return launches


def stage_b(row: RowSweep) -> list[DecodeLaunch]:
    best = row.best()
    if best is None:
        return []
    return [replace(best.launch, num_warps=w, num_stages=s)
            for w in SWEEP_WARPS for s in SWEEP_STAGES]  # fmt: skip


def stage_c(row: RowSweep) -> list[DecodeLaunch]:
    """Other tiles at the best of B: its split count, and twice it with a smaller tile (an
    unsplit best then tries both merges)."""
    best = row.best()
    if best is None:
        return []
    b = best.launch
    merges = (b.one_launch,) if b.num_splits > 1 else (True, False)
    launches: list[DecodeLaunch] = []
    for tile in SWEEP_TILES:
        counts = [b.num_splits] + ([2 * b.num_splits] if tile < b.tile_n else [])
        for n in counts:
            if n == 1 or n in row.valid_splits(tile):
                launches += [replace(b, num_splits=n, tile_n=tile, one_launch=m) for m in merges]
    return launches


def stage_d(row: RowSweep) -> list[DecodeLaunch]:
    """The best of C with each tile's V load issued beside its K load, or not (the other
    way from the best's)."""
    best = row.best()
    if best is None:
        return []
    return [replace(best.launch, early_v=not best.launch.early_v)]


def stage_e(row: RowSweep) -> list[DecodeLaunch]:
    """The best of D with its first tile's block ids prefetched, and that launched as
    programmatic dependent launches where the device runs them."""
    from kernels.paged_attention import pdl_supported

    best = row.best()
    if best is None:
        return []
    ahead = replace(best.launch, prefetch_ids=True, pdl=False)
    return [ahead] + ([replace(ahead, pdl=True)] if pdl_supported(row.device) else [])


def suggested_tuning(row: RowSweep, sms: int) -> DecodeTuning:
    """A ``DecodeTuning`` reproducing the row's best launch at its own shape: a row for
    calls of at most its context and fewer waves of programs (unsplit grid) than its own, to
    go first. An unsplit best where the unsplit grid has ``SPLIT_BELOW_WAVES`` waves or more
    (the split-K catch-all row covers fewer) is instead a row for any number of waves
    (``waves_below`` infinite), to go just before the last row, so that smaller batches of
    that context still split (kernels/attention_tuning.py places such rows there)."""
    from kernels.paged_attention import MIN_TOKENS_PER_SPLIT, SPLIT_BELOW_WAVES, DecodeTuning

    b = row.best().launch
    waves = row.cfg.batch * row.cfg.num_kv_heads / sms
    below = math.floor(waves * 1000 + 1) / 1000
    if b.num_splits == 1:
        if waves >= SPLIT_BELOW_WAVES:
            below = math.inf
        target, min_tokens = 0.0, MIN_TOKENS_PER_SPLIT
    else:
        # Rounded up, ceil(target_waves * sms / programs) >= num_splits; max_splits clamps it.
        target, min_tokens = math.ceil(b.num_splits * waves * 1000) / 1000, b.tile_n
    return DecodeTuning(
        waves_below=below, max_context_len=row.cfg.context_len, target_waves=target,
        min_tokens_per_split=min_tokens, max_splits=b.num_splits, one_launch=b.one_launch,
        num_warps=b.num_warps, num_stages=b.num_stages, tile_n=b.tile_n, early_v=b.early_v,
        prefetch_ids=b.prefetch_ids, pdl=b.pdl,
    )  # fmt: skip


def suggested_row(row: RowSweep, sms: int) -> str:
    """``suggested_tuning`` as a line of ``DECODE_TUNING``, with the row's shape and, for a
    row of any number of waves, where it goes."""
    t = suggested_tuning(row, sms)
    below = "math.inf" if math.isinf(t.waves_below) else f"{t.waves_below}"
    place = ", unsplit: just before the last row" if math.isinf(t.waves_below) else ""
    return (
        f"DecodeTuning(waves_below={below}, max_context_len={t.max_context_len}, "
        f"target_waves={t.target_waves:g}, min_tokens_per_split={t.min_tokens_per_split}, "
        f"max_splits={t.max_splits}, one_launch={t.one_launch}, num_warps={t.num_warps}, "
        f"num_stages={t.num_stages}, tile_n={t.tile_n}, early_v={t.early_v}, "
        f"prefetch_ids={t.prefetch_ids}, pdl={t.pdl}),  # {row.cfg.batch} x "
        f"{row.cfg.context_len} at {row.cfg.num_heads}/{row.cfg.num_kv_heads} heads of "
        f"{row.cfg.head_dim}{place}"
    )


def tuning_entry(row: RowSweep, sms: int) -> dict[str, Any] | None:
    """The row's entry of a tuning table (kernels/attention_tuning.py), None where no
    launch ran correctly on it."""
    from kernels.attention_tuning import row_fields

    best = row.best()
    if best is None:
        return None
    entry: dict[str, Any] = {
        "head_dim": row.cfg.head_dim,
        "kv_dtype": str(row.cfg.dtype).removeprefix("torch."),
        "num_heads": row.cfg.num_heads,
        "num_kv_heads": row.cfg.num_kv_heads,
        "batch": row.cfg.batch,
        "context_len": row.cfg.context_len,
        "row": row_fields(suggested_tuning(row, sms)),
        "us": round(best.seconds * 1e6, 2),
    }
    default = row.results.get(row.default)
    if default is not None and default.ok:
        entry["default_us"] = round(default.seconds * 1e6, 2)
    return entry


def tuning_table(rows: list[RowSweep], sms: int, device: str, source: str) -> dict[str, Any]:
    """A tuning table of the sweep's rows (``tuning_entry``), as JSON, most specific first
    (``table_order``)."""
    from kernels.attention_tuning import FORMAT

    entries = [entry for row in rows if (entry := tuning_entry(row, sms)) is not None]
    entries.sort(key=table_order)
    return {"format": FORMAT, "device": device, "source": source, "entries": entries}


def table_order(entry: dict[str, Any]) -> tuple[Any, ...]:
    """Where an entry goes in a table: by cache (head dim, type), then most specific first
    (the first covering row decides): the shortest context bound, then the fewest waves;
    then the case it came from, which with the cache names it (the sweep's shape and row).
    A hand-written entry without a cache or case goes before the others."""
    row = entry["row"]
    waves = math.inf if row["waves_below"] is None else row["waves_below"]
    return (
        entry.get("head_dim", 0), entry.get("kv_dtype", ""), row["max_context_len"], waves,
        entry.get("num_heads", 0), entry.get("num_kv_heads", 0), entry.get("batch", 0),
        entry.get("context_len", 0),
    )  # fmt: skip


def sweep_configs(
    dtype: torch.dtype,
    quick: bool,
    batch_contexts: list[tuple[int, int]] | None,
    heads: list[tuple[int, int]] | None,
    head_dim: int,
) -> list[Config]:
    """The cases ``run_sweep`` times: each (batch, context) at each (query, KV) heads of
    ``head_dim`` (defaults in ``run_sweep``); ``quick``: 4 query / 2 KV heads of 32, the
    shapes ignored."""
    if quick:
        return [Config(b, ctx, 4, 2, 16, 32, dtype) for b, ctx in batch_contexts or [(2, 128)]]
    cases = batch_contexts or TARGET_ROWS
    return [Config(b, ctx, q, kv, 16, head_dim, dtype)
            for q, kv in heads or [(32, 8)] for b, ctx in cases]  # fmt: skip


def run_sweep(
    device: torch.device,
    dtype: torch.dtype,
    peak: float | None,
    *,
    quick: bool = False,
    budget_s: float = DEFAULT_BUDGET_S,
    batch_contexts: list[tuple[int, int]] | None = None,
    heads: list[tuple[int, int]] | None = None,
    head_dim: int = 128,
    out: Callable[[str], None] | None = None,
) -> list[RowSweep]:
    """Run the sweep, printing as it goes; returns the rows with their measurements.
    ``batch_contexts``: the (batch, context) rows, default ``TARGET_ROWS`` (``--quick``: one
    small row), at each of ``heads`` (query, KV) of ``head_dim``, default the Llama-3-8B
    shape (32 / 8 of 128; ``--quick``: 4 query / 2 KV heads of 32)."""
    from kernels._common import num_compute_units

    out = out or print_line
    start = time.perf_counter()
    cfgs = sweep_configs(dtype, quick, batch_contexts, heads, head_dim)
    if quick:  # off CUDA one SM: stage A is unsplit and 2 splits of each merge
        stages = Stages([("A", stage_a)])
    else:
        stages = Stages([("A", stage_a), ("B", stage_b), ("C", stage_c), ("D", stage_d),
                         ("E", stage_e)])  # fmt: skip
    out(f"# decode launch sweep: {len(cfgs)} rows, stages {stages.names}, "
        f"budget {budget_s:.0f} s (compiles included)")  # fmt: skip
    rows = [RowSweep(cfg, device, peak, quick) for cfg in cfgs]
    if len({(c.num_heads, c.num_kv_heads) for c in cfgs}) > 1:
        for row in rows:
            row.shape = f" [{row.cfg.num_heads}/{row.cfg.num_kv_heads}]"
    stages.run(
        rows, start=start, budget_s=budget_s, confirm_reserve_s=CONFIRM_RESERVE_S,
        confirm_note="today's launch and the best (nothing new to compile)", out=out,
        after_row=torch.cuda.empty_cache if device.type == "cuda" else None,
    )  # fmt: skip
    out("")
    out(f"{'batch x ctx':<13} {'':<8}{'launch':<35} {'time_us':>9} {'%peak':>7} "
        f"{'speed-up':>8}")  # fmt: skip
    for row in rows:
        head = f"{row.case} "
        default = row.results.get(row.default)
        best = row.best()
        if default is not None:
            out(f"{head} default {describe(row.default)} {default.seconds * 1e6:>9.1f} "
                f"{row.percent(default.seconds):>7}")  # fmt: skip
        if best is not None:
            ok = default is not None and default.ok
            gain = default.seconds / best.seconds if ok else math.nan
            out(f"{head} best    {describe(best.launch)} {best.seconds * 1e6:>9.1f} "
                f"{row.percent(best.seconds):>7} {gain:>7.2f}x")  # fmt: skip
    sms = num_compute_units(device)
    out("")
    out("# DECODE_TUNING (kernels/paged_attention.py) rows reproducing each row's best at its")
    out("# shape, most specific first, before the catch-all rows (unless a line says where):")
    for row in sorted(rows, key=lambda r: (r.cfg.context_len, r.cfg.batch * r.cfg.num_kv_heads)):
        if row.best() is not None:
            out(f"#   {suggested_row(row, sms)}")
    return rows
