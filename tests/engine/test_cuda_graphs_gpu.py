"""Decode graphs on a real GPU: replay gives the tokens eager mode gives, float32 stays
token-exact with transformers, and bf16 agrees with transformers' bf16 up to bf16 near-ties.

bf16 tolerance: two bf16 implementations round their matmuls differently, so they may pick
different tokens where the reference's top two logits are within a few bf16 rounding steps
of each other. A divergence is accepted only where the bf16 reference's top-2 margin is at
most ``BF16_ULPS`` units in the last place of bf16 at the top logit's magnitude (bf16 keeps
8 significant bits: one ulp at x is 2**(floor(log2|x|) - 7)); anything else is a bug.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.parity import assert_parity, hf_greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

BF16_ULPS = 4
KV = 64 * 2**20  # small explicit KV budgets: several test engines share one GPU


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def _prompts(vocab: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 60, (count,), generator=g)
    ]


@torch.inference_mode()
def _hf_bf16_greedy(
    model, prompt: list[int], max_new: int
) -> tuple[list[int], list[float], list[float]]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    top2 = [step[0].float().topk(2).values for step in out.logits]
    return tokens, [float(t[0] - t[1]) for t in top2], [float(t[0]) for t in top2]


def test_graphs_match_eager_and_transformers_in_float32(tiny_llama_gqa) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 13)
    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=KV, max_num_seqs=16)
    graphs = LLM(str(tiny_llama_gqa), **kwargs)
    assert graphs.engine.runner.graphs is not None
    eager = LLM(str(tiny_llama_gqa), enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    with_graphs = [o.token_ids for o in graphs.generate(prompts, params)]
    without = [o.token_ids for o in eager.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf, prompt, 16, None)
        assert_parity(with_graphs[i], ref, f"prompt {i}, CUDA graphs")
        assert_parity(without[i], ref, f"prompt {i}, eager")


def test_bf16_agrees_with_transformers_bf16_up_to_near_ties(tiny_llama_gqa) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = _prompts(256, 9)
    llm = LLM(
        str(tiny_llama_gqa), device="cuda", dtype="bfloat16", kv_cache_memory=KV, max_num_seqs=16
    )
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.bfloat16).cuda().eval()
    accepted = 0
    for i, prompt in enumerate(prompts):
        ref, margins, tops = _hf_bf16_greedy(hf, prompt, 16)
        for pos, (a, b) in enumerate(zip(ours[i], ref, strict=True)):
            if a != b:
                bound = BF16_ULPS * bf16_ulp(tops[pos])
                assert margins[pos] <= bound, (
                    f"prompt {i} token {pos}: ours {a}, transformers bf16 {b}, margin "
                    f"{margins[pos]:.3e} > {BF16_ULPS} bf16 ulps ({bound:.3e}): a real mismatch"
                )
                print(
                    f"prompt {i}: bf16 near-tie divergence at token {pos} "
                    f"(margin {margins[pos]:.2e} <= {bound:.2e}), accepted"
                )
                accepted += 1
                break
    assert accepted <= len(prompts) // 2, "near-ties should be the exception"


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
