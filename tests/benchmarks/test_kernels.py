"""Smoke test of ``python -m benchmarks.kernels``: it runs, and every implementation it times
computes the same attention as the reference (the bench's ``max_err`` column).

CPU: the Triton rows run under the interpreter (conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from benchmarks.kernels import (
    FUSED_OPS,
    TARGET_ROWS,
    Config,
    FusedConfig,
    bench_config,
    bench_fused,
    main,
    sweep,
)


def test_every_benched_implementation_matches_the_reference(device):
    cfg = Config(batch=2, context_len=40, num_heads=9, num_kv_heads=3, block_size=16,
                 head_dim=64, dtype=torch.float32)  # fmt: skip
    rows = bench_config(cfg, device)
    names = [impl for impl, _, _, _ in rows]
    assert names == ["triton", "reference", "sdpa", "sdpa+gather"]
    for impl, _, seconds, err in rows:
        assert seconds > 0, impl
        assert err < 1e-4, (impl, err)


def test_bytes_moved_counts_kv_q_o_and_tables():
    cfg = Config(batch=2, context_len=40, num_heads=8, num_kv_heads=2, block_size=16,
                 head_dim=64, dtype=torch.bfloat16)  # fmt: skip
    kv = 2 * 2 * 40 * 2 * 64 * 2  # K and V, batch, ctx, kv heads, head dim, 2 bytes
    q_and_o = 2 * 2 * 8 * 64 * 2
    tables = 2 * 3 * 4  # 3 blocks of 16 per sequence, int32
    assert cfg.bytes_moved() == kv + q_and_o + tables


def test_cli_prints_a_row_per_implementation(device, capsys):
    main(["--device", device.type, "--batches", "1", "--contexts", "24", "--shapes", "4/2",
          "--block-sizes", "8", "--peak-gbps", "100"])  # fmt: skip
    out = capsys.readouterr().out
    assert "peak bandwidth: 100 GB/s (--peak-gbps)" in out
    for impl in ("triton", "reference", "sdpa", "sdpa+gather"):
        assert f" {impl} " in out, out


def test_forced_splits_and_launch_params_add_rows(device):
    cfg = Config(batch=1, context_len=130, num_heads=4, num_kv_heads=1, block_size=16,
                 head_dim=64, dtype=torch.float32)  # fmt: skip
    rows = bench_config(cfg, device, splits=[2, 3], launch_params=[(2, 2)])
    # (on CUDA the heuristic splits 130 tokens in 2 and adds the unsplit row)
    forced = [(impl, n) for impl, n, _, _ in rows if impl.startswith("triton-split")]
    assert forced == [("triton-split=2", 2), ("triton-split=3", 3)] or forced == [
        ("triton-split=3", 3)
    ]
    assert "triton[w=2,s=2]" in [impl for impl, _, _, _ in rows]
    for impl, _, _, err in rows:
        assert err < 1e-4, (impl, err)


def test_fused_ops_match_their_twins(device):
    cfg = FusedConfig(num_tokens=3, hidden_size=64, intermediate_size=96, num_heads=4,
                      num_kv_heads=2, head_dim=64, dtype=torch.float32)  # fmt: skip
    rows = bench_fused(cfg, device)
    # hidden 64: choose_num_warps picks 4, so the norms' other launches are 16 warps only
    variants = {
        "add_rms_norm_": ("triton[w=16]",),
        "rms_norm": ("triton[w=16]",),
        "rope_and_store_": ("triton[h=8]",),
    }
    assert [(op, impl) for op, impl, _, _ in rows] == [
        (op, impl) for op in FUSED_OPS for impl in ("triton", *variants.get(op, ()), "torch")
    ]
    for op, impl, seconds, err in rows:
        assert seconds > 0 and err < 1e-5, (op, impl, err)


def test_fused_timing_calls_the_op_alone(monkeypatch):
    """What is timed is each op's call and nothing more: RoPE + store's timed call returns
    the rotated queries, a view of ``qkv``; the copy of Q and both caches its comparison
    reads is made outside the clock (it moves as many bytes as the op)."""
    import benchmarks.kernels as bench

    timed: list[torch.Tensor] = []

    def record(launch, sets, device):
        timed.append(launch(sets[0]))
        return 1.0

    monkeypatch.setattr(bench, "time_sets", record)
    cfg = FusedConfig(num_tokens=3, hidden_size=64, intermediate_size=96, num_heads=4,
                      num_kv_heads=2, head_dim=64, dtype=torch.float32)  # fmt: skip
    rows = bench_fused(cfg, torch.device("cpu"))
    for (op, _, _, _), out in zip(rows, timed, strict=True):
        if op == "rope_and_store_":
            assert out.shape == (3, 4, 64), out.shape
        else:
            assert out.shape[0] == 3 and out.dim() == 2, (op, out.shape)


def test_fused_bytes_count_each_ops_reads_and_writes():
    cfg = FusedConfig(num_tokens=2, hidden_size=8, intermediate_size=5, num_heads=4,
                      num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)  # fmt: skip
    assert cfg.bytes_moved("add_rms_norm_") == (4 * 2 * 8 + 8) * 2
    assert cfg.bytes_moved("silu_mul") == 3 * 2 * 5 * 2
    qkv = (4 + 2 * 2) * 4  # a token's Q, K and V row, read once and written once
    assert cfg.bytes_moved("rope_and_store_") == (2 * 2 * qkv + 2 * 2 * 4) * 2 + 8 * 2


def test_targets_are_the_issue_rows():
    args = argparse.Namespace(targets=True, dtype="bf16", quick=False)
    configs = sweep(args, torch.device("cpu"))
    assert [(c.batch, c.context_len) for c in configs] == TARGET_ROWS
    assert {(c.num_heads, c.num_kv_heads, c.head_dim, c.block_size) for c in configs} == {
        (32, 8, 128, 16)
    }


def test_sweep_quick_times_each_merge_and_reports_the_best(device, capsys):
    """``--sweep --quick``: the sweep's machinery end to end on one small row (on CPU under
    the interpreter): the default launch and both merges at 2 splits, each checked against
    the reference, then the summary and the table line."""
    main(["--device", device.type, "--sweep", "--quick", "--peak-gbps", "100"])
    out = capsys.readouterr().out
    timed = [line for line in out.splitlines() if line.startswith("   2 x 128 ") and " us " in line]
    # The default first, once (CPU: unsplit; a GPU splits the 128 tokens), then every other
    # split count of whole tiles with each merge: unsplit and 2 splits everywhere, more on a
    # GPU's many SMs.
    assert [" default" in line for line in timed] == [True] + [False] * (len(timed) - 1), out
    launches = [line.split()[3] + line.split()[4] for line in timed]
    assert len(set(launches)) == len(launches), timed
    assert {"onesplits=2", "twosplits=2", "unsplitsplits=1"} <= set(launches), timed
    if timed[0].split()[3] == "unsplit":
        assert len(timed) == 3, timed
    for line in timed:
        assert "MISMATCH" not in line and "failed" not in line, line
    assert "   2 x 128    best    " in out and "   2 x 128    default " in out
    assert "# DECODE_TUNING" in out


def test_a_sweep_where_no_launch_runs_fails(device, capsys, monkeypatch):
    """Every launch failing (here: the launcher raises, as a launch the device cannot run
    does) is a broken kernel: each is named failed, and the run exits non-zero naming the
    row, so a session's summary of exit statuses shows it."""
    import kernels.paged_attention

    def cannot_run(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(kernels.paged_attention, "paged_attention_decode", cannot_run)
    with pytest.raises(SystemExit, match="no launch ran and matched the reference on: 2 x 128"):
        main(["--device", device.type, "--sweep", "--quick", "--peak-gbps", "100"])
    out = capsys.readouterr().out
    assert "failed: RuntimeError: out of resources" in out
    assert " us " not in out


def test_sweep_rows_replace_the_issues_rows(device, capsys):
    """``--sweep-rows``: the sweep times the rows named (here at the quick run's small
    shape), and a malformed list is one line and exit 2."""
    main(["--device", device.type, "--sweep", "--quick", "--peak-gbps", "100",
          "--sweep-rows", "3x64,1x96"])  # fmt: skip
    out = capsys.readouterr().out
    assert "# decode launch sweep: 2 rows" in out, out
    for head in ("   3 x 64    ", "   1 x 96    "):
        assert f"{head} default " in out and f"{head} best    " in out, out
    assert "   2 x 128 " not in out
    for bad in ("64by512", "0x512"):
        with pytest.raises(SystemExit) as info:
            main(["--device", "cpu", "--sweep", "--quick", "--sweep-rows", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "--sweep-rows" in err and "Traceback" not in err, err


def test_sweep_writes_its_rows_as_a_table_two_sweeps_share(device, capsys, tmp_path):
    """``--sweep --write-tuning FILE``: each row's best as a DECODE_TUNING row the engine's
    reader takes (kernels/attention_tuning.py), with the case and its times. A second sweep
    adds its rows to the same device's table (the gpu session's two sweeps make one) and
    replaces those of the cases it timed again; another device's table is replaced."""
    import json

    from kernels.attention_tuning import parse_tuning

    path = tmp_path / "attention.json"

    def sweep_rows(rows: str) -> dict:
        main(["--device", device.type, "--sweep", "--quick", "--peak-gbps", "100",
              "--sweep-rows", rows, "--write-tuning", str(path)])  # fmt: skip
        table = json.loads(path.read_text())
        parse_tuning(table, str(path))
        return table

    path.write_text(json.dumps({"format": 1, "device": "another GPU", "entries": []}))
    first = sweep_rows("3x64")
    out = capsys.readouterr().out
    assert f"# {path} was swept on another GPU, not " in out, out
    assert "--write-tuning" in first["source"] and first["device"] != "another GPU"
    [entry] = first["entries"]
    assert (entry["batch"], entry["context_len"]) == (3, 64) and entry["us"] > 0, entry
    assert entry["row"]["max_context_len"] == 64 and entry["default_us"] > 0, entry
    both = sweep_rows("1x96")
    assert [(e["batch"], e["context_len"]) for e in both["entries"]] == [(3, 64), (1, 96)]
    assert both["entries"][0] == entry and "1 entries kept from: " in both["source"]
    assert f"# wrote 2 entries (1 of them kept from the file) to {path}" in capsys.readouterr().out
    again = sweep_rows("3x64")
    assert [(e["batch"], e["context_len"]) for e in again["entries"]] == [(3, 64), (1, 96)]
    assert again["entries"][1] == both["entries"][1]


def test_the_sweep_runs_at_a_models_shapes():
    """``--shapes`` and ``--head-dim`` (Qwen2.5-7B's 28/4; 16/8 of 256): every
    row at every shape; by default the Llama-3-8B shape."""
    from benchmarks.decode_sweep import sweep_configs

    bf16 = torch.bfloat16
    default = sweep_configs(bf16, False, None, None, 128)
    assert [(c.batch, c.context_len) for c in default] == TARGET_ROWS
    assert {(c.num_heads, c.num_kv_heads, c.head_dim, c.dtype) for c in default} == {
        (32, 8, 128, bf16)
    }
    mine = sweep_configs(bf16, False, [(1, 512), (64, 512)], [(28, 4), (16, 8)], 256)
    assert [(c.num_heads, c.num_kv_heads, c.batch, c.head_dim) for c in mine] == [
        (28, 4, 1, 256), (28, 4, 64, 256), (16, 8, 1, 256), (16, 8, 64, 256)
    ]  # fmt: skip


def test_a_tables_entries_go_most_specific_first():
    """Per cache, the shortest context bound, then the fewest waves, first (the first
    covering row decides); two shapes' rows for one batch x context are two entries."""
    from benchmarks.decode_sweep import table_order

    def entry(head_dim, kv_heads, batch, context, waves):
        return {"head_dim": head_dim, "kv_dtype": "bfloat16", "num_heads": 32,
                "num_kv_heads": kv_heads, "batch": batch, "context_len": context,
                "row": {"max_context_len": context, "waves_below": waves}}  # fmt: skip

    entries = [entry(128, 8, 64, 512, None), entry(128, 8, 1, 4096, 0.061),
               entry(128, 8, 16, 512, 0.97), entry(128, 4, 16, 512, 0.485),
               entry(64, 8, 1, 4096, 0.061), entry(128, 8, 1, 512, 0.061)]  # fmt: skip
    ordered = [(e["head_dim"], e["num_kv_heads"], e["batch"], e["context_len"])
               for e in sorted(entries, key=table_order)]  # fmt: skip
    assert ordered == [(64, 8, 1, 4096), (128, 8, 1, 512), (128, 4, 16, 512),
                       (128, 8, 16, 512), (128, 8, 64, 512), (128, 8, 1, 4096)]  # fmt: skip
    assert len({table_order(e) for e in entries}) == len(entries)


def test_sweep_table_line_reproduces_the_best_launch(monkeypatch):
    """The sweep's suggested ``DecodeTuning`` row, put first in the table, makes
    ``choose_launch`` pick the measured best at the row's shape (on a 132-SM GPU)."""
    import kernels.paged_attention as decode_module
    from benchmarks.decode_sweep import Measured, effective, suggested_row
    from kernels.paged_attention import DECODE_TUNING, DecodeLaunch, DecodeTuning

    monkeypatch.setattr(decode_module, "num_compute_units", lambda device: 132)
    cases = [
        ((1, 512), DecodeLaunch(16, True, 2, 1, 32)),
        ((16, 512), DecodeLaunch(4, False, 8, 2, 64)),
        ((1, 4096), DecodeLaunch(32, True, 4, 3, 64)),
        ((4, 4096), DecodeLaunch(7, True, 4, 3, 64)),
    ]
    for (batch, context), best in cases:
        row = argparse.Namespace(
            cfg=Config(batch, context, 32, 8, 16, 128, torch.bfloat16),
            best=lambda best=best: Measured(best, 1e-6, 0.0, True),
        )
        line = suggested_row(row, 132)
        tuning = eval(line.split("  #")[0].rstrip(","), {"DecodeTuning": DecodeTuning})
        monkeypatch.setattr(decode_module, "DECODE_TUNING", (tuning, *DECODE_TUNING))
        chosen = decode_module.choose_launch(batch, 8, context, torch.device("cuda"))
        assert effective(chosen, context) == best, line
    # Unsplit bests: below SPLIT_BELOW_WAVES a row to go first, like a split one; at or
    # above it (the engine's batch-64 decode step over 512 tokens) a row for any waves of
    # its context, just before the last row: smaller batches of that context still split.
    for (batch, context), launch in (((16, 512), DecodeLaunch(1, False, 8, 1, 32)),
                                     ((64, 512), DecodeLaunch(1, False, 8, 2, 128))):  # fmt: skip
        unsplit = argparse.Namespace(
            cfg=Config(batch, context, 32, 8, 16, 128, torch.bfloat16),
            best=lambda launch=launch: Measured(launch, 1e-6, 0.0, True),
        )
        line = suggested_row(unsplit, 132)
        tuning = eval(line.split("  #")[0].rstrip(","), {"DecodeTuning": DecodeTuning,
                                                         "math": math})  # fmt: skip
        if batch == 16:
            table = (tuning, *DECODE_TUNING)
        else:
            assert line.endswith("unsplit: just before the last row"), line
            table = (*DECODE_TUNING[:-1], tuning, DECODE_TUNING[-1])
        monkeypatch.setattr(decode_module, "DECODE_TUNING", table)
        chosen = decode_module.choose_launch(batch, 8, context, torch.device("cuda"))
        assert effective(chosen, context) == launch, line
    # ... while 24 sequences of 512 (under 2 waves) still split, as before the row
    assert decode_module.choose_launch(24, 8, 512, torch.device("cuda")).num_splits > 1
    assert decode_module.choose_launch(64, 8, 4096, torch.device("cuda")).num_splits == 1


def test_sweep_confirms_the_best_against_today_interleaved(device):
    """The confirmation step re-times today's launch and the best (here made best by hand:
    on CPU the unsplit default usually wins, and then there is nothing to confirm)."""
    from benchmarks.decode_sweep import run_sweep

    lines: list[str] = []
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    (row,) = run_sweep(device, dtype, 100.0, quick=True, out=lines.append)
    other = next(m for launch, m in row.results.items() if launch != row.default)
    other.seconds = 1e-12  # "best" until re-timed
    row.confirm(lines.append)
    assert lines[-1].startswith("   2 x 128   today ") and ", best " in lines[-1]
    assert other.seconds == 1e-12  # the least of its timings is kept
    assert row.results[row.default].seconds > 0


def test_sweep_runs_every_stage_on_a_small_row(device, monkeypatch):
    """The full sweep's code path (stages A to E, confirmation, summary, table lines) on
    one small row of the issue's head shape, with a narrowed warps/stages grid."""
    import benchmarks.decode_sweep as decode_sweep
    import kernels._common
    from kernels.paged_attention import pdl_supported

    monkeypatch.setattr(decode_sweep, "TARGET_ROWS", [(1, 64)])
    # The sweep's split bound counts SMs (1 off CUDA): pretend an H100's 132.
    monkeypatch.setattr(kernels._common, "num_compute_units", lambda device: 132)
    monkeypatch.setattr(decode_sweep, "SWEEP_WARPS", (2, 4))
    monkeypatch.setattr(decode_sweep, "SWEEP_STAGES", (3,))
    lines: list[str] = []
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    (row,) = decode_sweep.run_sweep(device, dtype, 100.0, out=lines.append)
    out = "\n".join(lines)
    for stage in ("# stage A", "# stage B", "# stage C", "# stage D", "# stage E", "# confirm"):
        assert stage in out, out
    # D: a launch with each tile's V load beside its K load, as good as any other
    early = [m for m in row.results.values() if m.launch.early_v and not m.launch.prefetch_ids]
    assert len(early) == 1 and early[0].ok, row.results
    assert "early-v" in out
    # E: D's best with the first tile's block ids prefetched (and no PDL off a GPU)
    ahead = [m for m in row.results.values() if m.launch.prefetch_ids]
    assert ahead and all(m.ok for m in ahead), row.results
    assert any(m.launch.pdl for m in ahead) == pdl_supported(device)
    assert " ids" in out
    assert "failed" not in out and "MISMATCH" not in out, out
    launches = {(m.launch.num_splits, m.launch.one_launch, m.launch.num_warps, m.launch.tile_n,
                 m.launch.num_stages) for m in row.results.values()
                if not (m.launch.early_v or m.launch.prefetch_ids)}  # fmt: skip
    d = row.default
    assert (d.num_splits, d.one_launch, d.num_warps, d.tile_n, d.num_stages) in launches  # A
    # B: one of A's launches at each of the narrowed grid's warps, at 3 stages.
    at = {w: {(n, one, tile) for (n, one, w2, tile, s) in launches if w2 == w and s == 3}
          for w in (2, 4)}  # fmt: skip
    assert at[2] & at[4], launches
    if (d.num_splits, d.tile_n) == (1, 64):  # the interpreter's default: one tile, unsplit
        # A: the one launch; B: 2 and 4 warps; C: tiles of 32 (1 and 2 splits, each merge)
        # and 128 tokens, from B's best, whichever warps won B (the confirmation re-times
        # the best and today's launch afterwards, so the final best need not be C's start).
        c_warps = {w for (_, _, w, tile, _) in launches if tile != 64}
        assert len(c_warps) == 1, launches
        (warps,) = c_warps
        assert {(2, True, warps, 32, 3), (2, False, warps, 32, 3),
                (1, False, warps, 128, 3)} <= launches  # fmt: skip
    assert "   1 x 64     best    " in out
    assert "catch-all row:" in out or "DecodeTuning(" in out
