"""A test-only fault injector: a runner wrapper that raises for requests holding a marker token.

Tests wrap a built engine's runner after construction::

    engine.runner = FaultInjectingRunner(engine.runner, token_id)

so that chaos tests can engineer per-request failures inside a real engine step. Production
fault isolation (``execute_isolating``) lives in engine/faults.py; this file never ships in
the serving path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.faults import Runner
    from engine.model_runner import LaunchedStep
    from engine.outputs import ModelRunnerOutput
    from scheduler.output import SchedulerOutput


class InjectedFault(RuntimeError):
    """Raised by ``FaultInjectingRunner``: a test asked for this failure."""


class FaultInjectingRunner:
    """A runner that raises ``InjectedFault`` from ``execute`` (and, under asynchronous
    scheduling, ``launch``) when the step computes any request whose prompt contains
    ``token_id``; otherwise it defers to the wrapped runner."""

    def __init__(self, runner: Runner, token_id: int) -> None:
        self.runner = runner
        self.token_id = token_id
        if hasattr(runner, "launch"):  # the engine overlaps steps only with a launch
            self.launch = self._launch
            self.sample = runner.sample  # type: ignore[attr-defined]

    def _check(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            if not item.padding and self.token_id in item.request.prompt_token_ids:
                # The message names the marker, never the prompt.
                raise InjectedFault(f"injected fault for test marker token {self.token_id}")

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._check(out)
        return self.runner.execute(out)

    def _launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        self._check(out)
        return self.runner.launch(out, previous)  # type: ignore[attr-defined]
