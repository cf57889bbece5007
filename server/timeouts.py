"""Per-request deadlines: ``--request-timeout`` and the ``X-Request-Timeout`` header.

A deadline runs from the request's arrival (so time spent waiting in the queue counts, as a
client measures it). The effective timeout is the smaller of the server's and the header's:
a client may ask for less time than the server allows, never more. When it passes,
``GenerationRun`` aborts the request's engine requests (their blocks are freed within one
step) and the client gets a 504 ``request_timeout`` error, or, on a stream that already
started, that error as an in-band event followed by ``[DONE]``. Partial output is not
returned as a normal completion: a ``length`` finish would read as "max_tokens reached".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from server.errors import invalid

TIMEOUT_HEADER = "X-Request-Timeout"


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.monotonic() when the request expires
    timeout_s: float  # the effective timeout, for the error message


def request_deadline(
    headers: Mapping[str, str], server_timeout_s: float | None, arrival_time: float
) -> Deadline | None:
    """The request's deadline, or None when neither the server nor the client sets one.

    Raises:
        APIError: 400 when the header is not a positive number of seconds.
    """
    raw = headers.get(TIMEOUT_HEADER.lower())
    timeout_s = server_timeout_s
    if raw is not None:
        try:
            requested = float(raw)
        except ValueError:
            requested = math.nan
        if not (requested > 0 and math.isfinite(requested)):
            raise invalid(
                f"The {TIMEOUT_HEADER} header must be a positive number of seconds, got {raw!r}.",
                TIMEOUT_HEADER,
                "invalid_timeout",
            )
        timeout_s = requested if timeout_s is None else min(timeout_s, requested)
    if timeout_s is None:
        return None
    return Deadline(arrival_time + timeout_s, timeout_s)
