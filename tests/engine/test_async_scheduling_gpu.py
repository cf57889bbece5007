"""Asynchronous scheduling on a real GPU: the picks stay on the device between steps (fed
to the next step's decodes by ``index_copy_``, copied to pinned host memory behind the
step's work), steps replay decode and piecewise graphs, and every token equals what
synchronous steps give: float32 token-exact with transformers, and in bf16 the synchronous
engine's own tokens (the same kernels on the same batches: nothing stops early, so both
run the same plans)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.parity import assert_parity, hf_greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

KV = 64 * 2**20  # small explicit KV budgets: several test engines share one GPU


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 70, (count,), generator=g)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_steps_give_the_tokens_of_synchronous_steps(tiny_llama_gqa, dtype: str) -> None:
    prompts = _prompts(12)
    params = [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=2, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=8, top_p=0.9, seed=7, ignore_eos=True),
    ] * 3  # no EOS: a stop would leave a wasted row in the asynchronous batches only
    kwargs = dict(device="cuda", dtype=dtype, kv_cache_memory=KV, max_num_seqs=8,
                  max_num_batched_tokens=48)  # fmt: skip
    sync = LLM(str(tiny_llama_gqa), **kwargs)
    overlapped = LLM(str(tiny_llama_gqa), async_scheduling=True, **kwargs)
    assert overlapped.engine.runner.graphs is not None
    expected = sync.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    for i, (want, ours) in enumerate(zip(expected, got, strict=True)):
        assert (ours.token_ids, ours.finish_reason) == (want.token_ids, want.finish_reason), i
        assert ours.logprobs == want.logprobs, i
    engine = overlapped.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.check_integrity()
    if dtype == "float32":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tiny_llama_gqa, dtype=torch.float32).eval()
        for i in range(0, len(prompts), 4):  # the plain greedy requests
            ref = hf_greedy(hf, prompts[i], 14, None)
            assert_parity(got[i].token_ids, ref, f"prompt {i}, async, CUDA graphs")


def test_launch_and_sample_never_wait_for_the_device(tiny_llama_gqa) -> None:
    """No host-device synchronisation inside a step but the read of its picks (issue 35):
    under torch's sync debug mode "error", launching and sampling asynchronous steps raise at
    any hidden one. Decode graphs, piecewise graphs and eager mixed steps; greedy, seeded
    top-k/top-p sampling, logprobs, penalties; shared prompts (copy-on-write blocks)."""
    prompts = _prompts(6)
    prompts += [prompts[0]] * 2  # fully cached: copy-on-write of the last block
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=1, logprobs=3),
        SamplingParams(max_tokens=10, temperature=0, frequency_penalty=0.5,
                       repetition_penalty=1.2),  # fmt: skip
        SamplingParams(max_tokens=10, temperature=1.0, min_p=0.05, seed=9, ignore_eos=True),
    ] * 2
    llm = LLM(
        str(tiny_llama_gqa), device="cuda", dtype="bfloat16", kv_cache_memory=KV,
        max_num_seqs=8, max_num_batched_tokens=48, async_scheduling=True,
    )  # fmt: skip
    runner = llm.engine.runner
    calls = []

    def strict(fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(fn.__name__)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return call

    runner.launch = strict(runner.launch)
    runner.sample = strict(runner.sample)
    outs = llm.generate(prompts, params)
    assert all(o.token_ids for o in outs)
    assert calls.count("launch") > 10 and calls.count("sample") == calls.count("launch")
