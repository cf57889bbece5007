"""The tensor-parallel group: membership, the step plan, rank 0's runner, failure handling.

Who owns what::

    rank 0 (the server, or the offline LLM)             ranks 1..N-1 (worker processes)
    ───────────────────────────────────────             ────────────────────────────────
    scheduler, kvpool's block tables, sampler           the same model shard code, its own
    TensorParallelRunner.launch(plan):                  KV pool (its own KV heads, the same
      broadcast StepPlan ──────── gloo ───────────────>   block ids); run_worker() loop
      copy blocks, build the batch, forward               (engine/tp_launch.py): receive the
        (all-reduce / all-gather with every rank) <─────>  StepPlan, copy blocks, build the
      sample on rank 0 only                                batch, forward; no sampling

The step plan is decided once, by rank 0's scheduler: ``StepPlan`` carries each scheduled
row's positions, token ids and block table and the step's copy-on-write copies, so every rank
writes the same slots of the same blocks and builds the same ``InputBatch``. It travels over a
gloo group (``broadcast_object_list``) even when the model's collectives run on NCCL, so it is
plain host data on every device (vLLM keeps such a CPU group beside its NCCL one).

Joining: rank 0 owns the rendezvous, so it never waits blind. It serves the group's
``TCPStore`` itself (``listen``, before it spawns anyone: the workers get its address), each
worker connects and sets its key (``pagedserve/joined/<rank>``) just before
``init_process_group``, and rank 0 polls for the keys every ``JOIN_POLL_S`` while watching
the processes it spawned. Only when every rank has registered does rank 0 call
``init_process_group`` on the same store. A spawned worker that exits first fails the start
within a poll (``TensorParallelStartError``: its rank, its exit status, and the
``if __name__ == "__main__":`` hint when it died re-importing the user's script); the other
workers are killed and reaped and the store closed, so nothing is left blocked and a new
group can start in the same process at once. (A worker that dies in the instant between
setting its key and entering ``init_process_group`` is the one case left to the timeout.)

A rank on another host is no process of rank 0's: its death before joining costs the whole
timeout (its host's ``pagedserve serve --node-rank`` exits non-zero), though rank 0 still
goes on as soon as every rank has joined, and the timeout error names the ranks that never
did. Under torchrun (``env://``) torchrun owns the store and watches every rank; rank 0
joins with ``init_process_group`` directly.

Failure: never a hang.

- Every collective has the group's timeout (``PAGEDSERVE_TP_TIMEOUT_S``, default 120 s;
  also the longest a rank may take to load before the first collective).
- An idle rank 0 sends a heartbeat plan every quarter of that, so a worker waiting for the
  next step never reaches the timeout, and a worker whose rank 0 is gone hears it by then.
- A watchdog thread on rank 0 polls the processes it spawned; a worker that exits, or a
  collective that raises, fails the group: the step raises ``EngineFatalError`` (never
  isolated or retried: the ranks no longer agree on where they are in the step), the
  server's engine loop dies, and the server process exits with status 1 a moment later
  after killing the remaining workers.
- Workers stop when rank 0 stops: a STOP plan at its exit, or its death
  (engine/tp_launch.py).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from engine.faults import EngineFatalError
from engine.model_runner import LaunchedStep, ModelRunner
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, SamplingParams

logger = logging.getLogger(__name__)

STOP = "stop"  # rank 0 exits: workers return
HEARTBEAT = "heartbeat"  # rank 0 is idle and alive
DEFAULT_TIMEOUT_S = 120.0
EXIT_GRACE_S = 1.0  # between failing /health and exiting, so the failure is seen
JOIN_POLL_S = 0.1  # rank 0's poll for registrations and dead workers while joining
# A spawned worker that finds itself re-importing the user's script (the spawn start
# method runs the main module's top level again) exits with this status
# (engine/tp_launch.py: ``refuse_in_spawn_bootstrap``).
REIMPORT_EXIT_CODE = 3


class TensorParallelStartError(EngineFatalError):
    """The group could not be formed: a rank exited before joining, or did not join within
    the timeout. Nothing of the attempt is left running."""


def _joined_key(rank: int) -> str:
    return f"pagedserve/joined/{rank}"


def collective_timeout_s() -> float:
    return float(os.environ.get("PAGEDSERVE_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One scheduled request's share of a step, as every rank needs it (no request state)."""

    start: int
    num_tokens: int
    token_ids: list[int]
    block_ids: tuple[int, ...]
    samples: bool
    padding: bool
    # Asynchronous scheduling: the row of the step before's picks its pending input token
    # is (``PENDING_TOKEN`` in ``token_ids``); -1 when its tokens are all known.
    pick_row: int = -1


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What rank 0 broadcasts before each forward: the rows in the scheduler's order and the
    copy-on-write block copies. Workers turn it back into a ``SchedulerOutput`` and build the
    same ``InputBatch`` from it (``engine/input_batch.py``)."""

    rows: list[PlanRow]
    blocks_to_copy: list[tuple[int, int]]
    # Asynchronous scheduling: after this step's forward pass rank 0 broadcasts the step's
    # picks over the device group (``TensorParallelRunner.sample``), and every worker takes
    # them for the next step's pending inputs.
    shares_picks: bool = False

    @classmethod
    def of(
        cls, out: SchedulerOutput, previous_rows: Mapping[str, int], shares_picks: bool
    ) -> StepPlan:
        """``previous_rows``: request id -> its row of the step before's picks."""
        rows = [
            PlanRow(
                s.start, s.num_tokens, s.token_ids, s.block_ids, s.samples, s.padding,
                previous_rows[s.request_id] if s.input_pending else -1,
            )
            for s in out.scheduled
        ]  # fmt: skip
        return cls(rows, list(out.blocks_to_copy), shares_picks)

    @property
    def num_sampling_rows(self) -> int:
        """The rows rank 0 picks a token for (the length of the picks it shares)."""
        return sum(1 for r in self.rows if r.samples and not r.padding)

    def to_output(self) -> SchedulerOutput:
        # A worker never samples nor reads request state: every row names one placeholder,
        # but for a pending input's, which names its row of the picks (``feed_pending``).
        placeholder = Request("tp-worker-row", [0], SamplingParams())
        scheduled = [
            ScheduledRequest(
                placeholder if r.pick_row < 0 else _pick_placeholder(r.pick_row),
                r.start,
                r.num_tokens,
                r.token_ids,
                r.block_ids,
                r.samples,
                r.padding,
            )
            for r in self.rows
        ]
        return SchedulerOutput(scheduled=scheduled, blocks_to_copy=self.blocks_to_copy)


def _pick_placeholder(pick_row: int) -> Request:
    """A worker's row whose input is pending: its id names its row of the picks."""
    return Request(f"pick-{pick_row}", [0], SamplingParams())


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and how this process joins the group."""

    rank: int
    local_rank: int  # the rank on its host: picks the GPU
    world_size: int
    init_method: str  # tcp://addr:port (rank 0 serves the store there), or env:// (torchrun)


class TensorParallelGroup:
    """This process's membership of the tensor-parallel group (module docstring).

    ``device_group`` runs the model's collectives (NCCL on CUDA, gloo on CPU), ``plan_group``
    (gloo) the step plans. On rank 0, ``lock`` is held for a whole step (plan and forward)
    and by the heartbeat, so the two never interleave their broadcasts.
    """

    def __init__(
        self, rendezvous: Rendezvous, backend: str, *, exit_on_failure: bool = False
    ) -> None:
        self.rank = rendezvous.rank
        self.local_rank = rendezvous.local_rank
        self.world_size = rendezvous.world_size
        self.backend = backend
        self.timeout_s = collective_timeout_s()
        self.exit_on_failure = exit_on_failure
        self.processes: list[BaseProcess] = []  # the workers this process spawned
        self.lock = threading.Lock()
        self.failed: str | None = None
        self.closed = False
        self._last_send = time.monotonic()
        self._rendezvous = rendezvous
        # The rendezvous store (tcp:// only): rank 0 serves it from ``listen`` until the group
        # is destroyed or the start fails; a worker holds a client of it.
        self._store: Any = None
        self.address = rendezvous.init_method  # rank 0: with the port ``listen`` bound
        self.device_group: Any = None
        self.plan_group: Any = None

    def listen(self) -> str:
        """Rank 0: serve the rendezvous store, before any worker starts. Returns the init
        method the other ranks join with: the address with the port bound (port 0 in
        ``init_method`` asks for any free one)."""
        url = urlsplit(self._rendezvous.init_method)
        if self.rank != 0 or url.scheme != "tcp" or url.hostname is None:
            raise ValueError(f"rank {self.rank} cannot serve {self._rendezvous.init_method}")
        if self._store is None:
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                url.hostname,
                url.port or 0,
                self.world_size,
                is_master=True,
                timeout=timedelta(seconds=self.timeout_s),
                wait_for_workers=False,  # rank 0 waits itself, watching its workers
            )
        self.address = f"tcp://{url.hostname}:{self._store.port}"
        return self.address

    def join(self) -> None:
        """Join the group: returns when every rank has joined. On rank 0 (tcp://), raises
        ``TensorParallelStartError`` when a spawned worker exits first or the timeout
        passes, after stopping every worker in ``processes`` and closing the store."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed group already exists in this process")
        rendezvous = self._rendezvous
        if urlsplit(rendezvous.init_method).scheme != "tcp":  # env://: torchrun's store
            self._init(init_method=rendezvous.init_method)
        elif self.rank == 0:
            try:
                self.listen()
                self._await_ranks()
                self._init(store=self._store)
            except BaseException as exc:
                self.abort(f"joining the tensor-parallel group failed: {exc}")
                raise
        else:
            url = urlsplit(rendezvous.init_method)
            assert url.hostname is not None and url.port is not None, rendezvous.init_method
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                url.hostname,
                url.port,
                self.world_size,
                is_master=False,
                timeout=timedelta(seconds=self.timeout_s),
            )
            self._store.set(_joined_key(self.rank), str(os.getpid()))
            self._init(store=self._store)

    def _init(self, **rendezvous: Any) -> None:
        """``init_process_group`` (``rendezvous``: its ``store`` or ``init_method``), and
        the plan group beside a device group that is not gloo."""
        timeout = timedelta(seconds=self.timeout_s)
        dist.init_process_group(
            self.backend, rank=self.rank, world_size=self.world_size, timeout=timeout,
            **rendezvous,
        )  # fmt: skip
        self.device_group = dist.group.WORLD
        self.plan_group = (
            dist.new_group(backend="gloo", timeout=timeout)
            if self.backend != "gloo"
            else dist.group.WORLD
        )

    # ---- rank 0 ---------------------------------------------------------------------------

    def _await_ranks(self) -> None:
        """Rank 0: poll the store until every other rank has registered, failing as soon as
        a spawned worker has exited (its exit is read before the keys, so a worker that
        registered and died at once is caught too) or when the timeout has passed."""
        missing = set(range(1, self.world_size))
        deadline = time.monotonic() + self.timeout_s
        while True:
            for rank, p in enumerate(self.processes, start=1):  # node 0's ranks 1..
                if p.exitcode is not None:  # polls (and reaps) the process
                    raise TensorParallelStartError(_describe_early_exit(rank, p))
            missing = {r for r in missing if not self._store.check([_joined_key(r)])}
            if not missing:
                return
            if time.monotonic() > deadline:
                remote = any(r > len(self.processes) for r in missing)
                raise TensorParallelStartError(
                    f"tensor-parallel rank(s) {', '.join(map(str, sorted(missing)))} did not "
                    f"join the group at {self.address} within {self.timeout_s:g} s "
                    "(PAGEDSERVE_TP_TIMEOUT_S)"
                    + (
                        "; a rank on another host joins when that host runs `pagedserve "
                        "serve --node-rank K` with the same --master-addr/--master-port"
                        if remote
                        else ""
                    )
                )
            sentinels = [p.sentinel for p in self.processes]
            if sentinels:
                multiprocessing.connection.wait(sentinels, timeout=JOIN_POLL_S)
            else:
                time.sleep(JOIN_POLL_S)

    def abort(self, reason: str) -> None:
        """Rank 0, a start that failed: kill and reap every spawned worker and close the
        store, so nothing of the attempt is left and a new group can start in this process."""
        if self.failed is None:
            self.failed = reason
        self.closed = True
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None  # the last reference: its server stops and the port is free

    def send(self, message: StepPlan | str) -> None:
        """Rank 0: broadcast a plan, HEARTBEAT or STOP (call with ``lock`` held)."""
        dist.broadcast_object_list([message], src=0, group=self.plan_group)
        self._last_send = time.monotonic()

    def start_watchdog(self) -> None:
        """Rank 0, once joined: watch the spawned workers (``join`` watched them until then)."""
        threading.Thread(target=self._watch, name="pagedserve-tp-watchdog", daemon=True).start()

    def start_heartbeat(self) -> None:
        """Rank 0, once every rank has built its engine (they are all in ``run_worker``'s
        loop): the idle heartbeat."""
        threading.Thread(target=self._beat, name="pagedserve-tp-heartbeat", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        while not self.closed and self.failed is None:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if self.closed:
                return
            for sentinel in ready:
                p = sentinels[sentinel]
                p.join(timeout=1.0)  # reaped, so its exit code is known
                self.fail(f"tensor-parallel worker {p.name} (pid {p.pid}) exited with {p.exitcode}")
                return

    def _beat(self) -> None:
        interval = self.timeout_s / 4
        while not self.closed and self.failed is None:
            time.sleep(min(interval, 1.0))
            if time.monotonic() - self._last_send < interval:
                continue
            if not self.lock.acquire(timeout=interval):
                continue  # a step is running: it is the heartbeat
            try:
                if not self.closed and self.failed is None:
                    self.send(HEARTBEAT)
            except Exception as exc:  # noqa: BLE001 - any failure of a collective is fatal
                self.fail(f"heartbeat to the tensor-parallel workers failed: {exc}")
            finally:
                self.lock.release()

    def fail(self, reason: str) -> None:
        """The group is broken: record why, kill the local workers, and with
        ``exit_on_failure`` (the server) exit the process with status 1 shortly after."""
        if self.failed is not None or self.closed:
            return
        self.failed = reason
        logger.critical("%s; the tensor-parallel group cannot go on", reason)
        for p in self.processes:
            if p.is_alive():
                p.kill()
        if self.exit_on_failure:

            def exit_now() -> None:
                time.sleep(EXIT_GRACE_S)
                logger.critical("exiting with status 1: %s", reason)
                logging.shutdown()
                os._exit(1)

            threading.Thread(target=exit_now, name="pagedserve-tp-exit", daemon=True).start()

    def check(self) -> None:
        if self.failed is not None:
            raise EngineFatalError(f"tensor-parallel group failed: {self.failed}")

    def shutdown(self) -> None:
        """Rank 0: tell the workers to stop, wait for them briefly, then kill what is left."""
        if self.closed:
            return
        if self.rank == 0 and self.failed is None and self.lock.acquire(timeout=5.0):
            try:
                self.send(STOP)
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.warning("could not send STOP to the tensor-parallel workers")
            finally:
                self.lock.release()
        self.closed = True
        for p in self.processes:
            p.join(timeout=10.0)
            if p.is_alive():
                logger.warning("tensor-parallel worker %s did not stop; killing it", p.name)
                p.kill()
                p.join(timeout=5.0)
        if self.device_group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        logger.info("tensor-parallel group stopped")


def _describe_early_exit(rank: int, p: BaseProcess) -> str:
    """Why a spawned worker's start failed, as far as its exit status tells."""
    code = p.exitcode
    assert code is not None
    head = f"tensor-parallel rank {rank} (pid {p.pid})"
    if code == REIMPORT_EXIT_CODE:
        return (
            f"{head} exited with status {code} before joining the group: it re-imported "
            f"the main script ({_main_script() or '__main__'}), whose top level creates a "
            "tensor-parallel engine again. Workers are started with the spawn method, which "
            "runs the main script's top level in every worker: put the code that builds "
            'the LLM under `if __name__ == "__main__":`'
        )
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the kernel's out-of-memory killer sends SIGKILL)" if -code == 9 else ""
        return f"{head} was killed by {name} before joining the group{why}"
    hint = ""
    if _main_script() is not None:
        hint = (
            "; if it failed while re-importing the main script (the spawn method runs its "
            'top level in every worker), guard that code with `if __name__ == "__main__":`'
        )
    return (
        f"{head} exited with status {code} before joining the group: its error, if it "
        f"printed one, is on stderr above (workers share this process's){hint}"
    )


def _main_script() -> str | None:
    """The main script's path when this process runs one (spawned workers import it)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path if isinstance(path, str) and path.endswith(".py") else None


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each step's plan, then runs the step like ``ModelRunner``.

    A forward that raises under TP fails the group (``EngineFatalError``): the other ranks may
    be waiting inside a collective of the same step, and no retry can line them up again.
    Sampling runs after the step's last collective, so its errors stay per-request.

    With asynchronous scheduling (``shares_picks``) the workers feed a step's pending inputs
    as rank 0 does, from the step before's picks, which rank 0 broadcasts over the device
    group once they are queued (a zero row per pick when sampling raised: the engine then
    re-runs the step's rows with their tokens known). ``lock`` is held from a step's launch
    to the end of its sampling, so the heartbeat never comes between the two.
    """

    def __init__(
        self, base: ModelRunner, group: TensorParallelGroup, *, shares_picks: bool = False
    ) -> None:
        super().__init__(_Guarded(base.model, group), base.storage, base.sampler, base.device)
        self.group = group
        self.shares_picks = shares_picks
        self._unsampled = False  # a step launched, its sampling not yet run: ``lock`` held

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        if self._unsampled:
            # The step before was never sampled (its caller raised in between): the workers
            # wait for its picks, and no later plan can line them up again.
            self.group.fail("a step was launched and never sampled")
            raise EngineFatalError("tensor-parallel group failed: a step was never sampled")
        self.group.lock.acquire()
        try:
            self.group.check()
            rows = previous.rows if previous is not None else {}
            plan = StepPlan.of(out, rows, self.shares_picks)
            try:
                self.group.send(plan)
            except Exception as exc:
                self.group.fail(f"sending the step plan failed: {exc}")
                raise EngineFatalError(f"tensor-parallel group failed: {exc}") from exc
            step = super().launch(out, previous)
        except BaseException:
            self.group.lock.release()
            raise
        step.shares_picks = plan.shares_picks
        self._unsampled = True
        return step

    def sample(self, step: LaunchedStep, *, copy_out: bool = False) -> None:
        try:
            super().sample(step, copy_out=copy_out)
        finally:
            try:
                if step.shares_picks:
                    self._share(step)
            finally:
                self._unsampled = False
                self.group.lock.release()

    def _share(self, step: LaunchedStep) -> None:
        picks = (
            step.picked.tokens
            if step.picked is not None
            else torch.zeros(len(step.batch.sampling), dtype=torch.int64, device=self.device)
        )
        try:
            dist.broadcast(picks.contiguous(), src=0, group=self.group.device_group)
        except Exception as exc:
            self.group.fail(f"sharing the step's picks failed: {exc}")
            raise EngineFatalError(f"tensor-parallel group failed: {exc}") from exc


class _Guarded:
    """The model forward, with any exception turned into a failure of the group."""

    def __init__(self, forward: Any, group: TensorParallelGroup) -> None:
        self.forward = forward
        self.group = group

    def __call__(self, *args: Any) -> torch.Tensor:
        try:
            return self.forward(*args)
        except Exception as exc:
            self.group.fail(f"a tensor-parallel forward failed: {type(exc).__name__}: {exc}")
            raise EngineFatalError(f"tensor-parallel group failed: {exc}") from exc
