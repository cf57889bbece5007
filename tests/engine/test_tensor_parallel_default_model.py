"""Tensor parallelism offline on the embedded default model (SmolLM2-135M: 9 heads in 3 KV
groups, padded to 12 and 4 at N=2): TP=2 (this process and one spawned gloo rank) gives
TP=1's greedy tokens, float32, batched, under the near-tie rule with TP=1's top-2 logprob
margins as the reference. tests/engine/test_tensor_parallel.py covers a tiny padded model
against transformers; tests/server/test_tensor_parallel_server.py the default model through
the server. Its own module: a process holds one tensor-parallel group at a time, and the
other module's group lives as long as that module."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.parity import Reference, assert_parity

pytestmark = pytest.mark.slow  # the embedded default model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
MAX_TOKENS = 8
OPTIONS = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256)


def test_tp2_matches_tp1_on_the_default_model():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    # TP=1 on the float32 weights, as every TP rank runs (TP=1's default on this GGUF-born
    # checkpoint multiplies by its Q4_1 blocks instead: the same values, another path, and
    # a longer load).
    tp1 = LLM("default", matmul_weights="float32", **OPTIONS).generate(PROMPTS, params)
    llm = LLM("default", tensor_parallel_size=2, **OPTIONS)
    try:
        assert llm.engine.tp is not None and llm.engine.tp.world_size == 2
        assert llm.engine.storage.key_caches[0].shape[2] == 2  # its 2 of the 4 padded KV heads
        tp2 = llm.generate(PROMPTS, params)
        llm.engine.check_integrity()
    finally:
        llm.shutdown()
    for prompt, one, two in zip(PROMPTS, tp1, tp2, strict=True):
        assert len(one.token_ids) == MAX_TOKENS
        assert_parity(two.token_ids, Reference.from_output(one), f"TP=2 vs TP=1 {prompt!r}")
