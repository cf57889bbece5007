"""Spawn targets for the tensor-parallel start tests: importable by module path, so a
spawned worker (which unpickles its target by name) runs them in place of
``engine.tp_launch.worker_main``. Nothing in the serving path imports this."""

from __future__ import annotations

import os
from typing import Any

from engine.tp_group import Rendezvous
from engine.tp_launch import worker_main

DYING_RANK = 2
DYING_STATUS = 5


def last_rank_dies_at_start(rendezvous: Rendezvous, *args: Any) -> None:
    """Rank ``DYING_RANK`` exits with ``DYING_STATUS`` before joining (as a worker that fails
    to import or to start would); every other rank is an ordinary worker."""
    if rendezvous.rank == DYING_RANK:
        os._exit(DYING_STATUS)
    worker_main(rendezvous, *args)
