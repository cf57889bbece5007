"""Piecewise graphs' plumbing (engine/piecewise_graphs.py), tested on CPU with the stand-in.

The stand-in runs the same buffers, padding and cuts at attention as a CUDA replay, with the
pieces computed eagerly: greedy tokens of steps with prefill chunks beside decodes must
match transformers (the near-tie rule) and the engine without it, for steps that pad to a
bucket and after larger steps left their rows in the buffers.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs
from engine.input_batch import InputBatch
from engine.piecewise_graphs import PiecewiseGraphs, default_piecewise_sizes
from tests.engine.parity import assert_parity, hf_greedy


def test_default_sizes_stop_at_the_limit() -> None:
    assert default_piecewise_sizes(1024)[:4] == [16, 32, 64, 96]
    assert default_piecewise_sizes(1024)[-1] == 1024
    assert default_piecewise_sizes(300)[-1] == 256
    assert default_piecewise_sizes(8) == []


def _with_stand_in(llm: LLM, sizes: list[int]) -> tuple[PiecewiseGraphs, list[InputBatch]]:
    engine = llm.engine
    pieces = PiecewiseGraphs(
        engine.runner.model, engine.storage, sizes, engine.device, capture=False
    )
    engine.runner.piecewise = pieces
    seen: list[InputBatch] = []
    run = pieces.run

    def recording(batch: InputBatch) -> torch.Tensor:
        seen.append(batch)
        return run(batch)

    pieces.run = recording  # type: ignore[method-assign]
    return pieces, seen


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("with_decode_graphs", [False, True])
def test_stand_in_matches_transformers_and_eager(tiny_llama_gqa, with_decode_graphs) -> None:
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
        engine.runner.graphs = DecodeGraphs(
            engine.runner.model, engine.storage, [1, 2, 4, 8],
            -(-engine.max_model_len // engine.storage.block_size), engine.device, capture=False,
        )  # fmt: skip
    pieces, seen = _with_stand_in(llm, [8, 16, 24])
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
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, 10, None)
        assert_parity(outs[i], ref, f"prompt {i} piecewise")
        assert_parity(eager[i], ref, f"prompt {i} eager")
    assert_parity(alone[0], hf_greedy(hf, prompts[1], 10, None), "alone, piecewise")


def test_padding_rows_write_no_kv_after_a_larger_step(tiny_llama_gqa) -> None:
    """A 20-token step leaves its slots in the buffer; a following 5-token step of the same
    bucket must give rows 5..24 slot -1 again, or their K/V would land on live slots."""
    llm = LLM(str(tiny_llama_gqa), attention_backend="torch", max_num_batched_tokens=24,
              device="cpu")
    engine = llm.engine
    pieces, seen = _with_stand_in(llm, [24])
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
