"""benchmarks/kv_quant.py's measurements: the teacher-forced scoring through the paged cache
is the model's own log-likelihood (float KV, against transformers on the same weights), and
the greedy agreement is a common prefix."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks.kv_quant import (
    common_prefix,
    make_llm,
    round_stores_to_bfloat16,
    score,
    target_logprobs,
)
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
    # the teacher-forced top token is the model's argmax at every position but the last
    _, top = score(llm, ids, chunk=32)
    ref_top = logp[:-1].argmax(dim=-1)
    sorted_logp = logp[:-1].sort(dim=-1, descending=True).values
    clear = (sorted_logp[:, 0] - sorted_logp[:, 1]) > 1e-3  # the near-tie rule
    assert torch.equal(top[clear], ref_top[clear])
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


def test_the_rounding_floor_stores_bfloat16_values(model_path):
    args = argparse.Namespace(model=str(model_path))
    llm = make_llm("auto", args, num_kv_blocks=16, attention_backend="torch")
    round_stores_to_bfloat16(llm)
    ids = list(range(3, 40))
    target_logprobs(llm, ids, chunk=16)
    storage = llm.engine.storage
    for cache in (*storage.key_caches, *storage.value_caches):
        rows = cache[:3].reshape(-1)  # blocks 0-2 hold the 37 tokens' rows (and zeros)
        assert rows.abs().sum() > 0
        assert torch.equal(rows, rows.to(torch.bfloat16).float())


def test_quality_report_rows(tmp_path, capsys):
    """The report end to end on the tiny model: auto agrees with itself everywhere, and every
    row has its teacher-forced agreement on auto's text."""
    from benchmarks.kv_quant import main
    from tests.server.tiny_server import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "tiny")
    argv = ["--quality", "--model", str(model), "--dtypes", "int8", "--rounding-floor"]
    argv += ["--prompts", "2", "--prompt-len", "12", "--tokens", "6", "--ppl-tokens", "40"]
    argv += ["--chunk", "16", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{") :])
    rows = {r["kv_cache_dtype"]: r for r in report["quality"]}
    assert list(rows) == ["auto", "auto, K/V rounded to bfloat16", "int8"]
    auto = rows["auto"]
    assert auto["greedy_agreement"] == auto["forced_agreement"] == 1.0
    assert auto["forced_max_margin"] == 0.0
    for r in rows.values():
        assert 0.0 <= r["forced_agreement"] <= 1.0
        assert len(r["greedy_prefix"]) == 2
    assert rows["int8"]["bytes_per_token"] < auto["bytes_per_token"]


def test_throughput_rounds_alternate_the_dtypes(model_path, capsys):
    """--repeat runs every dtype once a round, and each row compares with its round's auto."""
    from benchmarks.kv_quant import main

    argv = ["--throughput", "--model", str(model_path), "--dtypes", "int8", "--repeat", "2"]
    argv += ["--num-requests", "3", "--prompt-tokens", "20", "--max-tokens", "3"]
    argv += ["--kv-cache-memory", str(16 * 2 * 16 * 512), "--json"]  # 16 float32 blocks
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("{") :])["throughput"]
    assert [(r["run"], r["kv_cache_dtype"]) for r in rows] == [
        (1, "auto"), (1, "int8"), (2, "auto"), (2, "int8"),
    ]  # fmt: skip
    auto, int8 = rows[0], rows[1]
    assert int8["kv_tokens"] > 3 * auto["kv_tokens"]  # float32 -> int8: 3.88x per byte
    assert all(r["output_tokens_per_s"] > 0 for r in rows)
