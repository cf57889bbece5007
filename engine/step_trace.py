"""StepTrace: one JSON line per engine step, its shape and its measured time, for replaying
the step-time predictor offline (``python -m benchmarks.step_replay``).

Off unless the environment names a file::

    PAGEDSERVE_STEP_TRACE=/tmp/steps.jsonl python -m server ...

The first line is a header with what the predictor is built from (the engine's
``StepCostModel`` and the KV bytes of one token), so that a replay builds the same predictor
without loading the model; each further line is a step::

    {"time": .., "step_s": .., "gap_s": .., "predicted_s": .., "forward_s": .., "replay": ..,
     "num_rows": ..}

``step_s`` is what ``LLMEngine.step`` measures and feeds the predictor (the whole step:
scheduling, the forward pass, sampling, the update); ``predicted_s`` is the live predictor's
figure for the step before it ran (null without latency targets); ``gap_s`` is the engine
loop's time between the previous step and this one while it had work (null after an idle
spell); ``time`` is the wall clock (Unix seconds) at the step's end, to match steps with a
load generator's windows; ``replay`` is how its forward pass ran (``engine.outputs.REPLAYS``:
a decode graph, a whole graph or graph pieces of a step with prefill tokens, or eager; ""
where not known). The other fields are ``StepShape``'s.

Several processes must not share one file: a name containing ``{pid}`` gets the process id.
Lines are flushed per step, so a trace of a server killed mid-run is still whole up to its
last step.

Ownership: the open file is this object's; the engine calls ``record`` once per step from
its own thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from engine.cost import StepCostModel
from engine.step_predictor import StepShape

ENV = "PAGEDSERVE_STEP_TRACE"
FORMAT = "pagedserve-step-trace/1"


class StepTrace:
    def __init__(
        self,
        path: str | Path,
        cost_model: StepCostModel,
        kv_bytes_per_token: int,
        info: dict[str, Any] | None = None,
    ) -> None:
        """Open ``path`` (truncated) and write the header.

        Args:
            path: the file; ``{pid}`` in it becomes the process id.
            cost_model: the engine's, for the replay's predictor.
            kv_bytes_per_token: K and V bytes of one token over all layers.
            info: anything else worth keeping beside them (the model, the targets).
        """
        self.path = Path(str(path).replace("{pid}", str(os.getpid())))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8")
        header = {
            "format": FORMAT,
            "cost_model": dataclasses.asdict(cost_model),
            "kv_bytes_per_token": kv_bytes_per_token,
            **(info or {}),
        }
        self._write(header)

    @classmethod
    def from_env(
        cls, cost_model: StepCostModel, kv_bytes_per_token: int, info: dict[str, Any] | None = None
    ) -> StepTrace | None:
        """A trace to the file ``$PAGEDSERVE_STEP_TRACE`` names, or None when it is unset."""
        path = os.environ.get(ENV)
        if not path:
            return None
        return cls(path, cost_model, kv_bytes_per_token, info)

    def record(
        self,
        shape: StepShape,
        step_s: float,
        gap_s: float | None,
        predicted_s: float | None,
        forward_s: float | None = None,
        replay: str = "",
    ) -> None:
        self._write(
            {
                "time": time.time(),
                "step_s": step_s,
                "gap_s": gap_s,
                "predicted_s": predicted_s,
                "forward_s": forward_s,
                "replay": replay,
                **dataclasses.asdict(shape),
            }
        )

    def _write(self, line: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(line, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, slots=True)
class TracedStep:
    """One step line of a trace."""

    shape: StepShape
    step_s: float
    gap_s: float | None
    predicted_s: float | None
    forward_s: float | None
    replay: str = ""  # engine.outputs.REPLAYS, or "" (not known, or an older trace)


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole trace: its header's cost model and KV bytes per token, and its steps."""

    cost_model: StepCostModel
    kv_bytes_per_token: int
    header: dict[str, Any]
    steps: list[TracedStep]


def read_trace(path: str | Path) -> Trace:
    """Read a trace ``StepTrace`` wrote.

    Raises:
        ValueError: the file is not a step trace (its first line is not the header).
    """
    with open(path, encoding="utf-8") as f:
        lines = _lines(f)
        try:
            header = next(lines)
        except StopIteration:
            raise ValueError(f"{path}: empty, not a step trace") from None
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: not a step trace (no {FORMAT!r} header)")
        fields = {f.name for f in dataclasses.fields(StepShape)}
        steps = [
            TracedStep(
                StepShape(**{k: v for k, v in line.items() if k in fields}),
                line["step_s"],
                line.get("gap_s"),
                line.get("predicted_s"),
                line.get("forward_s"),
                line.get("replay", ""),
            )
            for line in lines
        ]
    return Trace(StepCostModel(**header["cost_model"]), header["kv_bytes_per_token"], header, steps)


def _lines(f: IO[str]) -> Iterator[dict[str, Any]]:
    for text in f:
        text = text.strip()
        if text:
            try:
                yield json.loads(text)
            except json.JSONDecodeError:
                return  # a line cut short by a killed process ends the trace
