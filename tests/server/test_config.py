"""ServingConfig parsing: flag > PAGEDSERVE_* env var > default, sizes, errors."""

from __future__ import annotations

import pytest

from server.config import ServerConfig, ServingConfig, env_var_names
from server.flags import parse_size


def test_defaults() -> None:
    config = ServingConfig.from_cli([], {})
    assert config == ServingConfig()
    assert config.engine.model == "default" and config.server.port == 8000
    assert config.kvpool.block_size == 16 and config.kvpool.memory_bytes is None


def test_env_overrides_default_and_flag_overrides_env() -> None:
    env = {
        "PAGEDSERVE_PORT": "9001",
        "PAGEDSERVE_BATCHING": "static",
        "PAGEDSERVE_KV_CACHE_MEMORY": "2GiB",
        "PAGEDSERVE_MAX_NUM_SEQS": "8",
    }
    config = ServingConfig.from_cli(["--port", "9002", "--max-num-seqs", "4"], env)
    assert config.server.port == 9002  # flag wins
    assert config.scheduler.max_num_seqs == 4
    assert config.scheduler.batching == "static"  # env wins over default
    assert config.kvpool.memory_bytes == 2 * 1024**3


def test_every_flag_reaches_its_config() -> None:
    argv = [
        "--model",
        "/models/x",
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "--attention-backend",
        "torch",
        "--max-model-len",
        "1024",
        "--seed",
        "7",
        "--block-size",
        "32",
        "--kv-cache-memory",
        "512MB",
        "--num-kv-blocks",
        "100",
        "--gpu-memory-utilization",
        "0.45",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "256",
        "--prefill-chunk-tokens",
        "64",
        "--batching",
        "dynamic",
        "--block-allocation",
        "reserve",
        "--batch-wait-ms",
        "20",
        "--static-finished",
        "skip",
        "--host",
        "0.0.0.0",
        "--port",
        "1234",
        "--served-model-name",
        "m",
        "--log-level",
        "DEBUG",
        "--max-body-size",
        "1MiB",
        "--max-n",
        "4",
        "--max-logprobs",
        "5",
        "--unknown-fields",
        "ignore",
        "--engine-stall-timeout",
        "9",
        "--stats-log-interval",
        "0",
        "--check-integrity",
        "true",
        "--no-prefix-caching",
    ]
    c = ServingConfig.from_cli(argv, {})
    assert (
        c.engine.model,
        c.engine.dtype,
        c.engine.device,
        c.engine.attention_backend,
        c.engine.max_model_len,
        c.engine.seed,
    ) == ("/models/x", "bfloat16", "cpu", "torch", 1024, 7)
    assert not c.kvpool.enable_prefix_caching
    assert c.kvpool.gpu_memory_utilization == 0.45
    assert (c.kvpool.block_size, c.kvpool.memory_bytes, c.kvpool.num_blocks) == (
        32,
        512_000_000,
        100,
    )
    assert (
        c.scheduler.max_num_seqs,
        c.scheduler.max_num_batched_tokens,
        c.scheduler.prefill_chunk_tokens,
        c.scheduler.batching,
        c.scheduler.block_allocation,
        c.scheduler.batch_wait_ms,
        c.scheduler.static_finished,
    ) == (3, 256, 64, "dynamic", "reserve", 20.0, "skip")
    assert c.server == ServerConfig(
        host="0.0.0.0",
        port=1234,
        served_model_name="m",
        log_level="debug",
        max_body_bytes=1024**2,
        max_n=4,
        max_logprobs=5,
        unknown_fields="ignore",
        engine_stall_timeout_s=9.0,
        stats_log_interval_s=0.0,
        check_integrity=True,
    )


def test_auto_restores_none() -> None:
    c = ServingConfig.from_cli(
        ["--dtype", "auto", "--max-model-len", "auto"], {"PAGEDSERVE_DTYPE": "float16"}
    )
    assert c.engine.dtype is None and c.engine.max_model_len is None


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--batching", "weird"], {}, "argument --batching: invalid choice: 'weird'"),
        (["--port", "http"], {}, "argument --port: invalid int value: 'http'"),
        ([], {"PAGEDSERVE_PORT": "http"}, "PAGEDSERVE_PORT='http': "),
        ([], {"PAGEDSERVE_BATCHING": "weird"}, "PAGEDSERVE_BATCHING='weird': choose from"),
        (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory: not a size: 'lots' (examples:"),
        (["--max-model-len", "big"], {}, "argument --max-model-len: invalid int value: 'big'"),
        (["--enforce-eager", "maybe"], {}, "argument --enforce-eager: not a boolean: 'maybe'"),
        (["--tool-call-parser", "mistral"], {}, "invalid choice: 'mistral'"),
        (["--trust-remote-code"], {}, "unrecognized arguments: --trust-remote-code (pagedserve"),
        (["--served-model-name", ""], {}, "argument --served-model-name: a name cannot be empty"),
        (["--served-model-name", "  "], {}, "--served-model-name: a name cannot be empty"),
        ([], {"PAGEDSERVE_SERVED_MODEL_NAME": ""}, "PAGEDSERVE_SERVED_MODEL_NAME='': a name"),
    ],
)
def test_a_bad_value_is_one_line_naming_it(argv, env, says: str, capsys) -> None:
    """Not argparse's usage block (some fifty lines above the one that matters), and the
    parsers' own words for what they accept."""
    with pytest.raises(SystemExit) as exc:
        ServingConfig.from_cli(argv, env)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pagedserve serve: error: ") and says in line, line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "12"], "block_size"),  # not a power of two (KVPoolConfig's check)
        (["--dtype", "float64"], "dtype must be float32, bfloat16 or float16"),
        (["--target-itl-ms", "0"], "target_itl_ms must be a positive number"),
        (["--target-tpot-ms", "-5"], "target_tpot_ms must be a positive number"),
        (["--target-ttft-ms", "nan", "--target-itl-ms", "100"], "target_ttft_ms must be"),
        (
            ["--target-ttft-ms", "500"],
            "target_ttft_ms needs target_itl_ms, target_itl_ratio or target_tpot_ms",
        ),
        (["--target-itl-ratio", "0.5"], "target_itl_ratio must be a number above 1"),
        (
            ["--target-itl-ms", "100", "--min-prefill-chunk-tokens", "0"],
            "min_prefill_chunk_tokens must be positive",
        ),
        (["--chat-template", "/no/such/template.jinja"], "is not a readable file"),
        (["--max-model-len", "0"], "max_model_len must be positive, got 0"),
        (
            ["--batching", "dynamic", "--batch-wait-ms", "-5"],
            "batch_wait_ms must be a number of milliseconds >= 0, got -5.0",
        ),
        (["--batch-wait-ms", "nan"], "batch_wait_ms must be a number of milliseconds >= 0"),
        (["--stats-log-interval", "-1"], "stats_log_interval_s must be a number of seconds >= 0"),
        (["--stats-log-interval", "inf"], "stats_log_interval_s must be a number of seconds"),
        (["--tokenizer", "/nonexistent"], "--tokenizer '/nonexistent' does not exist"),
        (
            ["--async-scheduling", "--batching", "static"],
            "--async-scheduling needs --batching continuous",
        ),
        (
            ["--async-scheduling", "--speculative-method", "ngram"],
            "--async-scheduling does not run with speculative decoding",
        ),
    ],
)
def test_a_value_a_config_refuses_is_one_error_line(argv: list[str], message: str, capsys) -> None:
    """Flags that parse but that a config's own check refuses: one line naming the value,
    exit status 2, no usage block and no traceback."""
    with pytest.raises(SystemExit) as exc:
        ServingConfig.from_cli(argv, {})
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("pagedserve serve: error: ") and message in lines[0], lines[0]


def test_async_scheduling_flag_reaches_the_engine_config() -> None:
    def parsed(argv: list[str], env: dict[str, str] | None = None) -> bool | None:
        return ServingConfig.from_cli(argv, env or {}).engine.async_scheduling

    # Given alone it means on; auto (the default) leaves it to the device; false is off.
    assert parsed(["--async-scheduling"]) is True
    assert parsed([]) is None and parsed(["--async-scheduling", "auto"]) is None
    assert parsed(["--async-scheduling", "false"]) is False
    assert parsed([], {"PAGEDSERVE_ASYNC_SCHEDULING": "true"}) is True
    assert parsed([], {"PAGEDSERVE_ASYNC_SCHEDULING": "off"}) is False
    assert parsed(["--async-scheduling", "auto"], {"PAGEDSERVE_ASYNC_SCHEDULING": "1"}) is None
    # auto never refuses what the flag refuses: it turns itself off there
    for argv in (["--batching", "static"], ["--speculative-method", "ngram"]):
        assert parsed(argv) is None


def test_async_scheduling_auto_is_on_for_one_cuda_device_only() -> None:
    from engine.config import EngineConfig
    from engine.spec_decode.config import SpeculativeConfig

    auto = EngineConfig()
    assert auto.async_scheduling_for("cuda", "continuous")
    assert not auto.async_scheduling_for("cpu", "continuous")
    assert not auto.async_scheduling_for("cuda", "static")
    assert not EngineConfig(tensor_parallel_size=2).async_scheduling_for("cuda", "continuous")
    spec = EngineConfig(speculative=SpeculativeConfig(method="ngram"))
    assert not spec.async_scheduling_for("cuda", "continuous")
    # what is asked for is what runs (the CPU warns, engine/llm_engine.py)
    assert EngineConfig(async_scheduling=True).async_scheduling_for("cpu", "continuous")
    assert not EngineConfig(async_scheduling=False).async_scheduling_for("cuda", "continuous")


def test_latency_target_flags_reach_the_scheduler_config() -> None:
    c = ServingConfig.from_cli(
        ["--target-itl-ms", "400", "--target-ttft-ms", "2000"], {"PAGEDSERVE_TARGET_TPOT_MS": "150"}
    )
    assert (c.scheduler.target_itl_ms, c.scheduler.target_tpot_ms) == (400.0, 150.0)
    assert c.scheduler.target_ttft_ms == 2000.0 and c.scheduler.has_latency_targets
    plain = ServingConfig.from_cli([], {})
    assert not plain.scheduler.has_latency_targets
    relative = ServingConfig.from_cli(["--target-itl-ratio", "2"], {})
    assert relative.scheduler.target_itl_ratio == 2.0 and relative.scheduler.has_latency_targets


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1073741824", 1024**3),
        ("1GiB", 1024**3),
        ("1gib", 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5G", 1_500_000_000),
        ("64KiB", 65536),
        ("100 b", 100),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "1 parsec", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_env_var_names() -> None:
    names = env_var_names()
    assert all(n.startswith("PAGEDSERVE_") for n in names)
    assert {
        "PAGEDSERVE_MODEL",
        "PAGEDSERVE_HOST",
        "PAGEDSERVE_PORT",
        "PAGEDSERVE_DTYPE",
        "PAGEDSERVE_KV_CACHE_MEMORY",
        "PAGEDSERVE_BLOCK_SIZE",
        "PAGEDSERVE_MAX_NUM_SEQS",
        "PAGEDSERVE_MAX_NUM_BATCHED_TOKENS",
        "PAGEDSERVE_BATCHING",
        "PAGEDSERVE_SERVED_MODEL_NAME",
        "PAGEDSERVE_LOG_LEVEL",
    } <= set(names)


def test_prefix_caching_switch() -> None:
    assert ServingConfig.from_cli([], {}).kvpool.enable_prefix_caching
    assert not ServingConfig.from_cli(["--no-prefix-caching"], {}).kvpool.enable_prefix_caching
    env = {"PAGEDSERVE_NO_PREFIX_CACHING": "1"}
    assert not ServingConfig.from_cli([], env).kvpool.enable_prefix_caching
    flag_wins = ServingConfig.from_cli(["--no-prefix-caching", "false"], env)
    assert flag_wins.kvpool.enable_prefix_caching


def test_tool_flags_reach_the_server_config(tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}{{ tools }}")
    c = ServingConfig.from_cli(
        ["--chat-template", str(template)], {"PAGEDSERVE_TOOL_CALL_PARSER": "llama3_json"}
    )
    assert (c.server.chat_template, c.server.tool_call_parser) == (str(template), "llama3_json")
    assert ServingConfig.from_cli([], {}).server.tool_call_parser == "hermes"


@pytest.mark.parametrize(
    ("value", "parser"),
    [("qwen", "hermes"), ("hermes", "hermes"), ("llama3-json", "llama3_json")],
)
def test_tool_call_parser_aliases_resolve_to_the_parser(value: str, parser: str) -> None:
    flag = ServingConfig.from_cli(["--tool-call-parser", value], {})
    env = ServingConfig.from_cli([], {"PAGEDSERVE_TOOL_CALL_PARSER": value})
    assert flag.server.tool_call_parser == env.server.tool_call_parser == parser


def test_an_unknown_tool_call_parser_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        ServingConfig.from_cli(["--tool-call-parser", "mistral"], {})
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert "invalid choice: 'mistral'" in err and "qwen" in err and "llama3-json" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "name,good,bad,message",
    [
        # read by the kernels mid warm-up
        ("PAGEDSERVE_PDL", ("1",), "yes", "must be 0 or 1, got 'yes'"),
        # read when the model is built
        ("PAGEDSERVE_DECODE_MATMUL", ("library", "triton", ""), "cublas",
         "must be library or triton, got 'cublas'"),
    ],
)  # fmt: skip
def test_a_bad_kernel_switch_is_one_line(capsys, name, good, bad, message) -> None:
    """The kernel switches of kernels/_common.py are read after the server has started
    loading; it checks them before anything runs."""
    for value in good:
        assert ServingConfig.from_cli([], {name: value}) is not None
    with pytest.raises(SystemExit) as info:
        ServingConfig.from_cli([], {name: bad})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"pagedserve serve: error: {name} {message}"], err


@pytest.mark.parametrize(
    ("name", "bad_entry", "says"),
    [
        ("PAGEDSERVE_MATMUL_TUNING", '{"weight": "int4"}', "entry 0: needs"),
        ("PAGEDSERVE_ATTENTION_TUNING", '{"row": {"tile_n": 64}}', "entry 0: row needs"),
    ],
)
def test_a_tuning_table_that_cannot_be_read_is_one_line(
    capsys, tmp_path, name: str, bad_entry: str, says: str
) -> None:
    """PAGEDSERVE_MATMUL_TUNING and PAGEDSERVE_ATTENTION_TUNING name tables the kernels read
    at their first decode call; the server reads them before anything runs
    (kernels/matmul_tuning.py, kernels/attention_tuning.py)."""
    good = tmp_path / "tuning.json"
    good.write_text('{"format": 1, "device": "d", "entries": []}')
    assert ServingConfig.from_cli([], {name: str(good)}) is not None
    bad = tmp_path / "bad.json"
    bad.write_text(f'{{"format": 1, "entries": [{bad_entry}]}}')
    for path, message in ((bad, says), (tmp_path / "none.json", "No such file")):
        with pytest.raises(SystemExit) as info:
            ServingConfig.from_cli([], {name: str(path)})
        assert info.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"pagedserve serve: error: {name}={path}: ")
        assert message in line, line


def _device_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        ServingConfig.from_cli(argv, {})
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pagedserve serve: error: ")
    return line


@pytest.mark.parametrize("device", ["gpu", "mps", "meta", "cuda:x", "CUDA"])
def test_a_device_the_engine_does_not_run_on_is_one_line(capsys, device: str) -> None:
    line = _device_error(capsys, ["--device", device])
    assert f"device must be cpu, cuda or cuda:N, got {device!r}" in line


def test_a_cuda_device_this_machine_lacks_is_one_line(capsys, monkeypatch) -> None:
    """Checked at start-up, before the model loads: a torch without CUDA, one that sees no
    GPU, an index past the GPUs there are, more tensor-parallel ranks than GPUs."""
    import torch

    assert ServingConfig.from_cli(["--device", "cpu"], {}).engine.device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    line = _device_error(capsys, ["--device", "cuda"])
    assert "this torch" in line and "built without CUDA" in line and "CPU" in line, line
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    line = _device_error(capsys, ["--device", "cuda:0"])
    assert "sees no CUDA device" in line, line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ServingConfig.from_cli(["--device", "cuda:1"], {}).engine.device == "cuda:1"
    assert ServingConfig.from_cli(["--tensor-parallel-size", "2"], {}) is not None
    line = _device_error(capsys, ["--device", "cuda:2"])
    assert "'cuda:2': this machine has 2 CUDA device(s), cuda:0 to cuda:1" in line, line
    # No --device: CUDA is picked where present, so the ranks still need a GPU each.
    line = _device_error(capsys, ["--tensor-parallel-size", "4"])
    assert "runs 4 ranks on this host, one GPU each, but it has 2" in line, line
    line = _device_error(capsys, ["--device", "cuda:1", "--tensor-parallel-size", "2"])
    assert "puts each rank on its own: give 'cuda'" in line, line


@pytest.mark.parametrize("share", ["0", "1.5", "-0.2"])
def test_a_gpu_memory_share_outside_0_to_1_is_one_line(capsys, share: str) -> None:
    assert ServingConfig.from_cli([], {"PAGEDSERVE_GPU_MEMORY_UTILIZATION": "0.9"}) is not None
    with pytest.raises(SystemExit) as info:
        ServingConfig.from_cli(["--gpu-memory-utilization", share], {})
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "gpu_memory_utilization must be a share of the GPU's memory in (0, 1]" in line


def test_zero_batch_wait_and_stats_interval_and_named_served_models_are_accepted() -> None:
    """The bounds of the checks above: 0 ms of batch wait (no wait), a 0 s stats interval (the
    log line off), and none/auto restoring the model's own name."""
    c = ServingConfig.from_cli(
        ["--batching", "dynamic", "--batch-wait-ms", "0", "--stats-log-interval", "0"], {}
    )
    assert (c.scheduler.batch_wait_ms, c.server.stats_log_interval_s) == (0.0, 0.0)
    for value in ("auto", "none"):
        assert (
            ServingConfig.from_cli(["--served-model-name", value], {}).server.served_model_name
            is None
        )
    env = {"PAGEDSERVE_SERVED_MODEL_NAME": "from-env"}
    assert ServingConfig.from_cli([], env).server.served_model_name == "from-env"
    with pytest.raises(ValueError, match="served_model_name cannot be empty"):
        ServerConfig(served_model_name="")


def _one_error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        ServingConfig.from_cli(argv, {})
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pagedserve serve: error: "), line
    return line


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{% for m in messages %}{{ m.content }", "does not compile: line 1: unexpected '}'"),
        ("{{ messages }}\n{% if %}", "does not compile: line 2: Expected an expression"),
        ("{{ messages | no_such_filter }}", "No filter named 'no_such_filter'"),
    ],
)
def test_a_chat_template_that_does_not_compile_is_one_line(
    capsys, tmp_path, template: str, says: str
) -> None:
    """Refused at start-up, naming the file and jinja2's error, rather than accepted and then
    answering every chat request with a 400 that blames its ``messages``."""
    path = tmp_path / "broken.jinja"
    path.write_text(template, encoding="utf-8")
    line = _one_error_line(capsys, ["--chat-template", str(path)])
    assert f"--chat-template {str(path)!r} " in line and says in line, line


def test_a_chat_template_that_is_not_utf8_is_one_line(capsys, tmp_path) -> None:
    path = tmp_path / "latin1.jinja"
    path.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    line = _one_error_line(capsys, ["--chat-template", str(path)])
    assert f"--chat-template {str(path)!r} is not UTF-8 text" in line, line


def test_a_chat_template_compiles_with_the_renderers_extensions(tmp_path) -> None:
    """What transformers' chat-template environment adds (loop controls, the ``generation``
    tag, ``raise_exception``) compiles: the check is that environment's, not plain jinja2's."""
    path = tmp_path / "ok.jinja"
    path.write_text(
        "{% for m in messages %}{% if m.role == 'x' %}{{ raise_exception('no') }}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}",
        encoding="utf-8",
    )
    assert ServingConfig.from_cli(["--chat-template", str(path)], {}).server.chat_template == str(
        path
    )


def test_a_tokenizer_path_the_loader_cannot_read_is_one_line(capsys, tmp_path) -> None:
    """Checked before the model loads (which otherwise ends in "has no tokenizer", without the
    path): missing, a file, or a directory without tokenizer.json / tokenizer.model."""
    missing = tmp_path / "missing"
    line = _one_error_line(capsys, ["--tokenizer", str(missing)])
    assert f"--tokenizer {str(missing)!r} does not exist" in line, line
    file = tmp_path / "tokenizer.json"
    file.write_text("{}")
    line = _one_error_line(capsys, ["--tokenizer", str(file)])
    assert f"--tokenizer {str(file)!r} is not a directory" in line, line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_error_line(capsys, ["--tokenizer", str(empty)])
    assert f"--tokenizer {str(empty)!r} has no tokenizer" in line, line
    assert "tokenizer.json" in line and "tokenizer.model" in line, line
    assert ServingConfig.from_cli(["--tokenizer", str(tmp_path)], {}).engine.tokenizer == str(
        tmp_path
    )
