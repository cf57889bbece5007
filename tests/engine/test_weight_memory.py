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
    return weight_memory._host_available(meminfo, proc, root)


def test_host_memory_is_the_least_of_memavailable_and_each_cgroups_room(tmp_path) -> None:
    assert _host(tmp_path / "a", 8 * 1024**2, {}) == (8 * GIB, "MemAvailable")
    # A container's limit (outer) with 1 GiB of it used leaves 3 GiB; the inner has none.
    found = _host(
        tmp_path / "b",
        8 * 1024**2,
        {"outer": (str(4 * GIB), str(GIB)), "outer/inner": ("max", str(GIB))},
    )
    assert found is not None and found[0] == 3 * GIB
    assert found[1].startswith("the cgroup limit") and found[1].endswith("outer/memory.max")
    missing = tmp_path / "none"
    assert weight_memory._host_available(missing, missing, missing) is None


def _refusal(monkeypatch, free: int, device: str, dtype: torch.dtype, model: str) -> str:
    monkeypatch.setattr(weight_memory, "available_bytes", lambda d: (free, f"free on {d}"))
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
    monkeypatch.setattr(weight_memory, "available_bytes", lambda d: (31 * GIB, "free"))
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


def test_the_offline_engine_and_the_server_refuse_before_loading(monkeypatch, capsys) -> None:
    from engine import builder, threads
    from engine.llm import LLM
    from server import cli
    from server.cli import main

    monkeypatch.setattr(weight_memory, "available_bytes", lambda d: (1024, "available"))
    # serve()'s process-wide set-up stays out of the test process.
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr(threads, "configure_threads", lambda n: (1, "test"))
    monkeypatch.setattr(builder, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ModelTooLargeError):
        LLM("tiny-llama", load_format="dummy")
    assert main(["serve", "tiny-llama", "--load-format", "dummy", "--port", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("pagedserve serve: error: model 'tiny-llama' needs"), line
