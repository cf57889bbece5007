"""Starting the ranks of a tensor-parallel group, and the worker ranks' loop.

Rank 0 (the server, or the offline ``LLM``) resolves the model (a GGUF is converted once) and
builds the C++ kernels, then spawns the host's other ranks (``torch.multiprocessing``, spawn)
before it loads the model; each runs ``worker_main``: it joins the group, builds the same
engine parts (``engine/builder.py``: the same checkpoint, sharded to its rank) and loops in
``run_worker``, following rank 0's step plans (engine/tp_group.py). Over several hosts,
every other host runs ``pagedserve serve`` with its ``--node-rank``, which spawns that
host's ranks and waits for them (``serve_worker_node``); under torchrun, every process is one
rank and ranks other than 0 call ``run_worker`` directly.

A spawned worker watches its parent process and exits when it is gone. Workers ignore SIGINT
and SIGTERM: they stop when rank 0 stops (a STOP plan at exit, or its death), so a SIGTERM to
the server drains it and then stops every rank.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.builder import build_engine_parts
from engine.config import EngineConfig, ModelConfig
from engine.loader import read_hf_config, resolve_model
from engine.model_runner import feed_pending
from engine.presets import preset
from engine.tp_group import (
    HEARTBEAT,
    REIMPORT_EXIT_CODE,
    STOP,
    Rendezvous,
    StepPlan,
    TensorParallelGroup,
)
from engine.tp_layout import check_shardable
from kernels import cpu as cpu_kernels
from kvpool.config import KVPoolConfig
from scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)


def torchrun_rendezvous() -> Rendezvous | None:
    """This process's place in a group launched by torchrun (its environment), if any."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return Rendezvous(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        world_size=int(os.environ["WORLD_SIZE"]),
        init_method="env://",
    )


def backend_for(config: EngineConfig) -> str:
    return "nccl" if config.resolved_device().startswith("cuda") else "gloo"


def launch(
    config: EngineConfig,
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
    *,
    exit_on_failure: bool,
) -> TensorParallelGroup:
    """Rank 0 (node 0): serve the rendezvous store, spawn this host's other ranks, join the
    group (failing fast when a worker dies first: engine/tp_group.py), start the watchdog.

    On the CPU the host's threads are split between its ranks (torch's count divided by
    the ranks on the host), so N ranks on N cores do not oversubscribe them."""
    refuse_in_spawn_bootstrap()
    config.check_device()  # GPUs for every local rank, before any rank starts
    world = config.tensor_parallel_size
    # Once, here, before any other rank starts: converting a GGUF and compiling the C++
    # kernels (every rank then finds them cached).
    shape = preset(config.model) if config.load_format == "dummy" else None
    hf = shape if shape is not None else read_hf_config(resolve_model(config.model).path)
    check_shardable(ModelConfig.from_hf(hf))  # before any rank starts: one line, no ranks
    if backend_for(config) == "gloo":
        cpu_kernels.load()
    rendezvous = torchrun_rendezvous()
    backend = backend_for(config)
    if rendezvous is not None:
        if rendezvous.world_size != world or rendezvous.rank != 0:
            raise ValueError(
                f"torchrun started {rendezvous.world_size} ranks (this is rank "
                f"{rendezvous.rank}); --tensor-parallel-size is {world}"
            )
        group = TensorParallelGroup(rendezvous, backend, exit_on_failure=exit_on_failure)
    else:
        local = world // config.nnodes
        rendezvous = Rendezvous(0, 0, world, f"tcp://{config.master_addr}:{config.master_port}")
        group = TensorParallelGroup(rendezvous, backend, exit_on_failure=exit_on_failure)
        init = group.listen()  # before any worker starts: they connect to it
        threads = 0
        if backend == "gloo":
            threads = max(1, torch.get_num_threads() // local)
            torch.set_num_threads(threads)
        try:
            group.processes = spawn_local_ranks(
                config, kv_config, scheduler_config, node_rank=0, init_method=init,
                threads=threads,
            )  # fmt: skip
        except BaseException as exc:
            group.abort(f"spawning the tensor-parallel workers failed: {exc}")
            raise
        logger.info(
            "tensor parallel: %d ranks (%d on this host), %s, rendezvous %s%s",
            world,
            local,
            backend,
            init,
            f", {threads} CPU threads per rank" if threads else "",
        )
    group.join()  # on failure: every worker stopped and reaped, the store closed
    atexit.register(group.shutdown)
    group.start_watchdog()
    return group


def refuse_in_spawn_bootstrap() -> None:
    """A spawned process that is still importing the main script (spawn runs its top level
    again) must not start a group of its own: it exits with ``REIMPORT_EXIT_CODE``, which
    rank 0 turns into the ``if __name__ == "__main__":`` hint (engine/tp_group.py)."""
    # multiprocessing's spawn sets ``_inheriting`` while it prepares the child, which is
    # when it runs the main script (``parent_process()`` is not known yet then).
    if not getattr(mp.current_process(), "_inheriting", False):
        return
    sys.stderr.write(
        "pagedserve: a tensor-parallel engine was created while this spawned process was "
        "re-importing the main script; exiting. Put the code that builds it under "
        '`if __name__ == "__main__":`\n'
    )
    sys.stderr.flush()
    raise SystemExit(REIMPORT_EXIT_CODE)


def spawn_local_ranks(
    config: EngineConfig,
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
    *,
    node_rank: int,
    init_method: str,
    threads: int,
) -> list[BaseProcess]:
    """Start this host's ranks other than rank 0 (all of them on a node other than 0)."""
    local = config.tensor_parallel_size // config.nnodes
    ctx = mp.get_context("spawn")
    processes = []
    for local_rank in range(1 if node_rank == 0 else 0, local):
        rank = node_rank * local + local_rank
        rendezvous = Rendezvous(rank, local_rank, config.tensor_parallel_size, init_method)
        p = ctx.Process(
            target=worker_main,
            args=(
                rendezvous,
                config,
                kv_config,
                scheduler_config,
                threads,
                logging.getLogger().getEffectiveLevel(),
            ),  # fmt: skip
            name=f"pagedserve-tp-rank{rank}",
            daemon=True,
        )
        p.start()
        processes.append(p)
    return processes


def worker_main(
    rendezvous: Rendezvous,
    config: EngineConfig,
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
    threads: int,
    log_level: int,
) -> None:
    """A spawned rank's process: follow rank 0 until it stops (module docstring)."""
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s rank{rendezvous.rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:

        def orphaned() -> None:
            parent.join()
            os._exit(1)

        threading.Thread(target=orphaned, name="pagedserve-tp-parent", daemon=True).start()
    if threads:
        torch.set_num_threads(threads)
    raise SystemExit(run_worker(rendezvous, config, kv_config, scheduler_config))


def run_worker(
    rendezvous: Rendezvous,
    config: EngineConfig,
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
) -> int:
    """Join the group, build this rank's engine parts, run every step rank 0 plans; 0 when
    rank 0 stopped the group, 1 when the group broke."""
    group = TensorParallelGroup(rendezvous, backend_for(config))
    group.join()
    parts = build_engine_parts(config, kv_config, scheduler_config, tp=group)
    runner = parts.runner
    storage = runner.storage
    # Asynchronous scheduling: the step before's picks, shared by rank 0 after its forward
    # pass, feed this step's pending inputs (``StepPlan.shares_picks``).
    picks: torch.Tensor | None = None
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group.plan_group)
        except Exception as exc:  # noqa: BLE001 - rank 0 gone or timed out
            logger.error("rank %d: lost rank 0 (%s); exiting", group.rank, exc)
            return 1
        message = box[0]
        if message == HEARTBEAT:
            continue
        if message == STOP:
            group.closed = True
            dist.destroy_process_group()
            return 0
        assert isinstance(message, StepPlan)
        out = message.to_output()
        if out.blocks_to_copy:
            src_ids, dst_ids = zip(*out.blocks_to_copy, strict=True)
            storage.copy_blocks(src_ids, dst_ids)
        batch = runner.prepare(out)
        try:
            if batch.pending:
                if picks is None:
                    raise RuntimeError("a pending input token without the picks before it")
                feed_pending(batch, picks, {f"pick-{i}": i for i in range(picks.shape[0])})
            runner.model(batch, storage.key_caches, storage.value_caches)
            if message.shares_picks:
                picks = torch.empty(message.num_sampling_rows, dtype=torch.int64,
                                    device=runner.device)  # fmt: skip
                dist.broadcast(picks, src=0, group=group.device_group)
        except Exception as exc:  # noqa: BLE001 - the group is broken
            logger.error("rank %d: forward failed (%s); exiting", group.rank, exc)
            return 1


def serve_worker_node(
    config: EngineConfig, kv_config: KVPoolConfig, scheduler_config: SchedulerConfig
) -> int:
    """A host other than node 0 of a multi-node group: spawn its ranks and wait for them.
    Returns the worst exit status among them; SIGTERM or SIGINT kills them."""
    init = f"tcp://{config.master_addr}:{config.master_port}"
    threads = max(1, torch.get_num_threads() // (config.tensor_parallel_size // config.nnodes))
    processes = spawn_local_ranks(
        config, kv_config, scheduler_config, node_rank=config.node_rank, init_method=init,
        threads=threads if backend_for(config) == "gloo" else 0,
    )  # fmt: skip
    logger.info(
        "node %d of %d: %d tensor-parallel ranks following rank 0 at %s",
        config.node_rank,
        config.nnodes,
        len(processes),
        init,
    )

    def stop(signum: int, _frame: Any) -> None:
        for p in processes:
            p.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sentinels = {p.sentinel: p for p in processes}
    status = 0
    while sentinels:
        for sentinel in multiprocessing.connection.wait(list(sentinels)):
            p = sentinels.pop(sentinel)  # type: ignore[call-overload]
            p.join()  # reaped, so its exit code is known
            status = max(status, 0 if p.exitcode == 0 else 1)
            if p.exitcode != 0:
                stop(signal.SIGTERM, None)
    return status
