"""Decode graphs' plumbing (engine/cuda_graphs.py), tested on CPU with the eager stand-in.

The stand-in runs the same persistent buffers, bucketing and padding as a CUDA replay, with
an eager forward in place of ``graph.replay()``: greedy tokens through it must match
transformers (the near-tie rule) and the engine without graphs, for batches that pad to
every kind of bucket, including after larger batches left stale rows in the buffers.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, default_graph_sizes, inert_batch
from tests.engine.graph_stand_ins import install_decode_stand_in
from tests.engine.parity import assert_parity, hf_greedy


def test_default_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert default_graph_sizes(256)[:12] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80]
    assert default_graph_sizes(256)[-1] == 256
    assert default_graph_sizes(5) == [1, 2, 4, 5]
    assert default_graph_sizes(100)[-2:] == [96, 100]


def _with_stand_in(llm: LLM, sizes: list[int]) -> DecodeGraphs:
    return install_decode_stand_in(llm.engine, sizes)


def _prompts(vocab: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (count,), generator=g)
    ]


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa", "tiny_llama_cpu_shapes"])
def test_stand_in_replay_matches_transformers_and_eager(request, fixture, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    from engine import cuda_graphs

    # Context buckets of 2 and 8 blocks below the full 32: the prompts (1..40 tokens, +12
    # generated) move from one bucket to the next as they grow.
    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXTS", (32, 128))

    path = request.getfixturevalue(fixture)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 11)
    eager_llm = LLM(str(path), max_num_seqs=16, device="cpu")
    eager = [o.token_ids for o in eager_llm.generate(prompts, params)]

    llm = LLM(str(path), max_num_seqs=16, device="cpu")
    graphs = _with_stand_in(llm, [1, 2, 4, 8, 16])
    assert graphs.widths[16] == [2, 8, 32]
    calls = []
    widths = set()
    run = graphs.run

    def counting(batch):
        calls.append(batch.num_tokens)
        widths.add(graphs.width(graphs.bucket(batch.num_tokens), batch.attn.block_tables.shape[1]))
        return run(batch)

    graphs.run = counting  # type: ignore[method-assign]
    # 11 at once (bucket 16, 5 padding rows), then alone: the buffers' rows 1..15 hold the
    # previous steps' values and must be made inert again.
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [o.token_ids for o in llm.generate(prompts[:1], params)]
    assert calls and max(calls) == 11 and 1 in calls
    assert widths == {2, 8}, widths
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, 12, None)
        assert_parity(together[i], ref, f"prompt {i} with graphs")
        assert_parity(eager[i], ref, f"prompt {i} eager")
    assert_parity(alone[0], hf_greedy(hf, prompts[0], 12, None), "alone with graphs")


def test_stand_in_replay_with_async_scheduling(tiny_llama_gqa) -> None:
    """Asynchronous steps write their decodes' pending inputs into the batch before the
    graphs copy it into their buffers: the replayed steps give the eager steps' tokens."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 11)
    sync = LLM(str(tiny_llama_gqa), max_num_seqs=16, device="cpu")
    eager = [o.token_ids for o in sync.generate(prompts, params)]
    llm = LLM(str(tiny_llama_gqa), max_num_seqs=16, async_scheduling=True, device="cpu")
    graphs = _with_stand_in(llm, [1, 2, 4, 8, 16])
    replayed = []
    run = graphs.run
    graphs.run = lambda batch: replayed.append(bool(batch.pending)) or run(batch)  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(prompts, params)] == eager
    assert any(replayed)  # replays of steps fed on the device


def test_steps_the_graphs_do_not_take_run_eagerly(tiny_llama_gqa) -> None:
    """Prefill and mixed steps, and decode batches above the largest bucket, bypass them."""
    llm = LLM(str(tiny_llama_gqa), max_num_seqs=8, device="cpu")
    graphs = _with_stand_in(llm, [1, 2])
    sizes = []
    run = graphs.run
    graphs.run = lambda batch: sizes.append(batch.num_tokens) or run(batch)  # type: ignore[method-assign]
    llm.generate(_prompts(256, 5), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert sizes == [], "a 5-request decode step has no bucket among [1, 2]"
    llm.generate(_prompts(256, 2), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert sizes and set(sizes) <= {1, 2}


def test_dummy_preset_runs_without_a_checkpoint() -> None:
    llm = LLM("tiny-llama", load_format="dummy", device="cpu")
    assert llm.engine.model_config.vocab_size == 512 and llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 5
    weights = llm.engine.model.layers[0].qkv_proj.weight
    assert 0.01 < float(weights.detach().float().std()) < 0.03  # N(0, 0.02): not left uninitialised


def test_padding_rows_are_the_inert_batch_and_write_no_kv(tiny_llama_gqa) -> None:
    """The graphs' padding rows and gpu_memory.py's measuring steps are both
    ``inert_batch``'s rows: after a 3-row step has used the buffers, a 1-row step pads
    rows 1..3 back to them, and a forward over inert rows leaves the KV cache as it was."""
    llm = LLM(str(tiny_llama_gqa), attention_backend="torch", max_num_seqs=4, device="cpu")
    engine = llm.engine
    graphs = _with_stand_in(llm, [4])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate(_prompts(256, 3), params)
    assert graphs.slot_mapping[:3].ne(-1).all(), "the 3-row decode steps used the buffers"
    llm.generate(_prompts(256, 1), params)
    inert = inert_batch(4, 4, engine.storage.block_size, engine.device)
    assert torch.equal(graphs.input_ids[1:], inert.input_ids[1:])
    assert torch.equal(graphs.positions[1:], inert.positions[1:])
    assert torch.equal(graphs.slot_mapping[1:], inert.slot_mapping[1:])
    assert torch.equal(graphs.seq_lens[1:], inert.attn.seq_lens[1:])
    for tables in graphs.block_tables.values():
        assert tables[1:].eq(0).all()

    caches = engine.storage.key_caches, engine.storage.value_caches
    before = [c.clone() for c in (*caches[0], *caches[1])]
    for batch in (inert_batch(4, 4, 16, engine.device), inert_batch(40, 1, 16, engine.device)):
        logits = engine.model(batch, *caches)
        assert logits.shape[0] == batch.logits_indices.shape[0] and logits.isfinite().all()
    assert all(torch.equal(b, c) for b, c in zip(before, (*caches[0], *caches[1]), strict=True))


def test_every_replay_sees_inert_padding_rows_after_any_order_of_buckets() -> None:
    """``run`` resets only the padding rows an earlier step wrote: whatever the order of
    batch sizes and context widths, the rows a bucket pads with are the inert ones."""
    from types import SimpleNamespace

    from engine.input_batch import build_input_batch
    from scheduler.output import ScheduledRequest, SchedulerOutput
    from scheduler.request import Request

    block_size = 4
    storage = SimpleNamespace(block_size=block_size, key_caches=[], value_caches=[])
    seen = []

    def forward(batch, key_caches, value_caches):  # records what a replay would read
        seen.append(batch)
        return torch.zeros(batch.num_tokens, 8)

    graphs = DecodeGraphs(forward, storage, [1, 2, 4, 8], 64, torch.device("cpu"), capture=False)  # type: ignore[arg-type]
    inert = inert_batch(8, 8, block_size, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for n, context in [(7, 5), (1, 9), (3, 200), (2, 30), (8, 6), (5, 250), (1, 3), (4, 40)]:
        rows = [
            ScheduledRequest(
                Request(f"r{i}", [1] * context, SamplingParams()),
                start=context - 1,
                num_tokens=1,
                token_ids=[int(torch.randint(3, 100, (1,), generator=g))],
                block_ids=tuple(
                    torch.randint(1, 500, (-(-context // block_size),), generator=g).tolist()
                ),
                samples=True,
            )
            for i in range(n)
        ]
        batch = build_input_batch(SchedulerOutput(scheduled=rows), block_size, torch.device("cpu"))
        assert graphs.handles(batch)
        graphs.run(batch)
        static = seen[-1]
        size = static.num_tokens
        assert size == graphs.bucket(n)
        assert torch.equal(static.input_ids[:n], batch.input_ids)
        assert torch.equal(static.slot_mapping[:n], batch.slot_mapping)
        assert torch.equal(static.attn.seq_lens[:n], batch.attn.seq_lens)
        width = batch.attn.block_tables.shape[1]
        assert torch.equal(static.attn.block_tables[:n, :width], batch.attn.block_tables)
        pad = slice(n, size)
        assert torch.equal(static.input_ids[pad], inert.input_ids[pad])
        assert torch.equal(static.positions[pad], inert.positions[pad])
        assert torch.equal(static.slot_mapping[pad], inert.slot_mapping[pad])
        assert torch.equal(static.attn.seq_lens[pad], inert.attn.seq_lens[pad])
        assert static.attn.block_tables[pad].eq(0).all()
