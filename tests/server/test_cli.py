"""The pagedserve console script's dispatch (serve itself runs in test_integration)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from server import cli
from server.config import ServingConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("command", "module"), [("plan", "planner.cli"), ("bench", "loadtest.cli")]
)
def test_plan_and_bench_dispatch_lazily(command: str, module: str, monkeypatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType(module)
    fake.main = lambda argv, **kwargs: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main([command, "--x", "1"]) == 3
    assert seen == [["--x", "1"]]


def test_serve_parses_its_flags(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(cli, "serve", lambda config: seen.append(config) or 0)
    assert cli.main(["serve", "--port", "9100"]) == 0
    assert seen[0].server.port == 9100


def test_usage_and_unknown_command(capsys) -> None:
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_bench_help_names_the_pagedserve_command(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pagedserve bench ") and "python -m" not in out
    with pytest.raises(SystemExit):
        cli.main(["bench", "run", "--help"])
    assert capsys.readouterr().out.startswith("usage: pagedserve bench run ")


def test_serve_help_shows_boolean_values_as_bool(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    # A boolean may be given alone (true), as a switch: --enforce-eager, --check-integrity.
    assert "[--no-prefix-caching [BOOL]]" in usage and "[--enforce-eager [BOOL]]" in usage
    assert "[--check-integrity [BOOL]]" in usage and "[--log-prompts [BOOL]]" in usage
    assert "[CACHING]" not in usage and "INTEGRITY " not in usage
    assert "[MODEL]" in usage


@pytest.mark.parametrize(
    ("argv", "environ", "model"),
    [
        (["serve", "/models/x.gguf"], {}, "/models/x.gguf"),
        (["serve", "/models/x.gguf", "--port", "9100"], {}, "/models/x.gguf"),
        (["serve", "--port", "9100", "/models/x.gguf"], {}, "/models/x.gguf"),
        (["serve", "--model", "/m", "/m"], {}, "/m"),  # the same model twice: no conflict
        (["serve", "/m"], {"PAGEDSERVE_MODEL": "/env"}, "/m"),  # as a flag beats the env
        (["serve"], {"PAGEDSERVE_MODEL": "/env"}, "/env"),
        (["serve"], {}, "default"),
    ],
)
def test_serve_takes_the_model_as_a_positional(
    argv: list[str], environ: dict[str, str], model: str, monkeypatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if not environ:
        monkeypatch.delenv("PAGEDSERVE_MODEL", raising=False)
    seen = []
    monkeypatch.setattr(cli, "serve", lambda config: seen.append(config) or 0)
    assert cli.main(argv) == 0
    assert seen[0].engine.model == model


def test_a_positional_model_that_differs_from_model_is_one_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "/a", "--model", "/b"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "given twice" in err and "'/a'" in err and "'/b'" in err
    assert "Traceback" not in err


def _bad_model(case: str, tmp_path: Path) -> str:
    """The ``--model`` value of each user-error case (files made under ``tmp_path``)."""
    if case == "hub-id":
        return "HuggingFaceTB/SmolLM2-135M-Instruct"
    if case == "missing-file":
        return str(tmp_path / "missing.gguf")
    if case == "directory-without-config":
        return str(tmp_path)
    if case == "not-a-gguf":
        (tmp_path / "x.gguf").write_bytes(b"\0" * 64)
        return str(tmp_path / "x.gguf")
    config = {
        "unsupported-architecture": {"model_type": "gpt2", "n_embd": 8},
        "incomplete-config": {"model_type": "llama", "vocab_size": 8},
    }[case]
    directory = tmp_path / case
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("hub-id", ["hub id", "never downloads", "huggingface-cli download", "--local-dir"]),
        ("unsupported-architecture", ["unsupported architecture 'gpt2'", "llama"]),
        ("missing-file", ["does not exist", ".gguf file"]),
        ("directory-without-config", ["has no config.json", "HF directory"]),
        ("incomplete-config", ["config.json lacks", "num_attention_heads"]),
        ("not-a-gguf", ["as a GGUF model", "GGUF magic"]),
    ],
)
def test_a_model_the_user_must_change_is_one_line_and_exit_2(
    case: str, expected: list[str], tmp_path: Path
) -> None:
    """``pagedserve serve`` with a model it cannot serve: one line on stderr naming the problem
    and the fix, exit status 2, no traceback, nothing fetched."""
    model = _bad_model(case, tmp_path)
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    argv = ["--model", model, "--port", "0", "--log-level", "warning", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-m", "server", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve serve: error: "), done.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def test_a_preset_without_a_tokenizer_serves_text_through_a_synthetic_one(tmp_path: Path) -> None:
    """Dummy weights of a shape preset come without a tokenizer: the server writes one of the
    preset's vocabulary (``with_synthetic_tokenizer``, saying so in its log) and answers text
    whose words are its tokens, on completions and chat alike. The device and a small pool
    are pinned, so that the engine built here never takes a GPU."""
    import httpx

    from loadtest.launcher import ServerProcess, free_port

    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    port = free_port()
    argv = [sys.executable, "-m", "server", "--model", "tiny-llama", "--load-format", "dummy",
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--num-kv-blocks", "64", "--num-threads", "1"]  # fmt: skip
    server = ServerProcess(argv, port, tmp_path / "server.log", env=env, cwd=REPO)
    try:
        server.start_healthy(180)
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as http:
            body = {"model": "tiny-llama", "prompt": "one two three four five", "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == 5 and usage["completion_tokens"] == 4, usage
            assert len(r.json()["choices"][0]["text"].split()) == 4, r.json()
            chat = {"model": "tiny-llama", "max_tokens": 3, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "hello there"}]}  # fmt: skip
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"].strip(), r.json()
    finally:
        server.stop(grace_s=10)
    log = (tmp_path / "server.log").read_text()
    assert "synthetic tokenizer" in log, log[-2000:]


def test_a_preset_without_a_tokenizer_is_known_before_loading() -> None:
    from engine.builder import lacks_a_tokenizer
    from engine.config import EngineConfig

    assert lacks_a_tokenizer(EngineConfig(model="tiny-llama", load_format="dummy"))
    assert not lacks_a_tokenizer(
        EngineConfig(model="tiny-llama", load_format="dummy", tokenizer="/tok")
    )
    # Not a preset: only reading the checkpoint tells (the check after the build).
    assert not lacks_a_tokenizer(EngineConfig(model="/some/dir", load_format="dummy"))
    assert not lacks_a_tokenizer(EngineConfig(model="default"))


def test_triton_on_the_cpu_without_the_interpreter_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    """Compiled Triton kernels take CUDA tensors only: ``--attention-backend triton`` on the
    CPU without ``TRITON_INTERPRET`` is refused before the model loads, as one line."""
    from tests.server.tiny_server import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model")
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    argv = ["--model", str(model), "--device", "cpu", "--attention-backend", "triton",
            "--num-kv-blocks", "8", "--port", "0", "--log-level", "warning"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "server", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve serve: error: "), done.stderr
    assert "TRITON_INTERPRET=1" in lines[0] and "--device cuda" in lines[0], lines[0]


def test_speculative_flags_reach_the_config_and_bad_ones_exit_2(monkeypatch, capsys) -> None:
    seen: list = []
    monkeypatch.setattr(cli, "serve", lambda config: seen.append(config) or 0)
    argv = ["serve", "--speculative-method", "ngram", "--num-speculative-tokens", "6",
            "--ngram-min", "1", "--ngram-max", "3", "--speculative-row-cost", "0.25"]  # fmt: skip
    assert cli.main(argv) == 0
    spec = seen[0].engine.speculative
    got = (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max,
           spec.row_cost)  # fmt: skip
    assert got == ("ngram", 6, 1, 3, 0.25)
    assert cli.main(["serve"]) == 0 and seen[1].engine.speculative is None
    for bad, message in [
        (["--speculative-method", "draft"], "needs a speculative model"),
        (["--speculative-model", "/m"], "needs --speculative-method draft"),
        (["--speculative-method", "ngram", "--ngram-min", "5"], "ngram_min <= ngram_max"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "[1, 16]"),
        (["--speculative-method", "ngram", "--speculative-row-cost", "-1"], "row_cost"),
    ]:
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", *bad])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_an_address_it_cannot_listen_on_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    """A port another server holds, or a host that is not this machine's: ``pagedserve serve``
    says so in one line and exits 2 before loading anything (on a GPU, loading a large model
    takes minutes; uvicorn would find out only after them)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    try:
        for argv, says in (
            (["--port", str(port)], "Address already in use (another server listens there"),
            (["--host", "203.0.113.7"], "(is --host an address of this machine?)"),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "server", "--device", "cpu", "--log-level", "warning",
                 *argv],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert lines[0].startswith("pagedserve serve: error: cannot listen on "), lines[0]
            assert says in lines[0], lines[0]
    finally:
        taken.close()


def test_the_listen_check_runs_before_loading(monkeypatch) -> None:
    import socket

    from server.config import ServingConfig

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the address was checked")

    monkeypatch.setattr(cli, "on_worker_thread", load)
    # serve() sets the process's torch threads first: not this test process's.
    monkeypatch.setattr("engine.threads.configure_threads", lambda n: (1, "test"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = ServingConfig.from_cli(["--port", str(taken.getsockname()[1])])
        with pytest.raises(cli.ListenError, match="Address already in use"):
            cli.serve(config)
    with pytest.raises(cli.ListenError, match=r"\(--host\)"):
        cli.check_can_listen("no-such-host.invalid", 8000)
    with socket.socket() as free:  # a port just closed passes
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cli.check_can_listen("127.0.0.1", port)


def test_an_address_family_the_host_cannot_use_is_passed_over(monkeypatch) -> None:
    """A name resolving to one address this machine has and one it has not (``::1`` with
    IPv6 off) still listens, as asyncio passes such an address over; the foreign one alone
    is refused."""
    import socket

    real = socket.getaddrinfo
    stream = (socket.AF_INET, socket.SOCK_STREAM, 6, "")
    foreign, local = (*stream, ("203.0.113.7", 0)), (*stream, ("127.0.0.1", 0))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [foreign, local])
    cli.check_can_listen("both.example", 0)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [foreign])
    with pytest.raises(cli.ListenError, match="is --host an address of this machine"):
        cli.check_can_listen("foreign.example", 0)
    monkeypatch.setattr(socket, "getaddrinfo", real)


def test_output_and_prompt_bounds_above_the_context_are_a_warning(caplog) -> None:
    """``--max-prompt-tokens`` / ``--max-output-tokens`` above max_model_len bound nothing (the
    context does): a WARNING line each, once the engine has resolved the context; not an
    error, and nothing for bounds within it."""
    config = ServingConfig.from_cli(
        ["--max-prompt-tokens", "100000", "--max-output-tokens", "100000"], {}
    )
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        cli.warn_of_bounds_above_the_context(config, 8192)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        f"{flag} 100000 has no effect: it is above max_model_len 8192, which bounds every "
        "request already (--max-model-len)"
        for flag in ("--max-prompt-tokens", "--max-output-tokens")
    ], lines
    caplog.clear()
    within = ServingConfig.from_cli(
        ["--max-prompt-tokens", "8192", "--max-output-tokens", "10"], {}
    )
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        cli.warn_of_bounds_above_the_context(within, 8192)
        cli.warn_of_bounds_above_the_context(ServingConfig(), 8192)
    assert not caplog.records, caplog.records


def test_serve_warns_of_bounds_above_the_context_after_loading(monkeypatch) -> None:
    """``serve`` checks the bounds against the engine's resolved context (what the
    ``--max-model-len`` flag asked for is capped by the model's positions)."""
    seen: list[int] = []
    monkeypatch.setattr(cli, "warn_of_bounds_above_the_context", lambda config, n: seen.append(n))

    class Stop(Exception):
        pass

    engine = types.SimpleNamespace(
        tokenizer=object(), scheduler_config=ServingConfig().scheduler, num_total_blocks=4,
        kv_capacity=types.SimpleNamespace(cache_dtype="float32", bytes_per_token=1),
        max_model_len=321,
    )  # fmt: skip

    def no_client(*args: object, **kwargs: object) -> None:
        raise Stop

    monkeypatch.setattr(cli, "check_can_listen", lambda host, port: None)
    monkeypatch.setattr(cli, "on_worker_thread", lambda fn, *args: engine)
    # serve() sets the process's logging and torch threads first: not this test process's.
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr("engine.threads.configure_threads", lambda n: (1, "test"))
    monkeypatch.setattr("server.engine_client.AsyncEngineClient", no_client)
    with pytest.raises(Stop):
        cli.serve(ServingConfig.from_cli(["--port", "8160", "--log-level", "warning"], {}))
    assert seen == [321]
