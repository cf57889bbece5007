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
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
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
