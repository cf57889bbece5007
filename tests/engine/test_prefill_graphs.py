"""The prefill graphs' plumbing (engine/prefill_graphs.py), tested on CPU with the stand-in.

The stand-in runs the same buffers, padding, empty sequences and cuts at attention as a CUDA
replay, with the graphs' work computed eagerly: greedy tokens of steps with prefill chunks
beside decodes must match transformers (the near-tie rule) and the engine without it,
replayed whole or in pieces, for steps that pad to a bucket and after larger steps left
their rows and sequences in the buffers.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.input_batch import InputBatch
from engine.prefill_graphs import PrefillGraphs, default_prefill_sizes
from tests.engine.graph_stand_ins import install_decode_stand_in, install_prefill_stand_in
from tests.engine.parity import assert_parity, hf_greedy
from tests.triton_devices import TRITON_DEVICES


def test_default_sizes_stop_at_the_limit() -> None:
    assert default_prefill_sizes(1024)[:4] == [16, 32, 64, 96]
    assert default_prefill_sizes(1024)[-1] == 1024
    assert default_prefill_sizes(300)[-1] == 256
    assert default_prefill_sizes(8) == []


def _with_stand_in(
    llm: LLM, sizes: list[int], mode: str = "full"
) -> tuple[PrefillGraphs, list[InputBatch]]:
    graphs = install_prefill_stand_in(llm.engine, sizes, mode)
    seen: list[InputBatch] = []
    run = graphs.run

    def recording(batch: InputBatch) -> tuple[torch.Tensor, bool]:
        seen.append(batch)
        return run(batch)

    graphs.run = recording  # type: ignore[method-assign]
    return graphs, seen


def _mixed(batch: InputBatch) -> bool:
    return 0 < batch.attn.num_decodes < batch.attn.seq_lens.shape[0]


def _triton_through_stand_in_as_torch(
    model, device, prompts, max_tokens, sizes, **engine
) -> tuple[PrefillGraphs, list[InputBatch]]:
    """Greedy ``prompts`` on the Triton kernels through the prefill graphs' stand-in of
    ``sizes`` (whole graphs on) give the torch reference backend's tokens (eager, same
    device, float32); returns the stand-in and the batches it ran."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kwargs = dict(block_size=8, num_kv_blocks=64, device=device, dtype="float32", **engine)
    ref = LLM(str(model), attention_backend="torch", **kwargs)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    llm = LLM(str(model), attention_backend="triton", **kwargs)
    graphs, seen = _with_stand_in(llm, sizes)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    return graphs, seen


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("mode", ["full", "piecewise"])
@pytest.mark.parametrize("with_decode_graphs", [False, True])
def test_stand_in_matches_transformers_and_eager(tiny_llama_gqa, with_decode_graphs, mode) -> None:
    from transformers import AutoModelForCausalLM

    # Prompts of 3-45 tokens, a 24-token step budget: prompts are chunked, and steps mix
    # their chunks with the decodes of the prompts admitted earlier.
    lengths = [45, 3, 17, 30, 8, 21, 5]
    prompts = _prompts(256, lengths)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kwargs = dict(attention_backend="torch", max_num_seqs=8, max_num_batched_tokens=24,
                  device="cpu")  # fmt: skip
    eager = [o.token_ids for o in LLM(str(tiny_llama_gqa), **kwargs).generate(prompts, params)]

    llm = LLM(str(tiny_llama_gqa), **kwargs)
    engine = llm.engine
    if with_decode_graphs:
        install_decode_stand_in(engine, [1, 2, 4, 8])
    graphs, seen = _with_stand_in(llm, [8, 16, 24], mode)
    ways: list[str] = []  # how each step's forward ran, as its stats say
    step = engine.step

    def recording_step():  # noqa: ANN202
        outputs = step()
        if engine.last_step_stats is not None:
            ways.append(engine.last_step_stats.replay)
        return outputs

    engine.step = recording_step  # type: ignore[method-assign]
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [o.token_ids for o in llm.generate(prompts[1:2], params)]

    mixed = [b for b in seen if 0 < b.attn.num_decodes < b.attn.seq_lens.shape[0]]
    assert mixed, "some steps mixed prefill chunks with decodes"
    assert any(b.num_tokens not in (8, 16, 24) for b in seen), "some steps were padded"
    assert any(b.attn.num_decodes == 0 for b in seen), "some steps were prefill only"
    if with_decode_graphs:
        assert all(b.attn.num_decodes < b.attn.seq_lens.shape[0] for b in seen), (
            "decode-only steps go to the decode graphs"
        )
    # The torch backend attends a mixed step's decodes apart (its plan is not one launch):
    # those replay pieces; prefill-only steps replay whole, unless asked for pieces.
    assert graphs.replays["pieces"] >= len(mixed)
    if mode == "full":
        assert graphs.replays["whole"] == sum(b.attn.num_decodes == 0 for b in seen)
    else:
        assert graphs.replays["whole"] == 0
    assert ways.count("whole_graph") == graphs.replays["whole"]
    assert ways.count("graph_pieces") == graphs.replays["pieces"]
    assert ("decode_graph" in ways) == with_decode_graphs
    assert "eager" not in ways  # every step fits the 24-token bucket
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, 10, None)
        assert_parity(outs[i], ref, f"prompt {i} {mode} graphs")
        assert_parity(eager[i], ref, f"prompt {i} eager")
    assert_parity(alone[0], hf_greedy(hf, prompts[1], 10, None), f"alone, {mode} graphs")


@pytest.mark.parametrize("mixed_attention", ["one_launch", "split"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_mixed_steps_replay_whole_where_attention_is_one_launch(
    tiny_llama_gqa, device, mixed_attention, monkeypatch
) -> None:
    """With the Triton kernels a mixed step attends in one launch (the prefill kernel over
    every row) unless its decodes would split: such steps replay the whole graph, with
    their sequences padded by empty ones; the others replay pieces. The tokens are the
    torch reference's, as the eager Triton engine's are."""
    import kernels.paged_attention

    if mixed_attention == "split":
        monkeypatch.setattr(kernels.paged_attention, "choose_num_splits", lambda *a, **k: 4)
    graphs, seen = _triton_through_stand_in_as_torch(
        tiny_llama_gqa, device, _prompts(256, [30, 3, 21, 9, 14]), 6, [8, 16], max_num_seqs=8,
        max_num_batched_tokens=16,
    )  # fmt: skip
    mixed = [b for b in seen if _mixed(b)]
    prefill_only = [b for b in seen if b.attn.num_decodes == 0]
    decode_only = len(seen) - len(mixed) - len(prefill_only)  # no decode graphs here
    assert mixed and prefill_only
    if mixed_attention == "one_launch":
        assert graphs.replays == {"whole": len(mixed) + len(prefill_only), "pieces": decode_only}
    else:
        assert graphs.replays == {"whole": len(prefill_only), "pieces": len(mixed) + decode_only}


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_speculative_rows_replay_whole(tiny_llama_gqa, device) -> None:
    """N-gram speculation's verification rows (a chunk of 1 + drafts per request) replay the
    whole graph with the Triton kernels: transformers' greedy tokens (the near-tie rule:
    a verification row's matmuls have other row counts than a decode's)."""
    from transformers import AutoModelForCausalLM

    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6 + [12]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_llama_gqa), attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=32, block_size=8, num_kv_blocks=64, device=device,
              dtype="float32", speculative_method="ngram",
              num_speculative_tokens=3)  # fmt: skip
    graphs, seen = _with_stand_in(llm, [16, 32])
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert any(b.verifying for b in seen), "some steps verified drafts"
    assert graphs.replays["whole"] >= sum(1 for b in seen if b.verifying)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert_parity(outs[i], hf_greedy(hf, prompt, 12, None), f"prompt {i}, speculative")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_sliding_window_layers_replay_whole(tmp_path, device) -> None:
    """A Mistral with a sliding window shorter than the prompts: its layers attend through
    the window inside the whole graph (the prefill kernel takes it as an argument); the
    torch reference's tokens."""
    from tests.engine.test_families import make_tiny

    path, _ = make_tiny(tmp_path / "mistral", "mistral-sliding", seed=3)
    graphs, seen = _triton_through_stand_in_as_torch(
        path, device, _prompts(256, [23, 5, 41, 9]), 8, [16, 32], max_num_seqs=4,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert graphs.model.config.sliding_window is not None
    assert graphs.replays["whole"] >= sum(map(_mixed, seen)) > 0


def test_empty_sequences_after_a_step_with_more(tiny_llama_gqa) -> None:
    """A whole graph covers a fixed number of sequences: past a step's own, they are empty
    (no queries, no context), also where a step with more sequences wrote before."""
    llm = LLM(str(tiny_llama_gqa), attention_backend="torch", max_num_seqs=8,
              max_num_batched_tokens=32, device="cpu")  # fmt: skip
    graphs, seen = _with_stand_in(llm, [32])
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(_prompts(256, [5, 6, 7, 4]), params)  # one prefill step of 4 sequences
    assert graphs.seq_lens[:4].tolist() == [5, 6, 7, 4]
    llm.generate(_prompts(256, [9]), params)
    assert [b.attn.seq_lens.shape[0] for b in seen] == [4, 1]
    assert graphs.replays["whole"] == 2
    assert graphs.seq_capacity(32) == 8
    assert graphs.seq_lens.tolist() == [9] + [0] * 7
    assert graphs.query_start_loc.tolist() == [0] + [9] * 8


def test_which_steps_replay_whole(tiny_llama_gqa) -> None:
    """Whole: a plan that attends in one launch, or a step without decodes, whose sequences
    and block tables fit the buffers; never in piecewise mode."""
    from engine.attention import AttentionPlan
    from engine.cuda_graphs import inert_batch

    llm = LLM(str(tiny_llama_gqa), attention_backend="torch", max_num_seqs=4, device="cpu")
    engine = llm.engine
    model, storage, cpu = engine.runner.model, engine.storage, engine.device

    def graphs(mode: str) -> PrefillGraphs:
        return PrefillGraphs(model, storage, [8, 16], cpu, capture=False, mode=mode,
                             max_num_seqs=4, max_blocks_per_seq=2)  # fmt: skip

    full, pieces = graphs("full"), graphs("piecewise")
    mixed = inert_batch(8, 3, storage.block_size, cpu)  # two decodes and a prefill
    prefill = inert_batch(8, 1, storage.block_size, cpu)
    assert full.takes_whole(mixed, AttentionPlan(mixed.attn, one_launch=True), 8)
    assert not full.takes_whole(mixed, AttentionPlan(mixed.attn), 8)  # decodes split
    assert full.takes_whole(prefill, AttentionPlan(prefill.attn), 8)
    assert not pieces.takes_whole(prefill, AttentionPlan(prefill.attn), 8)
    assert full.seq_capacity(8) == 4 and full.seq_capacity(16) == 4
    many = inert_batch(8, 5, storage.block_size, cpu)  # more sequences than max_num_seqs
    assert not full.takes_whole(many, AttentionPlan(many.attn, one_launch=True), 8)
    wide = inert_batch(40, 1, storage.block_size, cpu)  # a table of 3 blocks
    assert wide.attn.block_tables.shape[1] == 3
    assert not full.takes_whole(wide, AttentionPlan(wide.attn), 16)
    with pytest.raises(ValueError, match="full, piecewise"):
        graphs("whole")


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_padding_rows_write_no_kv_after_a_larger_step(tiny_llama_gqa, mode) -> None:
    """A 20-token step leaves its slots in the buffer; a following 5-token step of the same
    bucket must give rows 5..24 slot -1 again, or their K/V would land on live slots."""
    llm = LLM(str(tiny_llama_gqa), attention_backend="torch", max_num_batched_tokens=24,
              device="cpu")
    engine = llm.engine
    pieces, seen = _with_stand_in(llm, [24], mode)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(_prompts(256, [20]), params)
    assert pieces.slot_mapping[:20].ne(-1).all(), "the 20-token prefill used the buffers"
    caches = [c.clone() for c in (*engine.storage.key_caches, *engine.storage.value_caches)]
    llm.generate(_prompts(256, [5]), params)
    assert [b.num_tokens for b in seen] == [20, 5]
    assert pieces.slot_mapping[5:].eq(-1).all()
    written = [
        int((a != b).any(dim=(1, 2, 3)).sum())
        for a, b in zip(
            caches, (*engine.storage.key_caches, *engine.storage.value_caches), strict=True
        )
    ]
    assert max(written) <= 1, f"a 5-token prompt writes one block per layer, wrote {written}"


def test_larger_steps_run_eagerly(tiny_llama_gqa) -> None:
    llm = LLM(str(tiny_llama_gqa), attention_backend="torch", max_num_batched_tokens=64,
              device="cpu")
    _, seen = _with_stand_in(llm, [16])
    llm.generate(_prompts(256, [40]), SamplingParams(max_tokens=2, temperature=0))
    # The 40-token prefill has no bucket among [16]; the decode step after it (no decode
    # graphs here) does.
    assert [b.num_tokens for b in seen] == [1]
