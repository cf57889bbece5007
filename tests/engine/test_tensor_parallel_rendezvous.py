"""Starting a tensor-parallel group when a worker dies before joining it: rank 0, which
serves the rendezvous store and watches its workers (engine/tp_group.py), fails the start
within a poll of the death with the rank and its exit status, stops and reaps the other
workers and closes the store; a TP=2 engine then starts in the same process and gives TP=1's
tokens. A script that builds the engine at its top level, outside
``if __name__ == "__main__":``, fails at once with that hint instead of hanging. Over two
"hosts" (two processes here), a node that never comes costs the timeout and the error names
its ranks; one that comes joins, and its ranks follow rank 0 to a clean stop."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from engine import LLM, SamplingParams, tp_launch
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.tp_group import TensorParallelGroup, TensorParallelStartError
from kvpool.config import KVPoolConfig
from loadtest.launcher import free_port
from scheduler.config import SchedulerConfig
from tests.child_env import with_repo_on_path
from tests.engine import tp_faults
from tests.engine.conftest import make_tiny_llama

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 17, 42, 99, 7], [1, 200, 3, 3, 150, 11, 64, 90, 21]]
# The group timeout while these start: a start that waited for it would fail the bound.
TIMEOUT_S = 60
FAIL_BOUND_S = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 6 heads in 3 KV groups: shardable over 2 and 3 ranks.
    return make_tiny_llama(
        tmp_path_factory.mktemp("tp-rendezvous"), num_kv_heads=3, seed=7, hidden_size=192,
        num_attention_heads=6, intermediate_size=208,
    )  # fmt: skip


def test_a_worker_dying_before_the_join_fails_the_start_and_leaves_nothing(model, monkeypatch):
    """TP=3: rank 2 exits at start, rank 1 registers and blocks in ``init_process_group``
    waiting for rank 0, which must kill and reap it."""
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setattr(tp_launch, "worker_main", tp_faults.last_rank_dies_at_start)
    listened: list[str] = []
    listen = TensorParallelGroup.listen

    def recording(self: TensorParallelGroup) -> str:
        listened.append(listen(self))
        return listened[-1]

    monkeypatch.setattr(TensorParallelGroup, "listen", recording)
    threads = set(threading.enumerate())
    start = time.monotonic()
    with pytest.raises(TensorParallelStartError) as failure:
        LLM(str(model), tensor_parallel_size=3, num_kv_blocks=32, max_num_seqs=4, device="cpu")
    elapsed = time.monotonic() - start
    message = str(failure.value)
    assert f"rank {tp_faults.DYING_RANK}" in message
    assert f"exited with status {tp_faults.DYING_STATUS} before joining" in message
    assert elapsed < FAIL_BOUND_S, f"the start failed after {elapsed:.1f} s"
    # Nothing left: no worker (rank 1 killed and reaped), no group, no thread, no store.
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()
    assert set(threading.enumerate()) <= threads
    port = int(listened[-1].rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_group_starts_in_the_same_process_after_a_failed_start(model):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(str(model), tensor_parallel_size=2, num_kv_blocks=32, max_num_seqs=4, device="cpu")
    try:
        tp2 = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
    tp1_llm = LLM(str(model), num_kv_blocks=32, device="cpu")
    tp1 = [o.token_ids for o in tp1_llm.generate(PROMPTS, params)]
    assert tp2 == tp1


def test_a_script_building_the_engine_unguarded_fails_with_the_hint(model, tmp_path):
    """The spawned worker re-imports the script, whose top level builds the engine again:
    it exits at once (engine/tp_launch.py ``refuse_in_spawn_bootstrap``) and rank 0 says
    what to change."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from engine import LLM

            llm = LLM({str(model)!r}, tensor_parallel_size=2, num_kv_blocks=32, device="cpu")
            print("unreachable")
            """
        )
    )
    env = with_repo_on_path(PAGEDSERVE_TP_TIMEOUT_S=str(TIMEOUT_S))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=TIMEOUT_S + 30,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert done.returncode != 0 and "unreachable" not in done.stdout
    assert "TensorParallelStartError" in done.stderr, done.stderr[-2000:]
    assert "re-imported the main script" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert elapsed < FAIL_BOUND_S, f"the script failed after {elapsed:.1f} s"


def _greedy(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for request_id, prompt in zip(tokens, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return list(tokens.values())


def test_two_nodes_join_and_a_missing_node_costs_the_timeout(model, monkeypatch):
    port = free_port()
    config = EngineConfig(model=str(model), device="cpu", tensor_parallel_size=2, nnodes=2,
                          master_port=port)  # fmt: skip
    kv, scheduler = KVPoolConfig(num_blocks=32), SchedulerConfig(max_num_seqs=4)
    # Node 1 never starts: rank 0 cannot see its process, so it waits out the timeout.
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT_S", "2")
    start = time.monotonic()
    with pytest.raises(TensorParallelStartError, match=r"rank\(s\) 1 did not join .* within 2 s"):
        LLMEngine(config, kv, scheduler)
    assert time.monotonic() - start < FAIL_BOUND_S
    assert not dist.is_initialized()
    # Node 1 starts (before or after node 0 listens: its ranks retry the store until the
    # timeout), and node 0 goes on as soon as its rank has joined.
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT_S", str(TIMEOUT_S))
    node1 = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", str(model), "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--device", "cpu",
         "--num-kv-blocks", "32", "--max-num-seqs", "4", "--log-level", "warning"],
        cwd=REPO, env=with_repo_on_path(),
    )  # fmt: skip
    try:
        engine = LLMEngine(config, kv, scheduler)
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            tp2 = _greedy(engine, params)
        finally:
            engine.shutdown()
        assert node1.wait(timeout=TIMEOUT_S) == 0  # its rank stopped on rank 0's STOP
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    tp1_llm = LLM(str(model), num_kv_blocks=32, device="cpu")
    tp1 = [o.token_ids for o in tp1_llm.generate(PROMPTS, params)]
    assert tp2 == tp1
