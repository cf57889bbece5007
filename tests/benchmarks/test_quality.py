"""benchmarks/quality.py on the default model: the engine's teacher-forced logprobs, and
--quantization int8 against float32 end to end, with written tolerances.

Tolerances (the issue's bar for int8 weights is perplexity within 3% of float; the others
are set below what was measured, as guards against a broken path, not as targets). Measured
with this test's arguments (2 windows of 128 tokens, 4 prompts x 16 tokens, AVX-512 VNNI
build): perplexity +0.09%, top-1 agreement 96.1%, greedy agreement 71.9% of the tokens before
the first divergence (2 of 4 prompts identical). The full report (benchmarks/RESULTS.md)
measures the whole text and 64 tokens.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import quality
from engine import LLM
from scheduler.request import SamplingParams
from tests.engine.conftest import make_tiny_llama

MAX_PERPLEXITY_CHANGE = 0.03
MIN_TOP1_AGREEMENT = 0.85
MIN_GREEDY_AGREEMENT = 0.25


def test_modes_are_data_and_kv_modes_wait_for_their_flag():
    names = [m.name for m in quality.MODES]
    assert names[0] == "float32" and {"w-int8", "kv-int8", "w-int8+kv-int8"} <= set(names)
    kv = next(m for m in quality.MODES if m.name == "kv-int8")
    assert quality.missing_kwargs(kv) in ([], ["kv_cache_dtype"])


def test_the_corpus_ships_with_python():
    text = quality.corpus_text()
    assert text.startswith("The Zen of Python, by Tim Peters")
    assert "Heap queue algorithm" in text and len(text) > 8000


@pytest.fixture(scope="module")
def report(tmp_path_factory, ops) -> dict:
    out = tmp_path_factory.mktemp("quality") / "quality.json"
    argv = ["--modes", "float32,w-int8,kv-int8", "--window", "128", "--max-windows", "2",
            "--tokens", "16", "--prompts", "4", "--no-speed", "--out", str(out),
            "--device", "cpu"]  # fmt: skip
    assert quality.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["device"], report["dtype"]) == ("cpu", "float32")  # the tolerances' setting
    return report


def test_int8_weights_stay_within_the_written_tolerances(report):
    by_mode = {r["mode"]: r for r in report["results"]}
    ref, int8 = by_mode["float32"], by_mode["w-int8"]
    assert ref["perplexity_change"] is None and ref["matmul_weights"] == "float32"
    assert int8["matmul_weights"] == "int8"
    assert abs(int8["perplexity_change"]) <= MAX_PERPLEXITY_CHANGE, int8
    assert int8["top1_agreement"] >= MIN_TOP1_AGREEMENT, int8
    assert int8["greedy_agreement"] >= MIN_GREEDY_AGREEMENT, int8
    # teacher-forced, a flipped near-tie costs one token, not the rest of the prompt
    assert int8["forced_agreement"] >= int8["greedy_agreement"], int8
    assert int8["forced_agreement"] >= MIN_TOP1_AGREEMENT, int8
    assert ref["forced_agreement"] is None  # the reference is not compared with itself
    assert int8["mean_abs_logprob_diff"] > 0  # lossy: not the float model under another name
    # A decode step reads the int8 blocks: under a third of float32's bytes (the MBU model).
    assert int8["weight_bytes_per_decode_step"] < ref["weight_bytes_per_decode_step"] / 3
    assert report["scored_tokens"] == 2 * 127
    kv = by_mode["kv-int8"]
    assert kv["skipped"] is None or "kv_cache_dtype" in kv["skipped"]


def test_scored_top_token_is_the_engines_greedy_choice(tmp_path, ops):
    """prompt_logprobs runs the engine's own forward (here the C++ stack with int8 blocks):
    the top token after each prefix is what greedy generation picks there, and the blocks it
    borrowed are back in the pool."""
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=4, hidden_size=128,
                           intermediate_size=256)  # fmt: skip
    llm = LLM(str(path), quantization="int8", max_num_seqs=2, num_kv_blocks=16, device="cpu")
    ids = [1, 40, 41, 7, 99, 250, 3, 3, 18, 64, 12, 200, 5, 77, 31, 9, 140, 2, 66, 8]
    logprobs, top = quality.prompt_logprobs(llm, ids)
    assert logprobs.shape == top.shape == (len(ids) - 1,) and (logprobs <= 0).all()
    for cut in (3, 11, len(ids) - 1):
        out = llm.generate([ids[:cut]], SamplingParams(max_tokens=1, temperature=0))[0]
        assert out.token_ids == [int(top[cut - 1])], cut
    llm.engine.kv_manager.check_integrity()
    assert llm.engine.kv_manager.num_used_blocks == 0
