"""Tensor parallelism over NCCL on two GPUs (``gpu``; skipped with fewer): TP=2, this process
on cuda:0 and one spawned rank on cuda:1, against transformers on the same weights.

- the tiny GQA model whose heads, KV heads and vocabulary pad at N=2 (as in
  tests/engine/test_tensor_parallel.py), float32, under the float32 near-tie rule;
- the embedded default model in bfloat16 (the CUDA default) against transformers in
  bfloat16 on cuda:0, under the bf16 rule (tests/engine/parity.py).

One GPU runs the NCCL path as a group of one rank (tests/engine/test_tensor_parallel_group.py).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import assert_parity, hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

PROMPT_IDS = [
    [1, 17, 42, 99, 7],
    [1, 200, 3, 3, 150, 11, 64, 90, 21, 5, 8, 13, 34, 55, 89, 144, 33, 2],
]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
MAX_TOKENS = 12


def _tp2(model: str, prompts: list, dtype: str) -> list[list[int]]:
    llm = LLM(model, tensor_parallel_size=2, device="cuda", dtype=dtype, num_kv_blocks=64,
              max_num_seqs=8, max_model_len=256)  # fmt: skip
    try:
        assert llm.engine.tp is not None and llm.engine.tp.backend == "nccl"
        assert llm.engine.device == torch.device("cuda", 0)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params)  # batched: every prompt in the same steps
        llm.engine.check_integrity()
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


def test_tp2_over_nccl_matches_transformers_on_a_padded_model(tmp_path):
    from transformers import LlamaForCausalLM

    path = make_tiny_llama(
        tmp_path, num_kv_heads=3, seed=5, vocab_size=251, hidden_size=192,
        num_attention_heads=6, intermediate_size=208,
    )  # fmt: skip
    got = _tp2(str(path), PROMPT_IDS, "float32")
    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to("cuda:0").eval()
    for i, prompt in enumerate(PROMPT_IDS):
        ref = hf_greedy(hf, prompt, MAX_TOKENS, eos_token_id=None)
        assert_parity(got[i], ref, f"TP=2 NCCL padded model, prompt {i}")


def test_tp2_over_nccl_matches_transformers_on_the_default_model():
    from transformers import AutoTokenizer, LlamaForCausalLM

    from engine.loader import resolve_model

    path = resolve_model("default").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in TEXT_PROMPTS]
    got = _tp2("default", ids, "bfloat16")
    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to("cuda:0").eval()
    for prompt, prompt_ids, tokens in zip(TEXT_PROMPTS, ids, got, strict=True):
        ref = hf_greedy(hf, prompt_ids, MAX_TOKENS, eos_token_id=None)
        assert_parity(tokens, ref, f"TP=2 NCCL default model {prompt!r}", dtype=torch.bfloat16)
