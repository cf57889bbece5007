"""engine/weight_memory.py: a model whose weights cannot fit the device is refused in one
line before loading, and the free memory is read from the host and its cgroup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import weight_memory
from engine.config import ModelConfig, ModelError
from engine.presets import preset
from engine.weight_memory import ModelTooLargeError, check_weights_fit

GIB = 2**30


def _host(tmp_path: Path, available_kib: int, cgroup: dict[str, tuple[str, str]]):
    tmp_path.mkdir()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/outer/inner\n")
    root = tmp_path / "cg"
    for relative, (limit, current) in cgroup.items():
        directory = root / relative
        directory.mkdir(parents=True)
        (directory / "memory.max").write_text(limit + "\n")
        (directory / "memory.current").write_text(current + "\n")
    return weight_memory.host_rooms(meminfo, proc, root)


def test_the_host_gives_memavailable_soft_and_a_cgroup_limits_room_hard(tmp_path) -> None:
    (soft,) = _host(tmp_path / "a", 8 * 1024**2, {})
    assert (soft.bytes, soft.hard) == (8 * GIB, False) and "MemAvailable" in soft.where
    # A container's limit (outer) with 1 GiB of it used leaves 3 GiB; the inner has none.
    soft, hard = _host(
        tmp_path / "b",
        8 * 1024**2,
        {"outer": (str(4 * GIB), str(GIB)), "outer/inner": ("max", str(GIB))},
    )
    assert (hard.bytes, hard.hard) == (3 * GIB, True) and hard.where.endswith("outer/memory.max")
    missing = tmp_path / "none"
    assert weight_memory.host_rooms(missing, missing, missing) == []


def _rooms(monkeypatch, *rooms: weight_memory.Room) -> None:
    monkeypatch.setattr(weight_memory, "device_rooms", lambda device: list(rooms))


def _refusal(monkeypatch, free: int, device: str, dtype: torch.dtype, model: str) -> str:
    _rooms(monkeypatch, weight_memory.Room(free, f"free on {device}", True))
    mc = ModelConfig.from_hf(preset(model))
    with pytest.raises(ModelTooLargeError) as refused:
        check_weights_fit(model, mc, torch.device(device), dtype)
    assert isinstance(refused.value, ModelError)  # the CLI prints it as one line
    message = str(refused.value)
    assert "\n" not in message and f"model {model!r} needs" in message
    return message


def test_weights_larger_than_the_free_memory_are_refused_saying_what_helps(monkeypatch):
    # Llama-3-8B: 8.03B parameters, 29.9 GiB in float32, 15.0 GiB in bfloat16.
    mc = ModelConfig.from_hf(preset("llama-3-8b"))
    _rooms(monkeypatch, weight_memory.Room(31 * GIB, "free", True))
    check_weights_fit("llama-3-8b", mc, torch.device("cpu"), torch.float32)  # fits: silent
    message = _refusal(monkeypatch, 20 * GIB, "cpu", torch.float32, "llama-3-8b")
    assert "29.9 GiB for its 8.03B weights in float32, but 20.0 GiB is free on cpu" in message
    assert message.endswith("try --dtype bfloat16 (half the bytes) or a smaller model")
    # Half the bytes would not fit either: bfloat16 is not offered.
    message = _refusal(monkeypatch, 10 * GIB, "cpu", torch.float32, "llama-3-8b")
    assert message.endswith("try a smaller model"), message
    message = _refusal(monkeypatch, 10 * GIB, "cuda", torch.bfloat16, "llama-3-8b")
    assert "in bfloat16" in message and "--tensor-parallel-size N" in message
    assert "--dtype" not in message


def test_memavailable_short_of_the_weights_only_warns(monkeypatch, caplog) -> None:
    """A ballooned VM reports less than it can hold: MemAvailable warns, and a hard limit
    (here a cgroup's) still refuses beside it."""
    mc = ModelConfig.from_hf(preset("llama-3-8b"))
    soft = weight_memory.Room(20 * GIB, "available to this process (MemAvailable)", False)
    _rooms(monkeypatch, soft)
    with caplog.at_level("WARNING", logger="engine.weight_memory"):
        check_weights_fit("llama-3-8b", mc, torch.device("cpu"), torch.float32)
    (record,) = caplog.records
    assert "29.9 GiB" in record.getMessage() and "out of memory" in record.getMessage()
    assert "--dtype bfloat16" in record.getMessage()
    _rooms(monkeypatch, soft, weight_memory.Room(25 * GIB, "left under the limit", True))
    with pytest.raises(ModelTooLargeError, match="25.0 GiB is left under the limit"):
        check_weights_fit("llama-3-8b", mc, torch.device("cpu"), torch.float32)


def test_the_offline_engine_and_the_server_refuse_before_loading(monkeypatch, capsys) -> None:
    from engine import builder, threads
    from engine.llm import LLM
    from server import cli
    from server.cli import main

    _rooms(monkeypatch, weight_memory.Room(1024, "left under the limit", True))
    # serve()'s process-wide set-up stays out of the test process.
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr(threads, "configure_threads", lambda n: (1, "test"))
    monkeypatch.setattr(builder, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ModelTooLargeError):
        LLM("tiny-llama", load_format="dummy")
    assert main(["serve", "tiny-llama", "--load-format", "dummy", "--port", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("pagedserve serve: error: model 'tiny-llama' needs"), line
