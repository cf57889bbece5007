"""The pagedserve console script's dispatch (serve itself runs in test_integration)."""

from __future__ import annotations

import sys
import types

import pytest

from server import cli


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
    assert "[--no-prefix-caching [BOOL]]" in usage
    assert "[--check-integrity BOOL]" in usage and "[--log-prompts BOOL]" in usage
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
