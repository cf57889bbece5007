"""Fault isolation in LLMEngine.step: a request whose computation raises fails alone.

A tiny random Llama whose runner is wrapped in the test-only fault injector
(tests/engine/fault_runner.py): requests whose prompt holds the marker token raise inside the
runner's ``execute``. The step bisects, fails exactly those requests
(``finish_reason="error"``, blocks freed), and every other request gets exactly the greedy
tokens it gets when it runs alone. Prompts share a prefix so prefix caching (and its
copy-on-write) is active while steps fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.faults import execute_isolating
from engine.llm_engine import LLMEngine
from kvpool.config import KVPoolConfig
from scheduler import SchedulerConfig
from scheduler.request import SamplingParams
from tests.engine.conftest import make_tiny_llama
from tests.engine.fault_runner import FaultInjectingRunner

MARKER = 7  # the fault token; ordinary prompts avoid it
DEVICE = {"device": "cpu", "dtype": "float32"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-faults"), num_kv_heads=2, seed=3)


def make_engine(
    model_path: Path,
    fault: int | None = MARKER,
    *,
    async_scheduling: bool = False,
    num_blocks: int = 40,
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(model=str(model_path), async_scheduling=async_scheduling, **DEVICE),
        KVPoolConfig(num_blocks=num_blocks, block_size=4),
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48),
    )
    if fault is not None:
        engine.runner = FaultInjectingRunner(engine.runner, fault)
    return engine


def run(engine: LLMEngine, requests: dict[str, list[int]], max_tokens: int) -> dict[str, tuple]:
    """Add all requests at once, step to the end; request id -> (tokens, reason, error)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    done: dict[str, tuple] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], out.finish_reason, out.error)
        engine.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks
    return done


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(8, 256, (9,), generator=g).tolist()  # two full 4-token blocks + 1
    out = {}
    for i in range(10):
        tail = torch.randint(8, 256, (1 + 3 * i % 11,), generator=g).tolist()
        out[f"r{i}"] = (shared if i % 2 else []) + tail
    # Poisoned: the marker in the middle of one prompt, at the end of another (the marker
    # is in the request either way, so every step that computes it raises).
    out["bad0"] = shared + [MARKER] + out["r3"][-2:]
    out["bad1"] = out["r4"] + [MARKER]
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_failing_requests_fail_alone_and_the_others_match_their_solo_runs(
    model_path: Path, async_scheduling: bool
) -> None:
    """Asynchronously, a launch that raises first reads the step in flight, then gives its
    own pending decodes their tokens on the host and isolates the rows as a synchronous
    step does."""
    requests = prompts()
    solo_engine = make_engine(model_path, fault=None)
    solo = {
        request_id: run(solo_engine, {request_id: prompt}, max_tokens=6)[request_id][0]
        for request_id, prompt in requests.items()
        if not request_id.startswith("bad")
    }
    engine = make_engine(model_path, async_scheduling=async_scheduling)
    done = run(engine, requests, max_tokens=6)
    assert set(done) == set(requests)
    for request_id in ("bad0", "bad1"):
        tokens, reason, error = done[request_id]
        assert (tokens, reason) == ([], "error")
        assert error == f"InjectedFault: injected fault for test marker token {MARKER}"
    for request_id, expected in solo.items():
        assert done[request_id] == (expected, "length", None), request_id


def test_a_fault_that_every_row_hits_fails_every_row(model_path: Path) -> None:
    """A failure that is not about one request (here: every sub-run raises) fails them all,
    and the engine keeps serving afterwards."""
    engine = make_engine(model_path, fault=None)
    requests = {f"r{i}": [10 + i, 20 + i, 30 + i] for i in range(5)}
    params = SamplingParams(max_tokens=3, temperature=0)
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    real_execute = engine.runner.execute
    calls = []

    def broken(out):  # noqa: ANN001, ANN202 - the runner's own signature
        calls.append(len(out.scheduled))
        raise RuntimeError("device lost")

    engine.runner.execute = broken  # type: ignore[method-assign]
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(requests)
    assert all(
        o.finish_reason == "error" and o.error == "RuntimeError: device lost" for o in outputs
    )
    # One full attempt, then the bisection tree over 5 rows: 2 + 4 + 2 internal/leaf runs.
    assert calls[0] == 5 and len(calls) == 1 + 8
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.check_integrity()
    engine.runner.execute = real_execute  # type: ignore[method-assign]
    assert run(engine, {"after": [1, 2, 3]}, max_tokens=2)["after"][1] == "length"


def test_isolation_runs_copy_on_write_once(model_path: Path) -> None:
    """Sub-runs carry ``blocks_to_copy`` until one succeeds, and never after."""
    from engine.outputs import ModelRunnerOutput
    from scheduler.output import SchedulerOutput

    engine = make_engine(model_path, fault=None)
    for i in range(4):
        engine.add_request(f"r{i}", [40 + i] * 5, SamplingParams(max_tokens=2, temperature=0))
    out = engine.scheduler.schedule()
    out.blocks_to_copy = [(1, 2)]
    seen: list[tuple[list[str], list]] = []

    class Runner:
        def execute(self, sub: SchedulerOutput) -> ModelRunnerOutput:
            ids = [s.request_id for s in sub.scheduled]
            seen.append((ids, list(sub.blocks_to_copy)))
            if "r0" in ids:
                raise ValueError("poisoned")
            return ModelRunnerOutput(ids, [0] * len(ids), [None] * len(ids))

    merged, failed = execute_isolating(Runner(), out, ValueError("poisoned"))  # type: ignore[arg-type]
    assert failed == {"r0": "ValueError: poisoned"}
    assert sorted(merged.request_ids) == ["r1", "r2", "r3"]
    # [r0 r1] fails (copies carried), [r0] fails alone (the culprit), [r1] succeeds carrying
    # the copies, [r2 r3] runs after the first success without them.
    assert seen == [
        (["r0", "r1"], [(1, 2)]),
        (["r0"], [(1, 2)]),
        (["r1"], [(1, 2)]),
        (["r2", "r3"], []),
    ]


def test_a_launch_that_raises_beside_pending_decodes(model_path: Path) -> None:
    """Asynchronous scheduling: a poisoned prompt admitted while other requests decode makes
    a launch raise whose decodes wait for the step in flight. That step is read first, the
    decodes get their tokens on the host, the poisoned request fails alone, and the others
    finish with their solo tokens."""
    requests = {k: v for k, v in prompts().items() if k in ("r0", "r1", "r2", "r3")}
    solo_engine = make_engine(model_path, fault=None)
    solo = {rid: run(solo_engine, {rid: p}, max_tokens=12)[rid][0] for rid, p in requests.items()}
    engine = make_engine(model_path, async_scheduling=True, num_blocks=100)
    launch = engine.runner.launch
    pending_rows_at_fault: list[int] = []

    def watching(out, previous=None):  # type: ignore[no-untyped-def]
        try:
            return launch(out, previous)
        except Exception:
            pending_rows_at_fault.append(sum(s.token_ids[0] < 0 for s in out.scheduled))
            raise

    engine.runner.launch = watching
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    done: dict[str, tuple] = {}
    for n in range(40):
        if n == 6:  # every prompt above is computed by then: they all decode
            engine.add_request("bad", [MARKER, 11, 12], params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], out.finish_reason, out.error)
        engine.check_integrity()
        if n > 6 and not engine.has_unfinished_requests():
            break
    assert pending_rows_at_fault and pending_rows_at_fault[0] > 0
    assert done["bad"][:2] == ([], "error")
    for request_id, expected in solo.items():
        assert done[request_id] == (expected, "length", None), request_id
    assert engine.num_free_blocks == engine.num_total_blocks
