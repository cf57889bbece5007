"""The CUDA memory reserve's arithmetic (engine/gpu_memory.py), on CPU: the decode graphs'
logits are counted once per graph ``DecodeGraphs`` captures, small batches once per context
bucket, and a capture that takes more than the reserve is reported."""

from __future__ import annotations

import logging

import pytest

from engine import LLM
from engine.cuda_graphs import (
    SHORT_CONTEXT_MAX_BATCH,
    DecodeGraphs,
    decode_graph_keys,
    default_graph_sizes,
)
from engine.gpu_memory import GRAPH_SLACK_BYTES, check_graph_memory, decode_graphs_bytes


def test_decode_graphs_capture_exactly_the_keys_the_reserve_counts() -> None:
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_num_seqs=64, max_model_len=2048)
    engine = llm.engine
    block_size = engine.storage.block_size
    max_blocks = -(-engine.max_model_len // block_size)
    sizes = default_graph_sizes(64)
    graphs = DecodeGraphs(
        engine.runner.model, engine.storage, sizes, max_blocks, engine.device, capture=False
    )
    keys = decode_graph_keys(sizes, max_blocks, block_size)
    assert graphs.keys == keys
    assert {(s, w) for s in graphs.sizes for w in graphs.widths[s]} == set(keys)
    # 2,048 tokens = 128 blocks: batches of <= 32 also get the 1,024-token bucket (4,096 is
    # not below the full width).
    assert graphs.widths[1] == [64, 128] and graphs.widths[64] == [128]
    assert len(keys) == 2 * sum(1 for s in sizes if s <= SHORT_CONTEXT_MAX_BATCH) + sum(
        1 for s in sizes if s > SHORT_CONTEXT_MAX_BATCH
    )


def test_the_reserve_counts_a_logits_buffer_per_batch_and_context_bucket() -> None:
    """Llama 3 8B's shape, 8,192 tokens (512 blocks of 16), the default buckets of 256
    sequences: batches of <= 32 have three graphs each (1,024 and 4,096 tokens and the full
    width), larger ones one."""
    sizes = default_graph_sizes(256)
    vocab = 128256
    got = decode_graphs_bytes(
        sizes, max_blocks_per_seq=512, block_size=16, vocab_size=vocab, activation_bytes=7
    )
    small = [1, 2, 4, 8, 16, 24, 32]
    assert [s for s in sizes if s <= SHORT_CONTEXT_MAX_BATCH] == small
    rows = 3 * sum(small) + sum(s for s in sizes if s > SHORT_CONTEXT_MAX_BATCH)
    assert rows == 2485  # one buffer per batch bucket alone would be 2,311 rows
    assert got == rows * vocab * 4 + 7
    # A context no longer than the short buckets: one graph per batch bucket.
    short = decode_graphs_bytes(
        sizes, max_blocks_per_seq=64, block_size=16, vocab_size=vocab, activation_bytes=0
    )
    assert short == sum(sizes) * vocab * 4
    assert decode_graphs_bytes([], max_blocks_per_seq=512, block_size=16, vocab_size=vocab,
                               activation_bytes=7) == 0  # fmt: skip


def test_a_capture_larger_than_the_reserve_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.gpu_memory"):
        assert check_graph_memory(2**30, 2**30)
        # The allocator's segment rounding is not a miss.
        assert check_graph_memory(2**30 + GRAPH_SLACK_BYTES, 2**30)
        assert not caplog.records
        assert not check_graph_memory(2**30 + GRAPH_SLACK_BYTES + 1, 2**30)
    assert "more than the 1.00 GiB reserved" in caplog.text
