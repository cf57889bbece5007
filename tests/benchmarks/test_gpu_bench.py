"""benchmarks.gpu runs end to end on CPU on a tiny dummy shape: the smoke test the issue asks
for, so the one-command GPU benchmark cannot rot between the runs a GPU is lent for."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from benchmarks import gpu
from engine.config import ModelConfig
from engine.cost import StepCostModel
from engine.presets import preset
from tests.triton_devices import INTERPRET


def test_every_engine_section_runs_on_a_tiny_dummy_shape(tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--model", "tiny-llama", "--device", "cpu", "--skip-http", "--out", str(out)]
    assert gpu.main([*argv, "--sections", "batch1,prefill,decode,offline,profile"]) == 0
    figures = json.loads(out.read_text())
    assert figures["graphs"] is False and figures["dtype"] == "float32"
    batch1 = figures["batch1"]
    assert 0 < batch1["floor_s"] < batch1["tpot_s"] and batch1["ttft_s"] > 0
    assert set(figures["prefill"]) == {"16", "64"}
    assert set(figures["decode"]) == {"2", "4"}
    for row in (*figures["prefill"].values(), *figures["decode"].values()):
        assert 0 < row["floor_s"] < row["s"]
    assert figures["offline_tok_s"] > 0
    assert {"batch1", "closed_loop", "offline"} <= set(figures["profile"])
    printed = capsys.readouterr().out
    assert "MBU" in printed and "offline:" in printed


def _triton_engine_with_prefill_graphs(max_num_seqs: int):  # noqa: ANN202
    """The tiny dummy Llama on the interpreted Triton kernels, its steps with prefill tokens
    run through the prefill graphs' CPU stand-in (whole graphs on); no prefix caching, so
    that repeated closed loops prefill alike. Returns (engine, graphs)."""
    from engine import LLM
    from tests.engine.graph_stand_ins import install_prefill_stand_in

    llm = LLM("tiny-llama", load_format="dummy", attention_backend="triton", device="cpu",
              dtype="float32", max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
              num_kv_blocks=64, enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    return engine, install_prefill_stand_in(engine, [16, 32])


@pytest.mark.skipif(not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_the_mixed_step_profile_replays_whole_then_pieces_then_two_launches(capsys) -> None:
    """The profile's closed loop on the Triton backend with the prefill graphs' stand-in:
    mixed steps replay whole, then (whole graphs switched off) pieces, then attend in two
    launches; each run counts its replays, and the switch is put back."""
    engine, graphs = _triton_engine_with_prefill_graphs(4)
    result = gpu.profile_mixed_attention(engine, 4, 12, 4, 8)
    assert set(result) == {"one_launch", "one_launch_pieces", "two_launches"}
    assert result["one_launch"]["replays"]["whole"] > 0
    assert result["one_launch"]["mixed_steps"] > 0
    assert result["one_launch_pieces"]["replays"]["whole"] == 0
    two = result["two_launches"]
    assert two["replays"]["pieces"] >= two["mixed_steps"] > 0  # not one launch: pieces
    assert graphs.whole
    assert "mixed steps, pieces / whole" in capsys.readouterr().out


@pytest.mark.skipif(not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
def test_the_split_mixed_step_profile_replays_pieces_then_whole(monkeypatch, capsys) -> None:
    """Few requests with long prompts, on the Triton backend with the prefill graphs'
    stand-in: where the decode kernel splits (as on a GPU; forced here, the CPU never
    splits) mixed steps replay pieces; with every mixed step in one launch, whole. The split
    heuristic is put back."""
    import kernels.paged_attention

    def splits(*args: object, **kwargs: object) -> int:
        return 4

    monkeypatch.setattr(kernels.paged_attention, "choose_num_splits", splits)
    engine, _ = _triton_engine_with_prefill_graphs(2)
    result = gpu.profile_split_mixed_steps(engine, 2, 20, 4, 4)
    split, one = result["split"], result["one_launch"]
    assert split["mixed_steps"] > 0 and one["mixed_steps"] > 0
    assert split["replays"]["pieces"] >= split["mixed_steps"]
    assert one["replays"]["whole"] >= one["mixed_steps"]
    assert kernels.paged_attention.choose_num_splits is splits
    assert "few long mixed steps, one launch / split" in capsys.readouterr().out


def test_the_engine_sections_run_with_async_scheduling(tmp_path: Path) -> None:
    """The batch-1 figures are timed by token arrivals, which an asynchronous step returns
    one step late: TTFT and TPOT still come out as one prefill and one decode each."""
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--model", "tiny-llama", "--device", "cpu", "--skip-http", "--out", str(out),
            "--async-scheduling", "--sections", "batch1,decode,offline"]  # fmt: skip
    assert gpu.main(argv) == 0
    figures = json.loads(out.read_text())
    assert figures["async_scheduling"] is True
    batch1 = figures["batch1"]
    assert 0 < batch1["floor_s"] < batch1["tpot_s"] and batch1["ttft_s"] > 0
    assert figures["offline_tok_s"] > 0


def test_the_http_servers_command_serves_what_the_engine_part_measured() -> None:
    args = gpu.parse_args(
        ["--model", "llama-3-8b", "--kv-cache-dtype", "int8", "--enforce-eager",
         "--server-args", "--target-itl-ms 20"]
    )  # fmt: skip
    cmd = gpu.server_command(args, 64).split()
    assert cmd[1:3] == ["-m", "server"] and "{port}" in cmd
    flags = " ".join(cmd[cmd.index("--model") :])
    assert flags == (
        "--model llama-3-8b --load-format dummy --max-num-seqs 64 --kv-cache-dtype int8 "
        "--enforce-eager --target-itl-ms 20"
    )
    # The synthetic tokenizer's directory, the quick CPU run's KV budget and the peaks the
    # engine part measured (on the CPU) are passed on before --server-args.
    cmd = gpu.server_command(args, 64, "/tmp/tok", 2**26, (2e10, 1.5e12))
    assert cmd.endswith(
        "--tokenizer /tmp/tok --kv-cache-dtype int8 --kv-cache-memory 67108864 "
        "--peak-bandwidth-gbps 20 --peak-tflops 1.5 --enforce-eager --target-itl-ms 20"
    )
    # auto (the default) leaves the server its own default; on and off are passed on
    for given, passed in ((["--async-scheduling"], "on"), (["--async-scheduling", "off"], "off")):
        args = gpu.parse_args(["--model", "llama-3-8b", *given])
        assert f" --async-scheduling {passed}" in gpu.server_command(args, 64)
    # the prefill graphs' mode likewise: full is the default, piecewise is passed on
    assert "--cuda-graph-prefill-mode" not in gpu.server_command(args, 64)
    args = gpu.parse_args(["--model", "llama-3-8b", "--cuda-graph-prefill-mode", "piecewise"])
    assert gpu.server_command(args, 64).endswith(" --cuda-graph-prefill-mode piecewise")


def test_the_first_request_probe_reads_the_servers_own_ttft(tmp_path: Path) -> None:
    """Against a real server (the tiny random Llama on one CPU thread): the client's TTFTs
    and the server's histogram for the first request and the steady one, each positive,
    the server's within the client's (it starts later and ends earlier). One steady
    request: the client's median and the server's mean of several are different
    statistics, which a slow request on a loaded machine sets apart."""
    from tests.server.tiny_server import make_tiny_model_dir, tiny_server

    model = make_tiny_model_dir(tmp_path / "tiny")
    with tiny_server(model, tmp_path / "server.log") as server:
        served = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        first, steady, server_first, server_steady = gpu.first_request_ttft(
            server.url, served, 8, reps=1
        )
    assert server_first is not None and server_steady is not None
    assert 0 < server_first <= first and 0 < server_steady <= steady


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3.2-1b", "mixtral-8x7b"])
def test_the_prefill_flop_floor_counts_the_lm_head_for_the_last_token_only(name: str) -> None:
    """2 x (the layers' matmul weights x tokens + vocab x hidden): the logits of a prefill's
    last token only. A mixture's tokens each run the router and their top-k experts."""
    mc = ModelConfig.from_hf(preset(name))
    cost = StepCostModel.from_config(mc, 2)
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    mlp = 3 * h * mc.intermediate_size
    if mc.num_experts:
        mlp = h * mc.num_experts + mc.num_experts_per_tok * 3 * h * mc.moe_intermediate_size
    body = mc.num_layers * (2 * h * q + 2 * h * kv + mlp)
    flops = 1e15
    for n in (1, 128, 2048):
        floor = gpu.prefill_flop_floor(cost, n, flops)
        assert floor == pytest.approx(2 * (body * n + mc.vocab_size * h) / flops, rel=1e-12)
    if name == "llama-3-8b":  # the published 8.03B: 6.98B in the layers, 0.53B the head
        assert 2 * (body * 2048 + mc.vocab_size * h) == pytest.approx(28.6e12, rel=1e-3)


def test_the_http_part_serves_a_preset_through_a_synthetic_tokenizer(
    tmp_path: Path, capsys
) -> None:
    """A preset has no tokenizer: the HTTP part's server gets one of exactly its vocabulary,
    in which every prompt word is one token, and runs every concurrency point."""
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--model", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
            "--sections", "http", "--concurrency", "1,2", "--out", str(out)]  # fmt: skip
    assert gpu.main(argv) == 0
    http = json.loads(out.read_text())["http"]
    assert http["tokenizer"] == "synthetic"
    assert 0 < http["server_first_ttft_s"] <= http["first_ttft_s"]
    assert set(http["points"]) == {"1", "2"}
    for c, row in http["points"].items():
        assert row["num_errors"] == 0 and row["num_completed"] == max(4, 2 * int(c))
        # prompts of the requested length, each output token streamed on its own
        assert row["mean_prompt_tokens"] == 16 and row["mean_output_tokens"] == 16
        assert row["itl_p50_s"] > 0 and row["tpot_p50_s"] > 0
    printed = capsys.readouterr().out
    assert "synthetic tokenizer of 512 tokens" in printed and "HTTP c=2:" in printed
    assert "skipped" not in printed
    row = http["points"]["2"]  # the ITL spread the c=64 target reads, from the server's own
    spread = row["server_itl_p99_s"] / row["server_itl_p50_s"]
    assert f"p99 / p50 {spread:.2f}x" in printed.split("HTTP c=2:")[1].splitlines()[0]


def test_the_http_part_picks_its_tokenizer(tmp_path: Path) -> None:
    """A synthetic tokenizer for a dummy preset without --tokenizer only; a given one that
    misses much of the vocabulary (a smaller model's) is reported, a padded one is not."""
    preset_args = gpu.parse_args(["--model", "tiny-llama"])
    written = gpu.synthetic_tokenizer(preset_args, tmp_path / "tok")
    assert written is not None and (Path(written) / "tokenizer.json").is_file()
    given = gpu.parse_args(["--model", "tiny-llama", "--tokenizer", "/x"])
    real = gpu.parse_args(["--model", "tiny-llama", "--load-format", "auto"])
    assert gpu.synthetic_tokenizer(given, tmp_path / "a") is None
    assert gpu.synthetic_tokenizer(real, tmp_path / "b") is None

    class Sized:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    warning = gpu.tokenizer_shortfall(Sized(49152), 128256)
    assert warning is not None and "49152 tokens for a vocabulary of 128256" in warning
    assert gpu.tokenizer_shortfall(Sized(151665), 152064) is None  # Qwen2.5's padding


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--sections", "batch1,decod"], "--sections: unknown decod (choose from batch1,"),
        (["--device", "gpu"], "device must be cpu, cuda or cuda:N, got 'gpu'"),
        (["--dtype", "bf16"], "argument --dtype: invalid choice: 'bf16'"),
    ],
)
def test_a_mistake_on_its_command_line_is_one_line_before_anything_runs(
    capsys, argv: list[str], says: str
) -> None:
    """A misspelt section would otherwise not run, silently, in a GPU session's one call."""
    with pytest.raises(SystemExit) as info:
        gpu.parse_args(argv)
    assert info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("python -m benchmarks.gpu: error: ") and says in line, line


def test_a_model_the_engine_refuses_is_one_line(capsys) -> None:
    assert gpu.main(["--model", "no-such-model", "--quick", "--skip-http"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m benchmarks.gpu: error: model path"), line
