"""Our Llama against transformers' on the same random weights: greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import assert_parity, hf_greedy

PROMPT_LENS = [1, 7, 15, 16, 17, 40, 100]
MAX_TOKENS = 24
# float32 on the CPU wherever the suite runs, against transformers in float32 on the CPU
# (the float32 near-tie rule). A CUDA machine would otherwise build the engine on the GPU in
# bfloat16; tests/engine/test_cuda_parity.py covers CUDA, in float32 and bfloat16. The
# prompts' 364 tokens take at most ~60 blocks of 8: 256 blocks instead of the 1 GiB default.
ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _check_against_hf(path, llm: LLM, prompts: list[list[int]]) -> None:
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for prompt, out in zip(prompts, outs, strict=False):
        ref = hf_greedy(hf, prompt, MAX_TOKENS, eos_token_id=2)
        assert_parity(out.token_ids, ref, label=f"prompt of {len(prompt)} tokens")
        expected = "stop" if out.token_ids[-1] == 2 else "length"
        assert out.finish_reason == expected


@pytest.mark.parametrize("fixture", ["tiny_llama_mha", "tiny_llama_gqa", "tiny_llama_cpu_shapes"])
@pytest.mark.parametrize("block_size,budget", [(16, 512), (8, 16)])
def test_greedy_matches_transformers(request, fixture, block_size, budget):
    """All prompts in one generate() call; budget 16 forces chunked prefill."""
    path = request.getfixturevalue(fixture)
    llm = LLM(str(path), block_size=block_size, max_num_batched_tokens=budget, **ENGINE)
    _check_against_hf(path, llm, _prompts(256))


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        },
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ],
    ids=["rope-linear", "rope-llama3", "tied-bias"],
)
def test_config_variants_match_transformers(tmp_path, overrides):
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=3, **overrides)
    _check_against_hf(path, LLM(str(path), **ENGINE), _prompts(256, seed=1)[:5])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_cpu_kernels_match_transformers(tiny_llama_cpu_shapes, tmp_path, backend):
    """The C++ CPU kernels (chosen by ``auto`` for these shapes) and the reference, through
    chunked prefill and mixed steps, and with biased QKV and tied embeddings."""
    llm = LLM(
        str(tiny_llama_cpu_shapes),
        attention_backend=backend,
        block_size=8,
        max_num_batched_tokens=24,
        **ENGINE,
    )
    assert llm.engine.attention_backend == backend
    _check_against_hf(tiny_llama_cpu_shapes, llm, _prompts(256, seed=2))
    path = make_tiny_llama(
        tmp_path,
        num_kv_heads=2,
        seed=4,
        hidden_size=128,
        intermediate_size=256,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    llm = LLM(str(path), attention_backend=backend, **ENGINE)
    _check_against_hf(path, llm, _prompts(256, seed=3)[:5])


def test_auto_backend_picks_cpu_kernels_only_for_shapes_they_cover(
    tiny_llama_cpu_shapes, tiny_llama_gqa
):
    assert LLM(str(tiny_llama_cpu_shapes), **ENGINE).engine.attention_backend == "cpu"
    assert LLM(str(tiny_llama_gqa), **ENGINE).engine.attention_backend == "torch"  # head_dim 16
    with pytest.raises(ValueError, match="cpu attention backend"):
        LLM(str(tiny_llama_gqa), attention_backend="cpu", **ENGINE)


def test_logprobs_match_transformers_log_softmax(tiny_llama_gqa):
    """The chosen token's logprob and the top-5 are log_softmax of the model's logits."""
    prompt = _prompts(256)[4]
    llm = LLM(str(tiny_llama_gqa), **ENGINE)
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=5))[0]
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_gqa).eval()
    with torch.inference_mode():
        full = torch.tensor([prompt + out.token_ids])
        ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        values, ids = row.topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
