"""What the tuning tables' readers share (``kernels/matmul_tuning.py``,
``kernels/attention_tuning.py``): a JSON file named by an environment variable, read once
per path, whose every problem is a ValueError naming the variable, the file and what is
wrong. Imports no triton (the server checks the files before anything runs)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

__all__ = [
    "FORMAT",
    "TuningTable",
    "check_keys",
    "check_whole",
    "named_table",
    "read_table",
    "table_entries",
]

# The tables' format (both kinds): {"format": 1, "device": ..., "source": ..., "entries": [...]}.
FORMAT = 1

Table = TypeVar("Table")


class TuningTable(Protocol):
    """What a loaded table of either kind says of itself (the builder logs it)."""

    @property
    def source(self) -> str:
        """The file it was read from."""

    @property
    def device(self) -> str:
        """The device the file says it was swept on."""

    def __len__(self) -> int:
        """Its entries."""


def check_keys(
    what: str, mapping: Mapping[str, Any], required: Iterable[str], allowed: Iterable[str]
) -> None:
    """A ValueError saying which of ``required`` ``mapping`` lacks and which of its keys are
    not ``allowed``."""
    missing = [name for name in required if name not in mapping]
    unknown = sorted(set(mapping) - set(allowed))
    problems = ([f"needs {missing}"] if missing else []) + (
        [f"takes no {unknown}"] if unknown else []
    )
    if problems:
        raise ValueError(f"{what} {' and '.join(problems)}")


def check_whole(name: str, value: Any, least: int = 1) -> None:
    """A ValueError unless ``value`` is an int (not a bool) of at least ``least``."""
    if type(value) is not int or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")


def read_table(path: str, env: str, parse: Callable[[Any, str], Table]) -> Table:
    """``parse(decoded JSON, path)`` of the file at ``path``; a ValueError (the file cannot
    be read, is not JSON, or ``parse`` refuses it) starts with ``env=path``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return parse(data, path)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{env}={path}: {e}") from None


def named_table(
    env: str, load: Callable[[str], Table], environ: Mapping[str, str] | None
) -> Table | None:
    """``load`` of the file ``env`` names in ``environ`` (default: the process's), None
    where it is unset or empty."""
    path = (os.environ if environ is None else environ).get(env, "")
    return load(path) if path else None


def table_entries(data: Any, kind: str) -> list[Any]:
    """The ``entries`` of a decoded table of ``FORMAT``; a ValueError where ``data`` is not
    one (``kind``: what the table is, for the message)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a {kind} tuning table of format {FORMAT}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError("entries must be a list")
    return entries
