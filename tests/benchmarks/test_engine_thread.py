"""benchmarks.engine_thread's measurements run end to end (on the fake engine, in milliseconds)."""

from __future__ import annotations

from benchmarks.engine_thread import _prompts, ipc_round_trip_ms, run_alone, run_threaded
from scheduler.request import SamplingParams
from tests.server.server_fakes import FakeEngine


async def test_bench_measures_both_paths() -> None:
    engine = FakeEngine(num_blocks=256)
    prompts = _prompts(engine.tokenizer, 4)
    params = SamplingParams(max_tokens=5, temperature=0)
    alone = run_alone(engine, prompts, params)
    assert alone["tokens_per_s"] > 0 and len(alone["sample"]) == 4
    engine._owner = None  # the threaded run hands the engine to the client's thread
    threaded = await run_threaded(engine, prompts, params)
    assert threaded["tokens_per_s"] > 0
    assert 0 <= threaded["lag_p50_ms"] <= threaded["lag_p99_ms"] <= threaded["lag_max_ms"]
    assert ipc_round_trip_ms(alone["sample"], repeats=3) > 0
