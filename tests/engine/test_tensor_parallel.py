"""Tensor parallelism offline: TP=2 (two gloo ranks: this process and one spawned worker),
scheduling asynchronously, against transformers, on a tiny GQA model whose heads, KV heads
and vocabulary need padding at N=2, and the failure of a worker. One TP=2 engine serves the
module: spawning and loading a rank costs seconds."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig, UnsupportedModelError
from engine.faults import EngineFatalError
from engine.tp_layout import TPLayout, check_shardable
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import assert_parity, hf_greedy

PROMPTS = [
    [1, 17, 42, 99, 7],
    [1, 200, 3, 3, 150, 11, 64, 90, 21, 5, 8, 13, 34, 55, 89, 144, 33, 2],
]
MAX_TOKENS = 12


def _hf_config(**overrides) -> dict:
    base = dict(
        model_type="llama",
        vocab_size=251,
        hidden_size=192,
        intermediate_size=208,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return base | overrides


def test_layout_pads_what_does_not_divide():
    # SmolLM2-135M's shape: 9 heads in 3 groups of 3, 1536 intermediate, 49152 vocabulary.
    smollm = ModelConfig.from_hf(
        _hf_config(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
        )
    )
    layout = TPLayout.of(smollm, 2)
    assert (layout.padded_num_heads, layout.padded_num_kv_heads) == (12, 4)
    assert (layout.num_local_heads, layout.num_local_kv_heads) == (6, 2)
    assert layout.padded_intermediate_size == 1536 and layout.padded_vocab_size == 49152
    assert "query heads 9 -> 12, KV heads 3 -> 4" in layout.describe()
    even = TPLayout.of(ModelConfig.from_hf(_hf_config(num_key_value_heads=2, vocab_size=256)), 2)
    assert not even.is_padded and even.num_local_kv_heads == 1
    assert TPLayout.of(smollm, 1).is_padded is False


def test_heads_that_are_not_whole_groups_are_refused():
    config = ModelConfig.from_hf(_hf_config(num_attention_heads=6, num_key_value_heads=4))
    with pytest.raises(UnsupportedModelError, match="multiple of num_kv_heads"):
        check_shardable(config)


def test_a_mixture_of_experts_is_refused():
    config = dataclasses.replace(
        ModelConfig.from_hf(_hf_config()), model_type="mixtral", num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="does not shard a mixture of experts"):
        check_shardable(config)


def test_llm_refuses_before_starting_any_rank(tmp_path):
    """A shape TP cannot take is refused from the config alone, before a rank is spawned."""
    import json

    from transformers import LlamaConfig

    LlamaConfig(**_hf_config(num_attention_heads=6, num_key_value_heads=4)).save_pretrained(
        tmp_path
    )
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: refused first
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 4
    start = time.monotonic()
    with pytest.raises(UnsupportedModelError, match="multiple of num_kv_heads"):
        LLM(str(tmp_path), tensor_parallel_size=2, device="cpu")
    assert time.monotonic() - start < 10


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    """6 heads in 3 KV groups, vocabulary 251: at N=2 the KV heads pad to 4 (and the query
    heads to 8) and the vocabulary to 252. head_dim 32, so the C++ paged attention runs."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tp-padded"),
        num_kv_heads=3,
        seed=5,
        vocab_size=251,
        hidden_size=192,
        num_attention_heads=6,
        intermediate_size=208,
    )


@pytest.fixture(scope="module")
def reference(padded_model):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(padded_model, torch_dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_TOKENS, eos_token_id=None) for p in PROMPTS]


@pytest.fixture(scope="module")
def tp_llm(padded_model):
    # Asynchronous scheduling (the server's TP test, tests/server/test_tensor_parallel_server.py,
    # runs synchronous steps).
    llm = LLM(
        str(padded_model), tensor_parallel_size=2, num_kv_blocks=64, max_num_seqs=8,
        async_scheduling=True, device="cpu",
    )  # fmt: skip
    yield llm
    llm.shutdown()


def test_tp2_matches_transformers_and_tp1(tp_llm, padded_model, reference):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert tp_llm.engine.tp is not None and tp_llm.engine.tp.world_size == 2
    assert tp_llm.engine.storage.key_caches[0].shape[2] == 2  # its 2 of the 4 padded KV heads
    tp2 = tp_llm.generate(PROMPTS, params)  # batched: both prompts in the same steps
    tp1 = LLM(str(padded_model), num_kv_blocks=64, max_num_seqs=8, device="cpu").generate(
        PROMPTS, params
    )
    for i, ref in enumerate(reference):
        assert_parity(tp2[i].token_ids, ref, f"TP=2 prompt {i}")
        assert_parity(tp1[i].token_ids, ref, f"TP=1 prompt {i}")
    # Again, alone: a prefix-cache hit and a different batch shape take the same tokens.
    (again,) = tp_llm.generate([PROMPTS[1]], params)
    assert_parity(again.token_ids, reference[1], "TP=2 prompt 1 alone")


def test_tp2_with_async_scheduling_feeds_the_workers_the_picks(tp_llm, padded_model):
    """The module's engine schedules asynchronously: rank 0 shares each step's picks over
    the device group and the worker feeds the next step's pending inputs from them, as rank
    0 does (the test above checks greedy tokens). Seeded sampling, penalties and stop tokens
    give TP=1's tokens (one process cannot hold a second TP=2 group to compare with)."""
    engine = tp_llm.engine
    assert engine.async_scheduling
    pending = 0
    schedule = engine.scheduler.schedule

    def counting(*args, **kwargs):
        nonlocal pending
        out = schedule(*args, **kwargs)
        pending += sum(1 for s in out.scheduled if s.token_ids[0] < 0)
        return out

    engine.scheduler.schedule = counting
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    stop = tp_llm.generate([PROMPTS[0]], greedy)[0].token_ids[5]
    mixed = [
        SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop,), ignore_eos=True),
    ]
    prompts = [PROMPTS[1], PROMPTS[1][:9], PROMPTS[0]]
    got = [(o.token_ids, o.finish_reason) for o in tp_llm.generate(prompts, mixed)]
    tp1 = LLM(str(padded_model), num_kv_blocks=64, max_num_seqs=8, device="cpu")
    want = [(o.token_ids, o.finish_reason) for o in tp1.generate(prompts, mixed)]
    assert got == want
    assert got[2][1] == "stop"
    assert pending > 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_killed_worker_fails_the_engine_not_hangs(tp_llm):
    (worker,) = tp_llm.engine.tp.processes
    worker.kill()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    start = time.monotonic()
    with pytest.raises(EngineFatalError, match="tensor-parallel group failed"):
        while True:  # the watchdog notices within its poll; a step fails from then on
            tp_llm.generate([PROMPTS[0]], params)
            assert time.monotonic() - start < 30, "a dead worker went unnoticed for 30 s"
    assert time.monotonic() - start < 30
