"""benchmarks/wave.py, the step loop the engine-level benchmarks time, and the benchmarks
built on it (prefix_caching.run, speculative.run_wave), on a tiny random model."""

from __future__ import annotations

import pytest

from benchmarks import prefix_caching, speculative
from benchmarks.wave import run_wave
from engine import LLM, SamplingParams
from tests.engine.conftest import make_tiny_llama

PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


# Pinned to the CPU in float32: on a machine with CUDA the engine's default is CUDA in
# bfloat16, where the exact token equalities asserted here (a speculative run's tokens are
# a plain run's) are not what is being tested.
KWARGS = dict(attention_backend="torch", enable_prefix_caching=False, num_kv_blocks=64,
              device="cpu", dtype="float32")  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("wave"), num_kv_heads=2, seed=1))


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model, **KWARGS)


def test_a_wave_gives_what_generate_gives_and_when(llm: LLM) -> None:
    expected = [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    seen: list[int] = []
    wave = run_wave(llm.engine, PROMPTS, PARAMS, tag="t", on_step=lambda o: seen.append(len(o)))
    assert wave.tokens == expected
    assert wave.output_tokens == 3 * 6
    assert [len(times) for times in wave.token_times] == [6, 6, 6]  # one token a step
    for times in wave.token_times:
        assert times == sorted(times) and wave.start < times[0] <= times[-1]
    assert all(0 < s <= wave.seconds for s in wave.first_token_s)
    assert len(seen) == len(wave.step_stats) > 0
    assert wave.total("num_prefill_tokens") == sum(map(len, PROMPTS))
    assert not llm.engine.has_unfinished_requests()


def test_prefix_caching_and_speculative_runs_count_from_the_wave(llm: LLM) -> None:
    result, tokens = prefix_caching.run(llm, PROMPTS, 6, "off")
    assert tokens == [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    assert result.output_tokens == 18 and result.prefill_tokens == sum(map(len, PROMPTS))
    assert 0 < result.ttft_p50_ms <= result.ttft_p90_ms <= 1e3 * result.seconds
    assert result.hit_rate == 0.0

    alone = speculative.run_wave(llm, PROMPTS[:1], PARAMS)
    assert alone.tokens == tokens[:1] and alone.tpot_s is not None and alone.tpot_s > 0
    assert alone.cpu_per_token_s is not None and alone.draft_tokens == 0
    together = speculative.run_wave(llm, PROMPTS, PARAMS)
    assert together.tokens == tokens and together.decode_tokens_per_s is not None


def test_speculative_run_counts_the_drafts(model: str, llm: LLM) -> None:
    spec = LLM(model, speculative_method="ngram", num_speculative_tokens=2, ngram_min=1,
               speculative_row_cost=0.0, **KWARGS)  # fmt: skip
    # A repeating prompt gives the n-gram lookup something to propose at once; a row cost
    # of 0 lets the policy draft at every step.
    prompt, params = [5, 6, 7] * 8, SamplingParams(max_tokens=12, temperature=0)
    run = speculative.run_wave(spec, [prompt], params)
    assert run.draft_tokens > 0 and 0 < run.verifications <= run.draft_tokens
    assert 0 <= run.accepted_tokens <= run.draft_tokens
    assert run.tokens == [llm.generate([prompt], params)[0].token_ids]  # exact, as greedy
