"""benchmarks/kv_quant.py's measurements: the teacher-forced scoring through the paged cache
is the model's own log-likelihood (float KV, against transformers on the same weights), and
the greedy agreement is a common prefix. Also its device plumbing, on the CPU: bfloat16 runs
(the Triton kernels under the interpreter, as a GPU runs them compiled), dummy weights of a
shape preset for capacity and throughput, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.kv_quant import (
    common_prefix,
    main,
    make_llm,
    parse_args,
    round_stores_to_bfloat16,
    score,
    target_logprobs,
)
from tests.engine.conftest import make_tiny_llama
from tests.triton_devices import ON_INTERPRETED_CPU


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-score"), num_kv_heads=2, seed=9)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer: --quality scores text."""
    from tests.server.tiny_server import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-text"))


def report_of(out: str) -> dict:
    """The JSON report at the end of a --json run's output."""
    return json.loads(out[out.index("\n{") :])


QUICK_QUALITY = ["--prompts", "2", "--prompt-len", "12", "--tokens", "6", "--ppl-tokens", "40"]
QUICK_QUALITY += ["--chunk", "16", "--json"]


def test_scoring_through_the_cache_is_the_models_log_likelihood(model_path):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    args = parse_args(["--quality", "--model", str(model_path)])
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
    from benchmarks.kv_quant import EXTRA_PROMPT_TOPICS, PROMPT_TOPICS

    n = len(PROMPT_TOPICS) + len(EXTRA_PROMPT_TOPICS)
    assert len(set(PROMPT_TOPICS + EXTRA_PROMPT_TOPICS)) == n  # no prompt counted twice
    with pytest.raises(SystemExit) as e:
        main(["--quality", "--prompts", str(n + 1)])
    assert e.value.code == 2
    assert f"--prompts must be 1..{n}" in capsys.readouterr().err


def test_the_rounding_floor_stores_bfloat16_values(model_path):
    args = parse_args(["--quality", "--model", str(model_path)])
    llm = make_llm("auto", args, num_kv_blocks=16, attention_backend="torch")
    round_stores_to_bfloat16(llm)
    ids = list(range(3, 40))
    target_logprobs(llm, ids, chunk=16)
    storage = llm.engine.storage
    for cache in (*storage.key_caches, *storage.value_caches):
        rows = cache[:3].reshape(-1)  # blocks 0-2 hold the 37 tokens' rows (and zeros)
        assert rows.abs().sum() > 0
        assert torch.equal(rows, rows.to(torch.bfloat16).float())


def test_quality_report_rows(text_model, capsys):
    """The report end to end on the tiny model: auto agrees with itself everywhere, and every
    row has its teacher-forced agreement on auto's text."""
    argv = ["--quality", "--model", str(text_model), "--dtypes", "int8", "--rounding-floor"]
    assert main(argv + QUICK_QUALITY) == 0
    out = capsys.readouterr().out
    report = report_of(out)
    assert report["setup"]["reference"] == "auto (float32)"
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
    argv = ["--throughput", "--model", str(model_path), "--dtypes", "int8", "--repeat", "2"]
    argv += ["--num-requests", "3", "--prompt-tokens", "20", "--max-tokens", "3"]
    argv += ["--kv-cache-memory", str(16 * 2 * 16 * 512), "--json"]  # 16 float32 blocks
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = report_of(out)["throughput"]
    assert [(r["run"], r["kv_cache_dtype"]) for r in rows] == [
        (1, "auto"), (1, "int8"), (2, "auto"), (2, "int8"),
    ]  # fmt: skip
    auto, int8 = rows[0], rows[1]
    assert int8["kv_tokens"] > 3 * auto["kv_tokens"]  # float32 -> int8: 3.88x per byte
    assert all(r["output_tokens_per_s"] > 0 for r in rows)


@ON_INTERPRETED_CPU  # CPU tensors: compiled kernels (a CUDA machine's) cannot take them
def test_quality_in_bfloat16_through_the_triton_kernels(text_model, capsys):
    """A GPU's quality run on the CPU: bfloat16, the Triton kernels (interpreted here), and
    auto in bfloat16 as the reference every label names."""
    argv = ["--quality", "--model", str(text_model), "--dtype", "bfloat16", "--dtypes", "int8"]
    argv += ["--attention-backend", "triton", "--prompts", "1", "--prompt-len", "8"]
    argv += ["--tokens", "4", "--ppl-tokens", "24", "--chunk", "16", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = report_of(out)
    assert report["setup"]["dtype"] == "bfloat16"
    assert report["setup"]["reference"] == "auto (bfloat16)"
    auto, int8 = report["quality"]
    assert len(auto["greedy_prefix"]) == 1
    assert (auto["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("auto", "int8")
    assert auto["attention_backend"] == int8["attention_backend"] == "triton"
    assert auto["greedy_agreement"] == auto["forced_agreement"] == 1.0
    assert 0 < int8["mean_abs_logprob_diff"] < 0.5  # int8 against bfloat16: close, not equal
    assert int8["bytes_per_token"] < auto["bytes_per_token"]
    assert "| auto (bfloat16) | triton |" in out
    assert "vs auto (bfloat16)" in out and "float32" not in out.split("\n{")[0]


def test_capacity_in_bfloat16_at_head_dim_64(tmp_path, capsys):
    """The issue's bf16 bar: int8 and fp8 hold >= 1.9x the tokens at the same memory."""
    model = make_tiny_llama(
        tmp_path / "hd64", num_kv_heads=1, hidden_size=128, num_attention_heads=2
    )
    argv = ["--capacity", "--model", str(model), "--dtype", "bfloat16"]
    assert main(argv + ["--kv-cache-memory", str(2**20), "--json"]) == 0
    out = capsys.readouterr().out
    rows = {r["kv_cache_dtype"]: r for r in report_of(out)["capacity"]}
    auto = rows["auto"]
    assert auto["bytes_per_token"] == 2 * 2 * 64 * 2  # layers x (K, V) x head_dim x bf16
    assert auto["ratio"] == 1.0
    for kv in ("int8", "fp8"):
        assert rows[kv]["ratio"] >= 1.9
        assert rows[kv]["kv_tokens"] == pytest.approx(auto["kv_tokens"] * rows[kv]["ratio"])
    assert "| auto (bfloat16) |" in out


def test_dummy_weights_of_a_preset_serve_capacity_and_throughput(capsys):
    """--load-format dummy with a shape preset: no checkpoint, token ids only."""
    argv = ["--capacity", "--throughput", "--model", "tiny-llama", "--load-format", "dummy"]
    argv += ["--dtype", "bfloat16", "--dtypes", "int8", "--num-requests", "4"]
    argv += ["--prompt-tokens", "24", "--max-tokens", "2", "--kv-cache-memory", str(64 * 256)]
    assert main(argv + ["--json"]) == 0
    report = report_of(capsys.readouterr().out)
    assert report["setup"]["load_format"] == "dummy"
    auto, int8 = report["capacity"]
    assert auto["bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # tiny-llama: 2 KV heads of 16
    assert int8["kv_tokens"] > auto["kv_tokens"]
    rows = report["throughput"]
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "int8"]
    assert [r["kv_tokens"] for r in rows] == [auto["kv_tokens"], int8["kv_tokens"]]
    assert all(r["output_tokens_per_s"] > 0 for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--quality", "--model", "llama-3-8b", "--load-format", "dummy"],
            "--quality needs real weights and text, and --load-format dummy gives random ones",
        ),
        (
            ["--quality", "--dtype", "bfloat16", "--rounding-floor"],
            "--rounding-floor rounds a float32 cache to bfloat16; with --dtype bfloat16",
        ),
        (["--dtype", "bfloat16"], "give --quality, --throughput and/or --capacity"),
    ],
)
def test_meaningless_combinations_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err
    assert "Traceback" not in err


def test_device_and_dtype_defaults(monkeypatch, capsys):
    assert parse_args(["--quality"]).dtype == "float32"
    assert parse_args(["--quality", "--dtype", "bfloat16"]).dtype == "bfloat16"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args(["--capacity", "--device", "cuda"])
        assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse_args(["--capacity", "--device", "cuda"])
    assert (args.device, args.dtype) == ("cuda", "bfloat16")


def test_a_model_error_is_one_line(model_path, capsys):
    """A preset without dummy weights, text scoring without a tokenizer, and a backend the
    dtype does not fit: one line each, exit status 2."""
    assert main(["--capacity", "--model", "llama-3-8b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "is a shape preset, which has no weights: add --load-format dummy" in err
    assert main(["--quality", "--model", str(model_path), *QUICK_QUALITY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tokenizer: --quality scores text" in err
    # an engine the options cannot build: the engine's reason (a backend refusal is an
    # UnsupportedBackendError, a ModelError: reported as the engine words it)
    argv = ["--capacity", "--model", str(model_path), "--dtype", "bfloat16"]
    assert main([*argv, "--attention-backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "error: the cpu attention backend needs float32" in err


def test_a_missing_gguf_package_is_one_line(monkeypatch, capsys):
    """A GPU machine's image lacks gguf, which converting a .gguf model needs."""
    import benchmarks.kv_quant as kv_quant

    def no_gguf(args):
        raise ImportError("Please install torch and gguf>=0.10.0 to load a GGUF checkpoint")

    monkeypatch.setattr(kv_quant, "run", no_gguf)
    assert main(["--quality", "--model", "x.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the gguf package" in err
