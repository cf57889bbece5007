"""Optional questions asked of a server before a sweep: its model, tokenizer and metrics.

Every probe degrades gracefully: a server without ``/tokenize`` or ``/metrics`` (or one that
answers them differently) is still measurable; the probe returns ``None`` and the result file
says what was assumed instead.
"""

from __future__ import annotations

import math
import random
from typing import Any

import httpx

from loadtest.workloads import make_prompt

# Two prompt sizes: the slope between them cancels a constant offset such as a BOS token.
_CALIBRATION_WORDS = (100, 300)


async def discover_model(http: httpx.AsyncClient) -> str:
    """The first model id of ``GET /v1/models`` (what a server with one model serves)."""
    response = await http.get("/v1/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data or "id" not in data[0]:
        raise RuntimeError("GET /v1/models listed no model; pass --model")
    return str(data[0]["id"])


async def _count_tokens(http: httpx.AsyncClient, model: str, text: str) -> int | None:
    """Token count of ``text`` via ``POST /tokenize``, in vLLM's or llama.cpp's dialect."""
    bodies: list[dict[str, Any]] = [
        {"model": model, "prompt": text},  # vLLM / pagedserve: {"count", "tokens", ...}
        {"content": text},  # llama.cpp server: {"tokens": [...]}
    ]
    for body in bodies:
        try:
            response = await http.post("/tokenize", json=body)
        except httpx.HTTPError:
            return None
        if response.status_code == 404:
            return None  # no such endpoint: the other dialect will not help either
        if response.status_code != 200:
            continue
        try:
            obj = response.json()
        except ValueError:
            continue
        if isinstance(obj.get("count"), int):
            return int(obj["count"])
        if isinstance(obj.get("tokens"), list):
            return len(obj["tokens"])
    return None


async def tokens_per_word(http: httpx.AsyncClient, model: str, seed: int) -> float | None:
    """Tokens per vocabulary word measured with the server's tokenizer, or None.

    Returns None when the server has no usable ``/tokenize`` or the answer is implausible
    (outside 0.2..5 tokens per word), in which case callers assume 1.0.
    """
    rng = random.Random(f"{seed}:calibration")
    counts: list[int] = []
    for num_words in _CALIBRATION_WORDS:
        count = await _count_tokens(http, model, make_prompt(num_words, rng))
        if count is None:
            return None
        counts.append(count)
    ratio = (counts[1] - counts[0]) / (_CALIBRATION_WORDS[1] - _CALIBRATION_WORDS[0])
    return ratio if 0.2 <= ratio <= 5.0 else None


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition as ``{"name{labels}": value}``.

    Comments, malformed lines and non-finite values (which JSON cannot hold) are dropped.
    """
    samples: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        # Label values may contain spaces, so split after the closing brace, not on spaces.
        close = line.rfind("}")
        if close >= 0:
            key, rest = line[: close + 1], line[close + 1 :].split()
        else:
            parts = line.split()
            key, rest = parts[0], parts[1:]
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value):
            samples[key] = value
    return samples


async def scrape_metrics(http: httpx.AsyncClient) -> dict[str, float] | None:
    """``GET /metrics`` parsed, or None when the server exposes none."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    samples = parse_prometheus_text(response.text)
    return samples or None
