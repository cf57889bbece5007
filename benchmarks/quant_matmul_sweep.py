"""Launch sweep of the weight-only quantized matmul (``python -m benchmarks.kernels
--quant-matmul``).

For each Llama-3-8B decode matmul (K x N: qkv 4,096 x 6,144, o 4,096 x 4,096, gate/up 4,096
x 28,672, down 14,336 x 4,096, LM head 4,096 x 128,256; ``--model``: a model's own,
``model_shapes``) at M = 1, 4, 16 and 64 rows, in
int8 and fp8 weights, it times launches of ``kernels.quant_matmul.quant_matmul``
(``launch=``) beside bf16 ``x @ w`` (cuBLAS) on the same shape, and prints per row the
fastest launch beside today's (``TiledLaunch`` at ``tile_shape``, what decode ran before the
split-K kernel) and the heuristic's (``choose_launch``), with a ``SplitKLaunch(...)`` to
paste. Mode ``dense`` times ``dense_matmul`` (the same split-K kernel on the unquantized
weight, ``PAGEDSERVE_DECODE_MATMUL=triton``) against cuBLAS on the same bytes; its "today"
is cuBLAS itself. Each launch is timed as ``benchmarks.kernels`` times the decode kernels: one CUDA
graph over enough independent input sets (each its own weight) that no call finds its
weight in L2 (``decode_cases.time_sets``). Bandwidth counts the weight's bytes and scales
(and bf16's 2 bytes a weight for the cuBLAS row), against the device's peak.

The grid is searched in stages, all rows at each stage before the next, so that a run cut
short by ``--budget-s`` (compiles included) still has every row's first stage::

    A  today's launch, the heuristic's, and split-K at column strips {32, 64, 128, 256} x
       splits for {1, 2, 4, 8} programs per SM (deduplicated after the launcher's recount),
       on tl.dot (16 rows a tile; 64 at M = 64) and, for M <= 4, the broadcast form
    B  num_warps {2, 4, 8} x num_stages {2, 3, 4, 6} at each row's best split-K launch of A
       (unsplit narrow strips with deep pipelines are the alternative to split-K's partials)
    C  block_k {16, 32, 64, 128, 256} at the best of B
    D  the best of C with its first weight tile prefetched (``SplitKLaunch.prefetch``), with
       its splits summed by the last to finish instead of a second kernel (``one_launch``;
       at 8 warps also with registers capped at 128, ``maxnreg``, so that two programs
       share an SM as without the sum), and each where the device runs them as a
       programmatic dependent launch (``pdl``:
       back to back in the graph, each call's first tiles stream while the call before
       ends, as after a layer's short kernels with ``PAGEDSERVE_PDL=1``)

The broadcast form's accumulator tile (``block_m * block_k * block_n`` float32 values) is
kept within 64 values a thread, beyond which it spills registers. Every timing line is
printed (and flushed) as it is measured, with its relative error against
``kernels.reference.quant_matmul`` (``MISMATCH`` launches are never "best"; a launch that
fails prints its error and the sweep goes on; torch's row is checked against ``x @ w`` in
float32). Then bf16 ``x @ w``, the heuristic's launch and the best are timed again,
interleaved, each keeping its least, and the summary printed.

``--write-tuning FILE`` writes the decode rows' (at most 16 rows) best launches as a tuning
table (kernels/matmul_tuning.py) that ``PAGEDSERVE_MATMUL_TUNING=FILE`` hands the engine's
launchers: the fastest launch of each row, as the launcher runs it without a dependent
launch (that is ``PAGEDSERVE_PDL``'s); for the dense mode ``"library"`` where the library's
matmul beat every launch.

CPU: only with ``TRITON_INTERPRET=1`` and ``--quick`` (one small shape at M = 1 and 3: today's
and the heuristic's launches and stage A at strips of 64 with an H100's split counts, wall
clock): a smoke test of this code, not a measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.decode_cases import num_input_sets, time_sets
from benchmarks.staged_sweep import Stages, print_line
from kernels import reference
from kernels.matmul_tuning import FORMAT as TUNING_FORMAT
from kernels.matmul_tuning import LIBRARY


@dataclass(frozen=True)
class PdlLaunch:
    """A split-K launch run as a programmatic dependent launch (stage D)."""

    launch: SplitKLaunch


if TYPE_CHECKING:
    from engine.config import ModelConfig
    from kernels.quant_matmul import SplitKLaunch, TiledLaunch

    # a quant_matmul (or dense_matmul) launch, or TORCH: x @ w on the unquantized weight
    # (the library's)
    Launch = SplitKLaunch | TiledLaunch | PdlLaunch | str

TORCH = "torch"

# Llama-3-8B's matmuls of one decoder layer and the LM head: name -> (K, N) (what
# model_shapes gives for its preset; a test holds the two together).
SHAPES = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
ROWS = (1, 4, 16, 64)
MODES = ("int8", "fp8")
# dense_matmul on the unquantized weight (its bytes are the dtype's, as torch's row)
DENSE = "dense"
ALL_MODES = (*MODES, DENSE)
SWEEP_BLOCK_N = (32, 64, 128, 256)
SWEEP_WAVES = (0, 2, 4, 8)  # programs per SM the split count aims at (0: unsplit)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (2, 3, 4, 6)
SWEEP_BLOCK_K = (16, 32, 64, 128, 256)
BROADCAST_MAX_ROWS = 4  # the broadcast form's registers grow with block_m
MAX_ACC_PER_THREAD = 64  # broadcast accumulators a thread: beyond it ptxas spills
# |launch - reference| / max |reference| above this marks a wrong launch (bf16/fp16 outputs
# are rounded once: ~4e-3; float32 differs by summation order).
MISMATCH_ABOVE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
DEFAULT_BUDGET_S = 240.0
# The confirmation (two more timings of three launches per row, nothing new to compile)
# runs within this much past the budget.
CONFIRM_RESERVE_S = 30.0


@dataclass
class WeightSet:
    x: torch.Tensor  # [rows, K] activations
    weight: torch.Tensor  # [K, N] the activations' dtype (torch's row), or quantized
    scale: torch.Tensor | None  # [N] float32 (quantized sets only)


@dataclass
class Measured:
    seconds: float
    error: float
    ok: bool


def describe(launch: Launch) -> str:
    from kernels.quant_matmul import SplitKLaunch

    if isinstance(launch, str):
        return "x @ w, unquantized (torch)"
    if isinstance(launch, PdlLaunch):
        return describe(launch.launch) + " pdl"
    if isinstance(launch, SplitKLaunch):
        form = "dot" if launch.dot else "bcast"
        return (
            f"{form:<5} m{launch.block_m:<2} n{launch.block_n:<3} k{launch.block_k:<3} "
            f"split={launch.num_splits:<2} w={launch.num_warps} s={launch.num_stages}"
            + (" pre" if launch.prefetch else "")
            + (" one" if launch.one_launch else "")
            + (f" r{launch.maxnreg}" if launch.maxnreg else "")
        )
    return f"tiled m{launch.block_m:<2} n{launch.block_n:<3} k{launch.block_k:<3}"


@dataclass
class RowSweep:
    """One (shape, rows, mode): its input sets, reference output and launches measured."""

    shape: str
    k: int
    n: int
    rows: int
    mode: str
    dtype: torch.dtype
    device: torch.device
    peak: float | None  # GB/s
    sets: list[WeightSet]  # quantized (dense: the unquantized weights)
    torch_sets: list[WeightSet]  # the unquantized weights
    expected: torch.Tensor  # [rows, N] float32, reference on sets[0]
    torch_expected: torch.Tensor  # [rows, N] float32, x @ w in float32 on torch_sets[0]
    today: Launch = TORCH  # set by make_rows
    heuristic: Launch = TORCH
    results: dict[Launch, Measured] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.shape:<7} {self.k:>5}x{self.n:<6} M={self.rows:<3} {self.mode:<4}"

    def weight_bytes(self, launch: Launch) -> int:
        """Bytes a call must read of its weight: the dtype's (2 a value in bf16) for
        torch's matmul and the dense mode, else 1 a value and the scales."""
        if isinstance(launch, str) or self.mode == DENSE:
            return self.dtype.itemsize * self.k * self.n
        return self.k * self.n + 4 * self.n

    def effective(self, launch: Launch) -> Launch:
        """The launch as the launcher runs it (splits recounted to whole tiles)."""
        from kernels.quant_matmul import SplitKLaunch, split_k_rows

        if isinstance(launch, PdlLaunch):
            return PdlLaunch(self.effective(launch.launch))
        if not isinstance(launch, SplitKLaunch):
            return launch
        return replace(launch, num_splits=split_k_rows(self.k, launch.block_k,
                                                       launch.num_splits)[1])  # fmt: skip

    def impl(self, launch: Launch) -> Callable[[WeightSet], torch.Tensor]:
        from kernels.quant_matmul import dense_matmul, quant_matmul

        if isinstance(launch, str):
            return lambda s: s.x @ s.weight
        pdl = isinstance(launch, PdlLaunch)
        plain = launch.launch if isinstance(launch, PdlLaunch) else launch
        if self.mode == DENSE:
            return lambda s: dense_matmul(s.x, s.weight, launch=plain, pdl=pdl)  # type: ignore[arg-type]

        def run(s: WeightSet) -> torch.Tensor:
            assert s.scale is not None, "a quantized set"
            return quant_matmul(s.x, s.weight, s.scale, launch=plain, pdl=pdl)

        return run

    def best(self) -> tuple[Launch, Measured] | None:
        ok = [(launch, m) for launch, m in self.results.items() if m.ok and launch != TORCH]
        return min(ok, key=lambda lm: lm[1].seconds) if ok else None

    def best_split_k(self) -> SplitKLaunch | None:
        """The fastest plain split-K launch measured (stage D's variants aside)."""
        from kernels.quant_matmul import SplitKLaunch

        ok = [(launch, m) for launch, m in self.results.items()
              if m.ok and isinstance(launch, SplitKLaunch) and not launch.prefetch
              and not launch.one_launch]  # fmt: skip
        return min(ok, key=lambda lm: lm[1].seconds)[0] if ok else None

    def measure(self, launch: Launch, out: Callable[[str], None]) -> None:
        """Time ``launch`` (as the launcher will run it) unless it was, and print the line."""
        launch = self.effective(launch)
        if launch in self.results:
            return
        sets = self.sets_for(launch)
        try:
            seconds = time_sets(self.impl(launch), sets, self.device)
            got = self.impl(launch)(sets[0]).float()
            want = self.torch_expected if isinstance(launch, str) else self.expected
            error = float((got - want).abs().max() / want.abs().max())
        except Exception as e:  # a launch the device cannot run (shared memory, registers)
            out(f"{self.label} {describe(launch):<42} failed: {type(e).__name__}: "
                f"{str(e)[:150]}")  # fmt: skip
            self.results[launch] = Measured(math.inf, math.inf, False)
            return
        ok = error <= MISMATCH_ABOVE[self.dtype]
        self.results[launch] = Measured(seconds, error, ok)
        marks = "".join(
            f" {name}" for name, which in (("today", self.today), ("heuristic", self.heuristic))
            if launch == which
        )  # fmt: skip
        out(f"{self.label} {describe(launch):<42} {self.figures(launch)} err {error:.1e}"
            f"{'' if ok else ' MISMATCH'}{marks}")  # fmt: skip

    def figures(self, launch: Launch) -> str:
        """Time, GB/s of the weight bytes, % of peak, and speed-up over torch's matmul."""
        seconds = self.results[launch].seconds
        if not math.isfinite(seconds):
            return f"{'failed':>9}"
        gbps = self.weight_bytes(launch) / seconds / 1e9
        pct = f"{100 * gbps / self.peak:5.1f}%" if self.peak else "   n/a"
        return f"{seconds * 1e6:>9.1f} us {gbps:>7.0f} GB/s {pct} {self.ratio(seconds):>6}"

    def ratio(self, seconds: float) -> str:
        """torch's time on the unquantized weight over ``seconds`` (> 1: faster)."""
        base = self.results.get(TORCH)
        return f"{base.seconds / seconds:.2f}x" if base is not None and base.ok else "n/a"

    def sets_for(self, launch: Launch) -> list[WeightSet]:
        return self.torch_sets if isinstance(launch, str) else self.sets

    def confirm(self, out: Callable[[str], None]) -> None:
        """Time torch's matmul, the heuristic's launch and the best again, interleaved (A,
        B, C, A, B, C: the figures compared come from the same minutes); each keeps its
        least."""
        best = self.best()
        named: dict[Launch, str] = {TORCH: "torch", self.heuristic: "heuristic"}
        if best is not None and best[0] not in named:
            named[best[0]] = "best"
        measured = [(launch, self.results.get(launch)) for launch in named]
        runs = [(launch, m) for launch, m in measured if m is not None and m.ok]
        for _ in range(2):
            for launch, m in runs:
                m.seconds = min(
                    m.seconds, time_sets(self.impl(launch), self.sets_for(launch), self.device)
                )
        out(f"{self.label} confirmed: " + ", ".join(
            f"{named[launch]} {m.seconds * 1e6:.1f} us" for launch, m in runs
        ))  # fmt: skip


def split_counts(row: RowSweep, block_m: int, block_n: int, sms: int) -> list[int]:
    """Split counts that give each of ``SWEEP_WAVES`` programs per SM (at least 1)."""
    programs = -(-row.n // block_n) * -(-row.rows // block_m)
    return sorted({max(1, -(-waves * sms // programs)) for waves in SWEEP_WAVES})


def fits(block_m: int, block_n: int, block_k: int, num_warps: int, dot: bool) -> bool:
    """A split-K tile the kernel accepts and the device holds in registers."""
    if dot:
        return block_m >= 16 and block_k >= 16
    return block_m * block_k * block_n <= MAX_ACC_PER_THREAD * 32 * num_warps


def stage_a(row: RowSweep, sms: int, quick: bool) -> list[Launch]:
    """Today's launch, the heuristic's, then split-K over strips x splits x forms."""
    from kernels.quant_matmul import SplitKLaunch

    launches: list[Launch] = [row.today, row.heuristic]
    forms: list[tuple[bool, int, int]] = [(True, 16 if row.rows <= 16 else 64, 4)]
    if row.rows <= BROADCAST_MAX_ROWS:
        forms.append((False, 1 << (row.rows - 1).bit_length(), 8))
    for block_n in (64,) if quick else SWEEP_BLOCK_N:
        for dot, block_m, warps in forms:
            block_k = 64
            while not fits(block_m, block_n, block_k, warps, dot):
                block_k //= 2
            if block_k < 8:
                continue
            for splits in split_counts(row, block_m, block_n, sms):
                launches.append(SplitKLaunch(block_m, block_n, block_k, splits, warps, 3, dot))
    return launches


def stage_b(row: RowSweep) -> list[Launch]:
    b = row.best_split_k()
    if b is None:
        return []
    return [replace(b, num_warps=w, num_stages=s) for w in SWEEP_WARPS for s in SWEEP_STAGES
            if fits(b.block_m, b.block_n, b.block_k, w, b.dot)]  # fmt: skip


def stage_c(row: RowSweep) -> list[Launch]:
    b = row.best_split_k()
    if b is None:
        return []
    return [replace(b, block_k=k) for k in SWEEP_BLOCK_K
            if fits(b.block_m, b.block_n, k, b.num_warps, b.dot)]  # fmt: skip


def stage_d(row: RowSweep) -> list[Launch]:
    """The best of C prefetched, summed in one launch (also with registers capped for two
    programs an SM where that is a cap: at one row and 8 warps the one-launch sum takes 154
    registers as Triton 3.9 builds it, 168 as a dependent launch as Triton 3.6 does), and
    each as a dependent launch where the device runs them."""
    from kernels._triton_common import pdl_supported
    from kernels.quant_matmul import two_programs_regs

    b = row.best_split_k()
    if b is None:
        return []
    plain = [b]
    if row.effective(b).num_splits > 1:
        summed = replace(b, one_launch=True)
        regs = two_programs_regs(b.num_warps)
        plain += [summed] + ([replace(summed, maxnreg=regs)] if regs < 255 else [])
    launches: list[Launch] = [replace(b, prefetch=True), *plain[1:]]
    if pdl_supported(row.device):
        launches += [PdlLaunch(launch) for launch in plain]
    return launches


def model_shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """A model's dense matmuls as the engine builds them (engine/llama.py: fused qkv and
    gate/up projections, weights [K, N]): name -> (K, N). A mixture of experts' MLP is not
    a dense matmul (engine/moe.py): its model gets the attention's and the LM head's."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = {"qkv": (mc.hidden_size, q + 2 * kv), "o": (q, mc.hidden_size)}
    if not mc.num_experts:
        shapes["gate_up"] = (mc.hidden_size, 2 * mc.intermediate_size)
        shapes["down"] = (mc.intermediate_size, mc.hidden_size)
    shapes["lm_head"] = (mc.hidden_size, mc.vocab_size)
    return shapes


def make_rows(
    device: torch.device,
    dtype: torch.dtype,
    peak: float | None,
    shapes: dict[str, tuple[int, int]],
    rows: tuple[int, ...],
    modes: tuple[str, ...],
    sms: int,
) -> list[RowSweep]:
    """Every (shape, rows, mode) with its input sets: per shape, independent random weights
    (bf16, and each mode's quantization of them), enough sets that a CUDA graph over them
    streams more than L2 (one set off CUDA). The dense mode's sets are torch's."""
    from engine.quantization import quantize_weight
    from kernels.quant_matmul import DECODE_ROWS, TiledLaunch, choose_launch, tile_shape

    out: list[RowSweep] = []
    for shape, (k, n) in shapes.items():
        count = num_input_sets(k * n, device)
        weights = [(torch.randn(k, n, device=device) * 0.02).to(dtype) for _ in range(count)]
        quantized = {
            mode: [quantize_weight(w, mode) for w in weights] for mode in modes if mode != DENSE
        }
        for m in rows:
            xs = [torch.randn(m, k, device=device).to(dtype) for _ in range(count)]
            torch_sets = [WeightSet(x, w, None) for x, w in zip(xs, weights, strict=True)]
            torch_expected = xs[0].float() @ weights[0].float()
            for mode in modes:
                if mode == DENSE:  # rows past the kernel's take the library: nothing to time
                    if m > DECODE_ROWS:
                        continue
                    sets = torch_sets
                    expected = reference.dense_matmul(xs[0], weights[0]).float()
                else:
                    pairs = zip(xs, quantized[mode], strict=True)
                    sets = [WeightSet(x, q, s) for x, (q, s) in pairs]
                    q, s = quantized[mode][0]
                    expected = reference.quant_matmul(xs[0], q, s).float()
                row = RowSweep(shape, k, n, m, mode, dtype, device, peak, sets, torch_sets,
                               expected, torch_expected)  # fmt: skip
                # dense: "today" is the library's matmul, the row's torch launch
                row.today = TORCH if mode == DENSE else TiledLaunch(*tile_shape(m))
                row.heuristic = row.effective(choose_launch(m, n, k, sms))
                out.append(row)
    return out


def tuning_entry(row: RowSweep) -> dict[str, Any] | None:
    """The row's entry of a tuning table (kernels/matmul_tuning.py), None where it has none:
    more rows than the split-K kernel takes, nothing measured, or a tiled best (the table
    holds split-K launches only)."""
    from kernels.quant_matmul import DECODE_ROWS, SplitKLaunch

    best = row.best()
    if row.rows > DECODE_ROWS or best is None:
        return None
    launch, measured = best
    if isinstance(launch, PdlLaunch):  # the dependent launch is PAGEDSERVE_PDL's to make
        launch = launch.launch
    library = row.results.get(TORCH)
    library_s = library.seconds if library is not None and library.ok else None
    entry: dict[str, Any] = {
        "weight": str(row.dtype).removeprefix("torch.") if row.mode == DENSE else row.mode,
        "k": row.k,
        "n": row.n,
        "rows": row.rows,
    }
    if row.mode == DENSE and library_s is not None and library_s < measured.seconds:
        entry["launch"] = LIBRARY
    elif isinstance(launch, SplitKLaunch):
        entry.update(launch=asdict(launch), us=round(measured.seconds * 1e6, 2))
    else:
        return None
    if library_s is not None:
        entry["library_us"] = round(library_s * 1e6, 2)
    return entry


def tuning_table(sweep: list[RowSweep], device: str, source: str) -> dict[str, Any]:
    """A tuning table of the sweep's decode rows (``tuning_entry``), as JSON."""
    entries = [entry for row in sweep if (entry := tuning_entry(row)) is not None]
    return {"format": TUNING_FORMAT, "device": device, "source": source, "entries": entries}


def paste_line(row: RowSweep) -> str:
    best = row.best()
    if best is None:
        return f"# {row.label}: no launch ran"
    launch = best[0]
    return f"{launch!r},  # {row.shape} {row.k}x{row.n} M={row.rows} {row.mode}"


def run_quant_sweep(
    device: torch.device,
    dtype: torch.dtype,
    peak: float | None,
    *,
    quick: bool = False,
    budget_s: float = DEFAULT_BUDGET_S,
    modes: tuple[str, ...] = MODES,
    rows: tuple[int, ...] = ROWS,
    shapes: dict[str, tuple[int, int]] | None = None,
    out: Callable[[str], None] | None = None,
) -> list[RowSweep]:
    """Run the sweep, printing as it goes; returns the rows with their measurements.
    ``shapes``: name -> (K, N), default Llama-3-8B's (``SHAPES``; ``model_shapes`` gives a
    model's)."""
    from kernels._common import num_compute_units

    out = out or print_line
    start = time.perf_counter()
    sms = num_compute_units(device) if device.type == "cuda" else 0
    if quick:  # interpreter-sized: one shape, small K and N, no stage B or C
        shapes, rows = {"tiny": (96, 80)}, (1, 3)
        stages: Stages[Launch] = Stages(
            [("A", lambda r: stage_a(r, 132, quick=True)), ("D", stage_d)]
        )
    else:
        shapes = shapes or SHAPES
        stages = Stages([("A", lambda r: stage_a(r, sms, quick=False)), ("B", stage_b),
                         ("C", stage_c), ("D", stage_d)])  # fmt: skip
    torch.manual_seed(0)
    sweep = make_rows(device, dtype, peak, shapes, rows, modes, sms)
    out(f"# quant_matmul launch sweep: {len(sweep)} rows ({', '.join(shapes)} x M "
        f"{'/'.join(map(str, rows))} x {'/'.join(modes)}), stages "
        f"{stages.names}, budget {budget_s:.0f} s (compiles included), "
        f"{sms} SMs")  # fmt: skip
    out(
        f"# columns: time, GB/s of the weight's bytes, % of peak, speed-up over torch's x @ w "
        f"on the {str(dtype).removeprefix('torch.')} weight"
    )
    torch_rows: dict[tuple[str, int], Measured] = {}
    for row in sweep:  # torch's matmul first (once per shape and rows): lines print ratios
        key = (row.shape, row.rows)
        if key in torch_rows:
            row.results[TORCH] = torch_rows[key]
        else:
            row.measure(TORCH, out)
            torch_rows[key] = row.results[TORCH]
    stages.run(
        sweep, start=start, budget_s=budget_s, confirm_reserve_s=CONFIRM_RESERVE_S,
        confirm_note="torch's matmul, the heuristic's launch and the best", out=out,
    )  # fmt: skip
    out("")
    out(f"{'shape':<7} {'K x N':<12} {'M':<5} {'mode':<4} {'torch_us':>8} {'today':>15} "
        f"{'heuristic':>15} {'best':>15}  best launch")  # fmt: skip

    def cell(row: RowSweep, launch: Launch | None) -> str:
        m = row.results.get(launch) if launch is not None else None
        if m is None or not m.ok:
            return f"{'-':>15}"
        return f"{m.seconds * 1e6:>8.1f} {row.ratio(m.seconds):>6}"

    for row in sweep:
        base = row.results.get(TORCH)
        best = row.best()
        best_cell = cell(row, best[0] if best else None)
        out(f"{row.label} {base.seconds * 1e6 if base else math.nan:>8.1f} "
            f"{cell(row, row.today)} {cell(row, row.heuristic)} "
            f"{best_cell}  {describe(best[0]) if best else '-'}")  # fmt: skip
    out("")
    out("# the best launch per row, to paste (kernels/quant_matmul.py choose_launch):")
    for row in sweep:
        out(f"#   {paste_line(row)}")
    return sweep
