"""engine/builder.py's pure decisions, on CPU: ``plan_graphs`` takes a CUDA device without
touching one, so every branch of which steps get CUDA graphs is checked here."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from engine.builder import GraphPlan, plan_graphs
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import default_graph_sizes
from engine.prefill_graphs import default_prefill_sizes
from engine.presets import preset
from engine.tp_group import TensorParallelGroup
from scheduler.config import SchedulerConfig

CUDA = torch.device("cuda")
LLAMA = ModelConfig.from_hf(preset("tiny-llama"))
MOE = ModelConfig.from_hf(preset("mixtral-8x7b"))


def _plan(
    *,
    config: EngineConfig | None = None,
    mc: ModelConfig = LLAMA,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    device: torch.device = CUDA,
    backend: str = "triton",
    tp: Any = None,
    plain_forward: bool = True,
) -> GraphPlan:
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    return plan_graphs(
        config or EngineConfig(),
        mc,
        scheduler,
        device,
        backend,
        cast(TensorParallelGroup | None, tp),
        plain_forward=plain_forward,
    )


def test_cuda_with_triton_gets_the_default_decode_and_prefill_buckets() -> None:
    plan = _plan(max_num_seqs=100, max_num_batched_tokens=512)
    assert plan.decode_sizes == default_graph_sizes(100) and plan.decode_sizes[-1] == 100
    # Prefill buckets stop at the smaller of the step budget and the prefill limit.
    assert plan.prefill_sizes == default_prefill_sizes(512) and plan.prefill_sizes[-1] == 512
    # Captured whole too by default, over at most the scheduler's sequences.
    assert plan.prefill_mode == "full" and plan.max_num_seqs == 100
    assert plan.reserve_bytes is None  # measured later, when the KV cache is sized
    limited = _plan(config=EngineConfig(cuda_graph_max_prefill_tokens=128))
    assert limited.prefill_sizes == default_prefill_sizes(128)
    pieces = _plan(
        config=EngineConfig(cuda_graph_prefill_mode="piecewise"), max_num_batched_tokens=512
    )
    assert pieces.prefill_mode == "piecewise" and pieces.prefill_sizes == plan.prefill_sizes
    with pytest.raises(ValueError, match="full or piecewise"):
        EngineConfig(cuda_graph_prefill_mode="whole")


@pytest.mark.parametrize(
    "why,kwargs",
    [
        ("the CPU", {"device": torch.device("cpu")}),
        ("--enforce-eager", {"config": EngineConfig(enforce_eager=True)}),
        ("tensor parallelism", {"tp": object()}),
        ("the torch attention backend", {"backend": "torch"}),
        ("a mixture of experts", {"mc": MOE}),
    ],
)
def test_no_graphs(why: str, kwargs: dict[str, Any]) -> None:
    assert _plan(**kwargs) == GraphPlan([], []), why


def test_a_mixture_of_experts_says_why_it_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="engine.builder"):
        _plan(mc=MOE)
    assert "mixture of experts runs eagerly" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.builder"):
        _plan(mc=MOE, config=EngineConfig(enforce_eager=True))
    assert "mixture" not in caplog.text  # eager anyway: nothing to explain


def test_given_sizes_are_cut_to_max_num_seqs_with_one_as_the_fallback() -> None:
    given = EngineConfig(cuda_graph_sizes=(1, 8, 32, 128))
    assert _plan(config=given, max_num_seqs=64).decode_sizes == [1, 8, 32]
    assert _plan(config=given, max_num_seqs=128).decode_sizes == [1, 8, 32, 128]
    # None left under max_num_seqs: one bucket of 1, so batch-1 decodes still replay.
    too_large = EngineConfig(cuda_graph_sizes=(32, 64))
    assert _plan(config=too_large, max_num_seqs=16).decode_sizes == [1]


def test_a_backends_own_forward_gets_decode_graphs_but_no_prefill_ones() -> None:
    """Prefill graphs replay the plain model's layers, not a replacement forward."""
    plan = _plan(plain_forward=False)
    assert plan.decode_sizes == default_graph_sizes(64) and plan.prefill_sizes == []


@pytest.mark.parametrize(
    ("env", "log"),
    [("PAGEDSERVE_MATMUL_TUNING", "_log_matmul_tuning"),
     ("PAGEDSERVE_ATTENTION_TUNING", "_log_attention_tuning")],
)  # fmt: skip
def test_a_tuning_table_nothing_here_takes_is_said(monkeypatch, tmp_path, caplog, env, log):
    """The builder warns where a tuning table is set but no kernel of the engine takes it:
    cuBLAS decode matmuls and no quantized weights (PAGEDSERVE_MATMUL_TUNING), or decode
    attention other than the Triton kernel on a GPU (PAGEDSERVE_ATTENTION_TUNING)."""
    import logging

    import engine.builder

    path = tmp_path / "tuning.json"
    path.write_text('{"format": 1, "device": "test", "entries": []}')
    monkeypatch.setenv(env, str(path))
    with caplog.at_level(logging.WARNING, logger="engine.builder"):
        getattr(engine.builder, log)(torch.device("cpu"), False)
    assert "it changes nothing" in caplog.text and env in caplog.text


def test_the_offline_engine_checks_the_device_before_loading(monkeypatch) -> None:
    """``LLM(device=...)`` builds through ``pick_device``: a device this machine lacks is
    one ValueError line before any weight loads (the server checks the same at start-up)."""
    from engine.builder import pick_device

    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'gpu'"):
        EngineConfig(device="gpu")
    assert pick_device(EngineConfig(device="cpu")) == (torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as refused:
        pick_device(EngineConfig(device="cuda", dtype="bfloat16"))
    assert "device 'cuda'" in str(refused.value) and "\n" not in str(refused.value)


def test_kv_settings_that_hold_no_block_are_one_line(monkeypatch, capsys) -> None:
    """A budget below one block of the model is a setting to change: ``KVCacheSettingError``
    (a ModelError, one line on the command line) saying how much one block takes."""
    from engine.config import KVCacheSettingError, ModelError
    from engine.llm import LLM
    from engine.presets import preset
    from server import cli

    per_token = ModelConfig.from_hf(preset("tiny-llama")).kv_bytes_per_token(4)
    with pytest.raises(KVCacheSettingError) as refused:
        LLM("tiny-llama", load_format="dummy", kv_cache_memory=1000)
    assert isinstance(refused.value, ModelError)
    assert f"give it at least {16 * per_token} bytes" in str(refused.value)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr("engine.threads.configure_threads", lambda n: (1, "test"))
    argv = ["serve", "tiny-llama", "--load-format", "dummy", "--kv-cache-memory", "1000"]
    assert cli.main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("pagedserve serve: error: a KV budget of 1000 bytes"), line


def test_a_kv_cache_smaller_than_the_context_caps_the_context(caplog) -> None:
    """A sequence longer than the whole pool could never run: max_model_len comes down to
    what the pool holds, with a warning, so what the server advertises and fills an unset
    max_tokens up to is servable (given or from the model alike)."""
    from engine.llm import LLM
    from scheduler.request import SamplingParams

    with caplog.at_level("WARNING", logger="engine.builder"):
        llm = LLM("tiny-llama", load_format="dummy", device="cpu", num_kv_blocks=4, block_size=16)
    assert llm.engine.max_model_len == 64
    assert "max_model_len 2048 is more than the whole KV cache holds (64 tokens)" in caplog.text
    # A request of the whole capped context runs; one token more is refused as too long.
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="context length of 64"):
        llm.engine.add_request("long", [5] * 60, SamplingParams(max_tokens=5))
    roomy = LLM("tiny-llama", load_format="dummy", device="cpu", num_kv_blocks=4, block_size=16,
                max_model_len=32)  # fmt: skip
    assert roomy.engine.max_model_len == 32
