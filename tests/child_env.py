"""The environment of a child Python process a test starts, with the repository importable.

The repository goes ahead of the parent's ``PYTHONPATH``, which the child keeps: where
packages come from a ``PYTHONPATH`` directory (wheels installed with ``pip install --target``,
as on a GPU machine without a package index), a child given the repository alone would miss
them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def with_repo_on_path(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's) with the repository first on ``PYTHONPATH``, and
    ``extra`` set."""
    base = dict(os.environ if env is None else env)
    paths = [str(ROOT)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**base, "PYTHONPATH": os.pathsep.join(paths), **extra}
