"""The host-overhead benchmark (benchmarks/host_overhead.py) on a tiny shape: its stub stands
in for the forward behind the decode graphs' buffers, and every phase of a step is timed."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.host_overhead import (
    PHASES,
    SPEC_PHASES,
    PhaseTimer,
    build_engine,
    instrument,
    main,
    run_batch,
)
from scheduler.request import SamplingParams


def test_stubbed_engine_decodes_the_stubs_argmax_through_the_graph_buffers() -> None:
    engine = build_engine("cpu", max_batch=4, context=20, steps=6)
    timer = PhaseTimer(time.perf_counter)
    instrument(engine, timer)
    replays = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda batch: replays.append(batch.num_tokens) or run(batch)
    result = run_batch(engine, timer, batch=3, context=20, warmup=1, steps=4)
    # Every timed step is a decode of all 3 requests, replayed from bucket 4's buffers.
    assert replays[-4:] == [3, 3, 3, 3]
    assert all(result[phase] > 0 for phase in PHASES)
    assert abs(sum(result[p] for p in (*PHASES, "other")) - result["step"]) < 1e-6
    assert not engine.has_unfinished_requests()  # aborted after the timed steps
    # The stub's logits rows are fixed: a lone request's every token is row 0's argmax.
    engine.add_request("x", [5] * 20, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == [int(engine.runner.graphs.model.logits[0].argmax())] * 3


def test_main_prints_and_writes_every_phase(tmp_path, capsys) -> None:
    path = tmp_path / "host.json"
    args = ["--batch", "1,2", "--context", "10", "--steps", "2", "--warmup-steps", "1"]
    assert main([*args, "--clock", "cpu", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    for phase in (*PHASES, "other", "step"):
        assert phase in printed
    figures = json.loads(path.read_text())
    assert figures["clock"] == "cpu" and figures["device"] == "cpu"
    assert set(figures["us_per_step"]) == {"1", "2"}
    assert all(figures["us_per_step"][b]["step"] > 0 for b in ("1", "2"))


def test_penalised_sampling_runs_the_penalties_and_forgets_them() -> None:
    engine = build_engine("cpu", max_batch=2, context=12, steps=4)
    timer = PhaseTimer(time.perf_counter)
    instrument(engine, timer)
    result = run_batch(engine, timer, batch=2, context=12, warmup=1, steps=3, sampling="penalties")
    assert result["sample"] > 0
    counts = engine.sampler.penalties
    assert counts.capacity > 0, "the penalised rows were counted"
    assert len(counts) == 0, "the aborted requests' counts are gone"


def test_a_context_past_the_models_positions_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--batch", "1", "--context", "2048", "--steps", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--context 2048 with 12 steps needs" in err and "tiny-llama has 2048" in err


def test_speculative_steps_time_every_requests_proposal(monkeypatch) -> None:
    """With --speculative every request searches its context at every step (the search's
    full cost), the stub's tokens vary from step to step, and no request finishes early."""
    from engine.spec_decode import speculator

    searches = []
    search = speculator.propose_ngram
    monkeypatch.setattr(
        speculator, "propose_ngram", lambda *a: searches.append(len(a[0])) or search(*a)
    )
    engine = build_engine("cpu", max_batch=3, context=24, steps=5, speculative_tokens=3)
    timer = PhaseTimer(time.perf_counter, (*PHASES, *SPEC_PHASES))
    instrument(engine, timer)
    steps = []
    propose = engine.speculator.propose
    engine.speculator.propose = lambda s: steps.append(len(searches)) or propose(s)
    result = run_batch(engine, timer, batch=3, context=24, warmup=1, steps=4)
    assert result["propose"] > 0
    searched = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert searched[-4:] == [3, 3, 3, 3], "every request searched at every step"
    assert not engine.has_unfinished_requests()
    stub = engine.runner.graphs.model
    assert stub.vary and stub.calls > 0
    batch = SimpleNamespace(logits_indices=torch.zeros(4))
    first, second = stub(batch, None, None), stub(batch, None, None)
    assert not torch.equal(first.argmax(-1), second.argmax(-1)), "a row's pick varies"
