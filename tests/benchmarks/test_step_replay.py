"""The step trace (engine/step_trace.py) and its replay (benchmarks/step_replay.py) on a
synthetic machine: a trace reads back as written, the replay feeds the predictor the steps in
order, and the noise floor sees the spread of repeated shapes and nothing else."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.step_replay import figures, kind, main, noise_ratios, replay, within
from engine.step_predictor import StepShape
from engine.step_trace import StepTrace, read_trace
from tests.engine.cost_figures import COST, KV_BYTES_PER_TOKEN


def decode(rows: int, context: int) -> StepShape:
    return StepShape(rows, rows, rows, 0, rows, rows * context, rows * context)


def prefill(tokens: int, decodes: int = 0, context: int = 200) -> StepShape:
    pairs = tokens * (tokens + 1) // 2 + decodes * context
    return StepShape(
        1 + decodes, decodes, tokens + decodes, tokens, 1 + decodes, pairs,
        tokens + decodes * context,
    )  # fmt: skip


def machine(shape: StepShape) -> float:
    """Seconds: a fixed cost, one per row, one per token and one per attention pair."""
    return 0.004 + 2e-4 * shape.num_rows + 3e-4 * shape.num_tokens + 4e-9 * shape.num_pairs


def write(path, shapes, noise: float, seed: int = 0, replays=None) -> None:
    rng = random.Random(seed)
    trace = StepTrace(path, COST, KV_BYTES_PER_TOKEN, {"model": "synthetic"})
    for i, shape in enumerate(shapes):
        step_s = machine(shape) * rng.uniform(1 - noise, 1 + noise)
        trace.record(shape, step_s, 0.001, None, replay=replays(i) if replays else "")
    trace.close()


def workload(n: int, seed: int = 1) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for i in range(n):
        rows = 16 * (1 + (i // 40) % 4)
        if i % 10 == 9:
            shapes.append(prefill(rng.choice([64, 256, 512]), rows, 300))
        else:
            shapes.append(decode(rows, 300 + i % 5))
    return shapes


def test_a_trace_reads_back_as_written_and_rejects_other_files(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    shapes = workload(30)
    write(path, shapes, noise=0.0)
    trace = read_trace(path)
    assert trace.cost_model == COST and trace.kv_bytes_per_token == KV_BYTES_PER_TOKEN
    assert trace.header["model"] == "synthetic"
    assert [s.shape for s in trace.steps] == shapes
    assert [s.step_s for s in trace.steps] == [machine(s) for s in shapes]
    # A line cut short by a killed server ends the trace; the steps before it stay.
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step_s": 0.1, "num_ro')
    assert len(read_trace(path).steps) == 30
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"hello": 1}) + "\n")
    with pytest.raises(ValueError, match="not a step trace"):
        read_trace(other)
    assert main(["replay", str(other)]) == 1


def test_the_noise_floor_is_the_spread_of_repeated_shapes(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    write(path, workload(200), noise=0.05)
    ratios = [r for r in noise_ratios(read_trace(path).steps) if r is not None]
    assert len(ratios) > 150 and all(within(r) for r in ratios)
    write(path, workload(200), noise=0.6)
    ratios = [r for r in noise_ratios(read_trace(path).steps) if r is not None]
    share = sum(map(within, ratios)) / len(ratios)
    assert 0.2 < share < 0.8


def test_the_replay_learns_a_linear_machine_and_reports_by_kind(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    write(path, workload(400), noise=0.03)
    trace = read_trace(path)
    ratios = replay(trace)
    assert ratios[0] is None and all(r is not None for r in ratios[1:])
    by_kind = figures(trace, warmup=50)
    assert by_kind["all"].steps == 350
    assert {k for k, f in by_kind.items() if f.steps} == {
        "all", "decode small", "decode large", "mixed large",
    }  # fmt: skip
    late = by_kind["all"].predicted
    assert sum(map(within, late)) / len(late) >= 0.95
    assert kind(prefill(16)) == "prefill small" and kind(prefill(100, 4)) == "mixed large"
    assert main(["replay", str(path), "--warmup", "50"]) == 0
    out = capsys.readouterr().out
    assert "decode large" in out and "350" in out


def test_the_report_splits_steps_by_how_their_forward_ran(tmp_path, capsys) -> None:
    """A trace whose steps say how they ran (decode graph, whole graph, ...) gets one row per
    way: steps, p50 and p99 time, mean prefill tokens; a trace without says nothing."""
    path = tmp_path / "t.jsonl"
    shapes = workload(100)
    write(path, shapes, noise=0.0,
          replays=lambda i: "whole_graph" if shapes[i].num_prefill_tokens else "decode_graph")
    trace = read_trace(path)
    assert {s.replay for s in trace.steps} == {"whole_graph", "decode_graph"}
    assert main(["replay", str(path), "--warmup", "10"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("decode_graph", "whole_graph"))}  # fmt: skip
    assert rows["decode_graph"][1] == "90" and rows["whole_graph"][1] == "10"
    prefill_tokens = [s.num_prefill_tokens for s in shapes if s.num_prefill_tokens]
    assert float(rows["whole_graph"][-1]) == round(sum(prefill_tokens) / len(prefill_tokens))
    plain = tmp_path / "plain.jsonl"
    write(plain, shapes, noise=0.0)
    assert main(["replay", str(plain)]) == 0
    assert "p50 ms" not in capsys.readouterr().out
