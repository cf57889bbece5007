"""The real server at --tensor-parallel-size 2 (two gloo ranks), on two models:

- the embedded default model, whose 9 heads and 3 KV heads are padded to 12 and 4
  (engine/tensor_parallel.py): greedy tokens equal transformers' under the float32 near-tie
  rule; then SIGTERM, with a request in flight, drains it and stops both ranks (exit 0);
- a tiny random GQA model with a tokenizer (6 heads in 3 KV groups, padded to 8 and 4;
  head_dim 32, so the C++ kernels run each rank's shard): the same parity; then a killed
  worker makes ``/health`` answer 503 and the server exit non-zero within a bounded time.

Each server is the last test's to stop, so the order of the tests below matters.
"""

from __future__ import annotations

import json
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
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import assert_parity, hf_greedy
from tests.server.server_fakes import tiny_tokenizer

STARTUP_TIMEOUT_S = 300  # the first start on a machine converts the GGUF
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
EXIT_BOUND_S = 20.0
DRAINED_TOKENS = 12  # the request in flight at SIGTERM


def _start_tp_server(log_dir: Path, model_args: list[str]) -> ServerProcess:
    port = free_port()
    argv = [
        sys.executable, "-m", "server", *model_args,
        "--host", HOST, "--port", str(port),
        "--tensor-parallel-size", "2",
        "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "8",
        "--stats-log-interval", "0", "--log-level", "info",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    server = ServerProcess(argv, port, log_dir / "server.log", env=env)
    server.start()
    return server


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    server = _start_tp_server(tmp_path_factory.mktemp("tp-server"), [])
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop(grace_s=10)


@pytest.fixture(scope="module")
def tiny_gqa_model(tmp_path_factory) -> Path:
    """6 heads in 3 KV groups, head_dim 32, with the byte-level test tokenizer (344 tokens:
    the vocabulary divides by 2; tests/engine/test_tensor_parallel.py pads one offline)."""
    path = tmp_path_factory.mktemp("tp-tiny-gqa")
    tokenizer = tiny_tokenizer()
    make_tiny_llama(
        path,
        num_kv_heads=3,
        seed=7,
        vocab_size=len(tokenizer),
        hidden_size=192,
        num_attention_heads=6,
        intermediate_size=208,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_tp_server(tmp_path_factory, tiny_gqa_model):
    server = _start_tp_server(
        tmp_path_factory.mktemp("tp-tiny-server"), ["--model", str(tiny_gqa_model)]
    )
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop(grace_s=10)


def test_tp_flags_reach_the_engine_config() -> None:
    # On the CPU: on CUDA a host of this group needs two GPUs (EngineConfig.check_device).
    argv = ["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "10.0.0.1", "--master-port", "29500", "--device", "cpu"]  # fmt: skip
    e = ServingConfig.from_cli(argv, {}).engine
    assert (e.tensor_parallel_size, e.nnodes, e.node_rank, e.master_addr, e.master_port) == (
        4, 2, 1, "10.0.0.1", 29500,
    )  # fmt: skip
    assert (
        ServingConfig.from_cli(
            [], {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "2", "PAGEDSERVE_DEVICE": "cpu"}
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


def _model_id(server: ServerProcess) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def _complete_ids(server: ServerProcess, prompt_ids: list[int], max_tokens: int) -> list[int]:
    body = {
        "model": _model_id(server),
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _check_server_parity(server: ServerProcess, path: Path, what: str) -> None:
    """Both prompts at once (batched in the same steps) against transformers' greedy."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    with ThreadPoolExecutor(len(ids)) as pool:
        got = list(pool.map(lambda p: _complete_ids(server, p, MAX_TOKENS), ids))
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for prompt, prompt_ids, tokens in zip(PROMPTS, ids, got, strict=True):
        ref = hf_greedy(model, prompt_ids, MAX_TOKENS, eos_token_id=None)
        assert_parity(tokens, ref, f"TP=2 server, {what}, {prompt!r}")


@pytest.mark.slow  # the embedded default model
def test_tp2_server_matches_transformers(tp_server):
    from engine.loader import resolve_model

    _check_server_parity(tp_server, resolve_model("default").path, "default model")


@pytest.mark.slow  # the embedded default model
def test_sigterm_drains_and_stops_every_rank(tp_server):
    """SIGTERM to the server process alone (not its process group): the request in flight
    finishes (its steps still need the worker), then rank 0 sends STOP, joins the worker and
    exits 0. The worker is its child, so once the server has exited the worker is reaped and
    gone; "group stopped" without "did not stop" in the log says it left on STOP, not killed."""
    proc = tp_server.process
    worker = _worker_pid(proc.pid)
    body = {
        "model": _model_id(tp_server), "prompt": PROMPTS[0], "max_tokens": DRAINED_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    chunks = []
    start = None
    with httpx.stream("POST", f"{tp_server.base_url}/v1/completions", json=body,
                      timeout=120) as stream:  # fmt: skip
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line.removeprefix("data: ")))
            if start is None:  # the request runs: now stop the server
                os.kill(proc.pid, signal.SIGTERM)
                start = time.monotonic()
    assert start is not None
    assert chunks[-1]["usage"]["completion_tokens"] == DRAINED_TOKENS, chunks[-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    try:
        code = proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs {EXIT_BOUND_S} s after SIGTERM")
    assert code == 0, f"exit status {code}\n{tp_server.log_tail()}"
    assert not Path(f"/proc/{worker}").exists(), f"worker {worker} outlived the server"
    log = tp_server.log_path.read_text()
    assert "tensor-parallel group stopped" in log, log[-2000:]
    assert "did not stop; killing it" not in log, log[-2000:]
    print(f"server and worker gone {time.monotonic() - start:.1f} s after SIGTERM")


def test_tp2_server_on_a_padded_gqa_model_matches_transformers(tiny_tp_server, tiny_gqa_model):
    _check_server_parity(tiny_tp_server, tiny_gqa_model, "tiny GQA model")
    log = tiny_tp_server.log_path.read_text()
    assert "query heads 6 -> 8, KV heads 3 -> 4" in log, log[-2000:]


def test_killed_worker_makes_the_server_exit_non_zero(tiny_tp_server):
    """The watchdog notices the death, the engine loop dies (``/health`` 503), and the
    process exits 1 after the group's ``EXIT_GRACE_S``, so a poller sees the 503 first."""
    proc = tiny_tp_server.process
    os.kill(_worker_pid(proc.pid), signal.SIGKILL)
    start = time.monotonic()
    statuses: list[int] = []
    with httpx.Client(base_url=tiny_tp_server.base_url, timeout=2, trust_env=False) as http:
        while proc.poll() is None and time.monotonic() - start < EXIT_BOUND_S:
            try:
                r = http.get("/health")
            except httpx.HTTPError:
                break  # the listener is gone: the process is exiting
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert "tensor-parallel" in r.json()["reason"], r.text
            time.sleep(0.02)
    try:
        code = proc.wait(timeout=max(1.0, EXIT_BOUND_S - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs {EXIT_BOUND_S} s after its worker was killed")
    assert code != 0, f"exit status {code}"
    assert 503 in statuses, f"/health never failed before the exit: {statuses}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{tiny_tp_server.base_url}/health", timeout=2)
    log = tiny_tp_server.log_path.read_text()
    assert "tensor-parallel worker" in log and "exiting with status 1" in log, log[-2000:]
    print(f"server exited {time.monotonic() - start:.1f} s after its worker was killed")


def test_a_node_that_never_joins_exits_1_with_one_line(tmp_path: Path) -> None:
    """Node 0 of two whose node 1 never starts: the start fails after the group timeout,
    naming the rank, as one log line and status 1 (no traceback). Shape preset, dummy
    weights: nothing is loaded before the join (a tokenizer is given: a preset without one
    is refused before anything, from the flags alone)."""
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    argv = [
        sys.executable, "-m", "server", "--model", "smollm2-135m", "--load-format", "dummy",
        "--tokenizer", str(tmp_path / "tokenizer"),
        "--device", "cpu", "--host", HOST, "--port", str(free_port()),
        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
        "--master-port", str(free_port()),
    ]  # fmt: skip
    env = {**os.environ, "PAGEDSERVE_TP_TIMEOUT_S": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rank(s) 1 did not join the group" in done.stderr
    assert "Traceback" not in done.stderr
