"""Smoke test of ``python -m benchmarks.kernels --quant-matmul`` (benchmarks/quant_matmul_sweep.py):
the sweep runs end to end, every launch it times computes the reference's product, and the
later stages search around the best launch within the register bound.

CPU: the Triton launches run under the interpreter (conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from benchmarks.kernels import main
from benchmarks.quant_matmul_sweep import (
    DENSE,
    MAX_ACC_PER_THREAD,
    TORCH,
    Measured,
    PdlLaunch,
    RowSweep,
    fits,
    stage_a,
    stage_b,
    stage_c,
    stage_d,
    tuning_entry,
)
from kernels.matmul_tuning import LIBRARY, load_tuning
from kernels.quant_matmul import SplitKLaunch, TiledLaunch, choose_launch, tile_shape


def test_quick_sweep_times_each_launch_and_prints_the_best(device, capsys):
    main(["--device", device.type, "--quant-matmul", "--quick", "--peak-gbps", "100",
          "--quant-modes", "int8"])  # fmt: skip
    out = capsys.readouterr().out
    timed = [line for line in out.splitlines() if line.startswith("tiny ") and " us " in line]
    for rows in (1, 3):
        mine = [line for line in timed if f" M={rows} " in line]
        assert sum("unquantized (torch)" in line for line in mine) == 1, mine
        assert sum(line.endswith(" today") for line in mine) == 1, mine
        assert sum(line.endswith(" heuristic") for line in mine) == 1, mine
        assert sum(" split=2 " in line for line in mine) >= 2, mine  # dot and broadcast
        assert sum(" pre " in line for line in mine) == 1, mine  # stage D
    for line in timed:
        assert "MISMATCH" not in line and "failed" not in line, line
    assert "confirmed: torch " in out and "best launch" in out
    # One line per row, whichever form won (on a GPU the tiny shape's best can be tiled).
    pasted = [line for line in out.splitlines() if line.startswith("#   ") and "Launch(" in line]
    assert len(pasted) == 2, out
    for line in pasted:
        launch = eval(line[4:].split("  #")[0].rstrip(","),
                      {"SplitKLaunch": SplitKLaunch, "TiledLaunch": TiledLaunch})  # fmt: skip
        assert isinstance(launch, SplitKLaunch | TiledLaunch), line


def test_a_sweep_where_no_launch_runs_fails(device, capsys, monkeypatch):
    """Every Triton launch failing (torch's matmul still runs) exits non-zero naming the
    rows, as the attention sweep does."""
    import kernels.quant_matmul

    def cannot_run(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(kernels.quant_matmul, "quant_matmul", cannot_run)
    named = "no launch ran and matched the reference on: tiny .*M=1 int8"
    with pytest.raises(SystemExit, match=named):
        main(["--device", device.type, "--quant-matmul", "--quick", "--peak-gbps", "100",
              "--quant-modes", "int8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "failed: RuntimeError: out of resources" in out and "unquantized (torch)" in out


def test_quick_dense_sweep_times_the_kernel_against_the_library(device, capsys, tmp_path):
    """--quant-modes dense: dense_matmul on the unquantized weight, whose "today" is the
    library's own matmul, with the same stages (stage D: the best prefetched); with
    --write-tuning, a table the engine's reader takes, an entry per row."""
    table = tmp_path / "tuning.json"
    main(["--device", device.type, "--quant-matmul", "--quick", "--peak-gbps", "100",
          "--quant-modes", "dense", "--write-tuning", str(table)])  # fmt: skip
    tuning = load_tuning(str(table))
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    assert len(tuning) == 2 and "--write-tuning" in json.loads(table.read_text())["source"]
    for rows in (1, 3):
        launch = tuning.lookup(dtype, rows, 80, 96)
        assert launch == LIBRARY or SplitKLaunch(**launch), launch  # type: ignore[arg-type]
    out = capsys.readouterr().out
    timed = [line for line in out.splitlines() if line.startswith("tiny ") and " us " in line]
    assert timed and all(" dense " in line for line in timed), timed
    for rows in (1, 3):
        mine = [line for line in timed if f" M={rows} " in line]
        torch_lines = [line for line in mine if "unquantized (torch)" in line]
        assert len(torch_lines) == 1 and torch_lines[0].endswith(" today"), mine
        assert sum(line.endswith(" heuristic") for line in mine) == 1, mine
        assert sum(" pre " in line for line in mine) == 1, mine
    for line in timed:
        assert "MISMATCH" not in line and "failed" not in line, line
    assert "confirmed: torch " in out
    assert f"# wrote 2 entries (0 of them kept from the file) to {table}" in out


@pytest.mark.parametrize(
    "argv,says",
    [(["--quick", "--quant-modes", "int4"], "int4"), ([], "only with --quick")],
)
def test_bad_use_is_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--quant-matmul", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def _row(rows: int, k: int, n: int) -> RowSweep:
    empty = torch.empty(0)
    row = RowSweep("x", k, n, rows, "int8", torch.bfloat16, torch.device("cpu"), None, [], [],
                   empty, empty)  # fmt: skip
    row.today = TiledLaunch(*tile_shape(rows))
    row.heuristic = row.effective(choose_launch(rows, n, k, 132))
    return row


def test_stage_a_covers_both_forms_within_the_register_bound():
    row = _row(1, 4096, 4096)
    launches = stage_a(row, 132, quick=False)
    assert launches[:2] == [row.today, row.heuristic]
    split_k = [launch for launch in launches if isinstance(launch, SplitKLaunch)]
    assert {launch.dot for launch in split_k} == {True, False}
    assert {launch.block_n for launch in split_k} == {32, 64, 128, 256}
    assert {launch.num_splits for launch in split_k} >= {1, 9, 17, 33}  # 0-8 waves at 128
    for launch in split_k:
        if launch.dot:
            assert launch.block_m == 16
        else:
            per_thread = launch.block_m * launch.block_k * launch.block_n // (32 * launch.num_warps)
            assert per_thread <= MAX_ACC_PER_THREAD, launch
    # 64 rows: tl.dot on 64-row tiles only
    wide = [launch for launch in stage_a(_row(64, 4096, 4096), 132, quick=False)
            if isinstance(launch, SplitKLaunch)]  # fmt: skip
    assert wide and {(launch.dot, launch.block_m) for launch in wide} == {(True, 64)}


def test_later_stages_search_around_the_best_split_k_launch():
    row = _row(1, 4096, 4096)
    best = SplitKLaunch(1, 128, 64, 16, 8, 3, dot=False)
    row.results = {
        TORCH: Measured(1e-6, 0.0, True),  # never "best": not a quant_matmul launch
        row.today: Measured(2e-6, 0.0, True),  # faster than `best`, but not split-K
        best: Measured(3e-6, 0.0, True),
        SplitKLaunch(16, 128, 64, 16, 4, 3): Measured(1e-9, 1.0, False),  # a mismatch
    }
    assert row.best_split_k() == best
    b = stage_b(row)
    # 2 warps would hold 128 accumulators a thread: left out
    assert {(launch.num_warps, launch.num_stages) for launch in b} == {
        (w, s) for w in (4, 8) for s in (2, 3, 4, 6)
    }
    assert all(launch.block_k == 64 and launch.num_splits == 16 for launch in b)
    assert [launch.block_k for launch in stage_c(row)] == [16, 32, 64, 128]
    # D: the best plain launch prefetched, and summed in one launch, also with registers
    # capped for two 8-warp programs an SM (off a Hopper GPU, no dependent launch)
    summed = replace(best, one_launch=True)
    assert stage_d(row) == [replace(best, prefetch=True), summed, replace(summed, maxnreg=128)]
    row.results[replace(best, prefetch=True)] = Measured(1e-7, 0.0, True)
    row.results[summed] = Measured(1e-7, 0.0, True)
    row.results[replace(summed, maxnreg=128)] = Measured(1e-7, 0.0, True)
    assert row.best_split_k() == best  # stages B-D search around plain launches
    # At 4 warps two programs fit an SM at ptxas's own bound: no cap to try
    four = replace(best, num_warps=4)
    row.results = {four: Measured(1e-6, 0.0, True)}
    assert all(not launch.maxnreg for launch in stage_d(row))
    assert fits(16, 256, 256, 2, dot=True) and not fits(16, 64, 8, 4, dot=True)


def test_a_rows_tuning_entry_is_its_fastest_launch_as_the_engine_runs_it():
    """The table holds the fastest split-K launch of a decode row, without its dependent
    launch (PAGEDSERVE_PDL's to make); for dense weights the library where it beat them
    all; nothing for rows past the split-K kernel or a tiled best."""
    row = _row(1, 4096, 4096)
    best = SplitKLaunch(1, 256, 32, 16, 8, 3, dot=False, prefetch=True)
    row.results = {TORCH: Measured(20e-6, 0.0, True), PdlLaunch(best): Measured(10e-6, 0, True),
                   best: Measured(11e-6, 0.0, True)}  # fmt: skip
    entry = tuning_entry(row)
    assert entry == {"weight": "int8", "k": 4096, "n": 4096, "rows": 1,
                     "launch": asdict(best), "us": 10.0, "library_us": 20.0}  # fmt: skip
    dense = replace(row, mode=DENSE, results={**row.results, TORCH: Measured(9e-6, 0.0, True)})
    assert tuning_entry(dense) == {"weight": "bfloat16", "k": 4096, "n": 4096, "rows": 1,
                                   "launch": LIBRARY, "library_us": 9.0}  # fmt: skip
    tiled = replace(row, results={row.today: Measured(1e-6, 0.0, True), **row.results})
    assert tuning_entry(tiled) is None
    wide = _row(64, 4096, 4096)
    wide.results = {SplitKLaunch(64, 128, 64, 2, 4, 3): Measured(1e-6, 0.0, True)}
    assert tuning_entry(wide) is None


def test_a_models_matmuls_are_the_engines():
    """``--model``'s shapes (``model_shapes``): Llama-3-8B's are the sweep's default table,
    and every one is a dense Linear the engine builds at that preset, [K, N]; a mixture of
    experts keeps its attention's and its LM head's."""
    from benchmarks.quant_matmul_sweep import SHAPES, model_shapes
    from engine.attention import PagedAttention
    from engine.config import ModelConfig
    from engine.llama import Linear, LlamaForCausalLM
    from engine.presets import preset
    from engine.rope import RotaryEmbedding

    assert model_shapes(ModelConfig.from_hf(preset("llama-3-8b"))) == SHAPES
    for name in ("tiny-llama", "qwen2.5-7b", "llama-3.2-1b"):
        mc = ModelConfig.from_hf(preset(name))
        rope = RotaryEmbedding(mc, 16, torch.device("cpu"))
        with torch.device("meta"):
            model = LlamaForCausalLM(mc, PagedAttention("torch", scale=1.0), rope)
        built = {tuple(m.weight.shape) for m in model.modules() if type(m) is Linear}
        assert set(model_shapes(mc).values()) == built, name
    moe = model_shapes(ModelConfig.from_hf(preset("mixtral-8x7b")))
    assert set(moe) == {"qkv", "o", "lm_head"}, moe


def test_model_picks_the_sweeps_shapes(monkeypatch, capsys):
    """``--model``: the attention sweep at the preset's heads and head dim, the matmul sweep
    at its matmuls; a name that is neither a preset nor a checkpoint, or one given with
    --shapes, is one line and exit 2."""
    import benchmarks.decode_sweep
    import benchmarks.quant_matmul_sweep as qms

    seen: dict[str, object] = {}
    monkeypatch.setattr(benchmarks.decode_sweep, "run_sweep",
                        lambda *a, **k: seen.update(attention=k) or [])  # fmt: skip
    monkeypatch.setattr(qms, "run_quant_sweep", lambda *a, **k: seen.update(matmul=k) or [])
    main(["--device", "cpu", "--sweep", "--quick", "--model", "qwen2.5-7b"])
    assert seen["attention"]["heads"] == [(28, 4)] and seen["attention"]["head_dim"] == 128
    main(["--device", "cpu", "--quant-matmul", "--quick", "--model", "llama-3.2-1b"])
    assert seen["matmul"]["shapes"]["qkv"] == (2048, 3072), seen["matmul"]
    refused = [(["--model", "llama-9"], "neither a preset"),
               (["--model", "qwen2.5-7b", "--shapes", "32/8"], "drop --shapes")]  # fmt: skip
    for argv, says in refused:
        with pytest.raises(SystemExit) as info:
            main(["--device", "cpu", "--sweep", "--quick", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
