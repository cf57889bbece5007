"""The real server at --tensor-parallel-size 2 (two gloo ranks) on the embedded default model,
whose 9 heads and 3 KV heads are padded to 12 and 4 (engine/tensor_parallel.py): greedy
tokens equal transformers' under the float32 near-tie rule, and a killed worker makes the
server exit non-zero within a bounded time. One server for the module; the kill is last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from loadtest.launcher import HOST, ServerProcess, free_port
from server.config import ServingConfig
from tests.engine.parity import assert_parity, hf_greedy

STARTUP_TIMEOUT_S = 300  # the first start on a machine converts the GGUF
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
EXIT_BOUND_S = 20.0


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("tp-server") / "server.log"
    argv = [
        sys.executable, "-m", "server",
        "--host", HOST, "--port", str(port),
        "--tensor-parallel-size", "2",
        "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "8",
        "--stats-log-interval", "0", "--log-level", "info",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    server = ServerProcess(argv, port, log, env=env)
    server.start()
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop(grace_s=10)


def test_tp_flags_reach_the_engine_config() -> None:
    argv = ["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "10.0.0.1", "--master-port", "29500"]  # fmt: skip
    e = ServingConfig.from_cli(argv, {}).engine
    assert (e.tensor_parallel_size, e.nnodes, e.node_rank, e.master_addr, e.master_port) == (
        4, 2, 1, "10.0.0.1", 29500,
    )  # fmt: skip
    assert (
        ServingConfig.from_cli(
            [], {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "2"}
        ).engine.tensor_parallel_size
        == 2
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be at least 1"),
        (["--tensor-parallel-size", "3", "--nnodes", "2", "--master-port", "1"], "nnodes must"),
        (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "2"], "node_rank"),
        (["--tensor-parallel-size", "2", "--nnodes", "2"], "needs --master-port"),
    ],
)
def test_bad_tp_flags_exit_with_one_line(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        ServingConfig.from_cli(argv, {})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1], err


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _worker_pid(server_pid: int) -> int:
    """The spawned rank (not multiprocessing's resource tracker)."""
    for child in _children(server_pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return child
    raise AssertionError(f"no tensor-parallel worker among {_children(server_pid)}")


def test_tp2_server_matches_transformers(tp_server):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from engine.loader import resolve_model

    path = resolve_model("default").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]

    def complete(prompt_ids: list[int]) -> list[int]:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{tp_server.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(ids)) as pool:  # concurrent: batched in the same steps
        got = list(pool.map(complete, ids))
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for prompt, prompt_ids, tokens in zip(PROMPTS, ids, got, strict=True):
        ref = hf_greedy(model, prompt_ids, MAX_TOKENS, eos_token_id=None)
        assert_parity(tokens, ref, f"TP=2 server {prompt!r}")


def test_killed_worker_makes_the_server_exit_non_zero(tp_server):
    proc = tp_server.process
    os.kill(_worker_pid(proc.pid), signal.SIGKILL)
    start = time.monotonic()
    try:
        code = proc.wait(timeout=EXIT_BOUND_S)
    except Exception:
        pytest.fail(f"the server still runs {EXIT_BOUND_S} s after its worker was killed")
    assert code != 0, f"exit status {code}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{tp_server.base_url}/health", timeout=2)
    log = tp_server.log_path.read_text()
    assert "tensor-parallel worker" in log and "exiting with status 1" in log, log[-2000:]
    print(f"server exited {time.monotonic() - start:.1f} s after its worker was killed")


def test_a_node_that_never_joins_exits_1_with_one_line() -> None:
    """Node 0 of two whose node 1 never starts: the start fails after the group timeout,
    naming the rank, as one log line and status 1 (no traceback). Shape preset, dummy
    weights: nothing is loaded before the join."""
    argv = [
        sys.executable, "-m", "server", "--model", "smollm2-135m", "--load-format", "dummy",
        "--device", "cpu", "--host", HOST, "--port", str(free_port()),
        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
        "--master-port", str(free_port()),
    ]  # fmt: skip
    env = {**os.environ, "PAGEDSERVE_TP_TIMEOUT_S": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rank(s) 1 did not join the group" in done.stderr
    assert "Traceback" not in done.stderr
