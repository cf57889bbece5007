"""benchmarks/kv_quant.py's measurements: the teacher-forced scoring through the paged cache
is the model's own log-likelihood (float KV, against transformers on the same weights), and
the greedy agreement is a common prefix."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from benchmarks.kv_quant import common_prefix, make_llm, target_logprobs
from tests.engine.conftest import make_tiny_llama


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-score"), num_kv_heads=2, seed=9)


def test_scoring_through_the_cache_is_the_models_log_likelihood(model_path):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    args = argparse.Namespace(model=str(model_path))
    llm = make_llm("auto", args, num_kv_blocks=16)
    got = target_logprobs(llm, ids, chunk=32)  # chunks of 32, 32 and 5 rows
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # int8 KV scores the same passage a little differently, never wildly
    int8 = target_logprobs(make_llm("int8", args, num_kv_blocks=16), ids, chunk=32)
    assert 0 < float((int8 - got).abs().max()) < 0.5


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([5], [6, 7]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_prompts_beyond_the_topics_are_refused(capsys):
    from benchmarks.kv_quant import EXTRA_PROMPT_TOPICS, PROMPT_TOPICS, main

    n = len(PROMPT_TOPICS) + len(EXTRA_PROMPT_TOPICS)
    assert len(set(PROMPT_TOPICS + EXTRA_PROMPT_TOPICS)) == n  # no prompt counted twice
    with pytest.raises(SystemExit) as e:
        main(["--quality", "--prompts", str(n + 1)])
    assert e.value.code == 2
    assert f"--prompts must be 1..{n}" in capsys.readouterr().err
