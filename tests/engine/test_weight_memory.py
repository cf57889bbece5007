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


def _host(tmp_path: Path, proc_cgroup: str, files: dict[str, dict[str, str]]):
    """host_rooms over a fake /proc and cgroup tree: MemAvailable 8 GiB, the process's
    cgroup line ``proc_cgroup``, and ``files`` per cgroup directory."""
    tmp_path.mkdir()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {8 * 1024**2} kB\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_cgroup + "\n")
    root = tmp_path / "cg"
    for relative, contents in files.items():
        directory = root / relative
        directory.mkdir(parents=True)
        for name, text in contents.items():
            (directory / name).write_text(text + "\n")
    return weight_memory.host_rooms(meminfo, proc, root)


def test_the_host_gives_memavailable_soft_and_a_cgroup_limits_room_hard(tmp_path) -> None:
    (soft,) = _host(tmp_path / "a", "0::/", {})
    assert (soft.bytes, soft.hard) == (8 * GIB, False) and "MemAvailable" in soft.where
    # cgroup v2: a container's limit (outer) with 1 GiB of it used leaves 3 GiB; the inner
    # group has none ("max").
    v2 = {
        "outer": {"memory.max": str(4 * GIB), "memory.current": str(GIB)},
        "outer/inner": {"memory.max": "max", "memory.current": str(GIB)},
    }
    soft, hard = _host(tmp_path / "b", "0::/outer/inner", v2)
    assert (hard.bytes, hard.hard) == (3 * GIB, True) and hard.where.endswith("outer/memory.max")
    # Only anonymous memory counts where memory.stat says it: the page cache is reclaimed.
    v2["outer"] |= {"memory.current": str(4 * GIB), "memory.stat": f"anon {GIB}\nfile 9"}
    soft, hard = _host(tmp_path / "c", "0::/outer/inner", v2)
    assert hard.bytes == 3 * GIB
    # cgroup v1's memory controller: the same, with its own files; ~2**63 is no limit.
    v1 = {
        "memory/outer": {
            "memory.limit_in_bytes": str(4 * GIB),
            "memory.usage_in_bytes": str(4 * GIB),
            "memory.stat": f"cache 9\nrss {GIB}\ntotal_cache 9\ntotal_rss {2 * GIB}",
        },
        "memory/outer/inner": {"memory.limit_in_bytes": "9223372036854771712"},
    }
    soft, hard = _host(tmp_path / "d", "4:memory:/outer/inner\n3:cpu:/x", v1)
    assert hard.bytes == 2 * GIB and hard.where.endswith("outer/memory.limit_in_bytes")
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
