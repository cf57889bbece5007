"""Smoke test of ``python -m benchmarks.paged_attention``: it runs, and every implementation it
times computes the same attention as the reference (the bench's ``max_err`` column).

CPU: the Triton rows run under the interpreter (tests/kernels/conftest.py, imported by this
folder's conftest.py, sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from benchmarks.paged_attention import Config, bench_config, main


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
