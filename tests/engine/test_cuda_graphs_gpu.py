"""Decode graphs on a real GPU: replay gives the tokens eager mode gives, float32 stays
token-exact with transformers, and bf16 agrees with transformers' bf16 up to the bf16
near-tie rule (tests/engine/parity.py: a divergence only where the reference's top-2 margin
is within ``BF16_ULPS`` bf16 ulps of the top logit)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.parity import assert_parity, hf_greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

KV = 64 * 2**20  # small explicit KV budgets: several test engines share one GPU


def _prompts(vocab: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 60, (count,), generator=g)
    ]


def test_graphs_match_eager_and_transformers_in_float32(tiny_llama_gqa) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 13)
    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=KV, max_num_seqs=16)
    graphs = LLM(str(tiny_llama_gqa), **kwargs)
    assert graphs.engine.runner.graphs is not None
    assert graphs.engine.runner.prefill_graphs is not None
    eager = LLM(str(tiny_llama_gqa), enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None and eager.engine.runner.prefill_graphs is None
    with_graphs = [o.token_ids for o in graphs.generate(prompts, params)]
    without = [o.token_ids for o in eager.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, 16, None)
        assert_parity(with_graphs[i], ref, f"prompt {i}, CUDA graphs")
        assert_parity(without[i], ref, f"prompt {i}, eager")


@pytest.mark.parametrize("mode", ["full", "full, one launch", "piecewise"])
def test_prefill_graphs_replay_mixed_steps_exactly_in_float32(
    tiny_llama_gqa, mode, monkeypatch
) -> None:
    """Chunked prompts beside running decodes: those steps replay the prefill graphs
    (padded to a token bucket), whole where their attention is one launch and in pieces
    elsewhere, and tokens match eager mode and transformers. "full, one launch" makes every
    mixed step's attention one launch (the decode kernel's split heuristic answers 1), so
    mixed steps replay whole too."""
    from transformers import AutoModelForCausalLM

    import kernels.paged_attention

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 11)
    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=KV, max_num_seqs=8,
                  max_num_batched_tokens=40)  # fmt: skip
    llm = LLM(str(tiny_llama_gqa), cuda_graph_prefill_mode=mode.split(",")[0], **kwargs)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and graphs.sizes == [16, 32]
    sizes: list[tuple[int, int]] = []
    run = graphs.run

    def recording(batch):
        sizes.append((batch.num_tokens, batch.attn.num_decodes))
        return run(batch)

    graphs.run = recording  # type: ignore[method-assign]
    if mode == "full, one launch":
        monkeypatch.setattr(kernels.paged_attention, "choose_num_splits", lambda *a, **k: 1)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    mixed = sum(0 < nd < n for n, nd in sizes)
    assert any(0 < nd < n and n not in (16, 32) for n, nd in sizes), sizes
    if mode == "piecewise":
        assert graphs.replays["whole"] == 0
    else:
        assert graphs.replays["whole"] >= sum(nd == 0 for _, nd in sizes) > 0
    if mode == "full, one launch":
        assert graphs.replays["whole"] >= mixed > 0
    eager = LLM(str(tiny_llama_gqa), enforce_eager=True, **kwargs)
    without = [o.token_ids for o in eager.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, 12, None)
        assert_parity(ours[i], ref, f"prompt {i}, {mode} graphs")
        assert_parity(without[i], ref, f"prompt {i}, eager")


def test_bf16_graphs_agree_with_transformers_bf16_up_to_near_ties(tiny_llama_gqa) -> None:
    """CUDA graphs in bf16 against transformers in bf16 on the same GPU, under the bf16
    near-tie rule of tests/engine/parity.py."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 9)
    llm = LLM(
        str(tiny_llama_gqa), device="cuda", dtype="bfloat16", kv_cache_memory=KV, max_num_seqs=16
    )
    assert llm.engine.runner.graphs is not None
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.bfloat16).cuda().eval()
    notes = [
        assert_parity(ours[i], hf_greedy(hf, prompt, 16, None), f"prompt {i}", torch.bfloat16)
        for i, prompt in enumerate(prompts)
    ]
    assert sum(n is not None for n in notes) <= len(prompts) // 2, "near-ties are the exception"


def test_dummy_8b_shape_builds_captures_and_decodes() -> None:
    """A real shape with random weights: graphs for every bucket, the KV cache sized after
    them, and steps of batch 1 and 5 (padded to 8) run."""
    llm = LLM("llama-3.2-1b", load_format="dummy", device="cuda", max_num_seqs=8,
              kv_cache_memory=2 * 2**30)  # fmt: skip
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([[1, 2, 3, 4]] * 5, params)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 1  # same prompt, same greedy tokens
