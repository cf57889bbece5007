"""What structured output costs the requests around it: a closed loop at concurrency 16 with one
request in four constrained by a JSON schema, against the same loop all unconstrained, and the
TTFT of a request whose schema the server has never seen.

    python -m benchmarks.structured                      # the embedded default model
    python -m benchmarks.structured --rounds 3 --num-requests 96

One server (``python -m server`` on 127.0.0.1, float32 on the CPU unless ``--server-args`` says
otherwise) serves every run. Each round runs the two workloads back to back, alternating which
goes first, so a machine whose speed drifts treats both alike:

- *unconstrained*: ``--num-requests`` chat requests, greedy, ``ignore_eos``, ``--max-tokens``;
- *mixed*: the same, but every fourth request has ``response_format: json_schema`` with a
  schema long enough that it, too, runs to ``--max-tokens`` (the grammar's mask then allows
  no EOS before the end, so both workloads generate the same number of tokens).

Reported: output tokens/s of each run (tokens / wall time of the run), TPOT p50 of the
unconstrained requests in each (per request: (last token - first token) / (tokens - 1), from
the stream's chunk times), and on the idle server the median TTFT of requests with a fresh
schema (a new property name each, so the grammar cache misses and the compile is inside the
TTFT) against unconstrained requests of the same prompt. The ratios and the targets of
issue 41 close the table: throughput >= 0.9x, unconstrained TPOT p50 <= 1.1x, new-schema
TTFT <= 2x.

Last, in this process and without the server, the logits hook itself
(``StructuredDecoder.mask_logits``: fill the constrained rows' bitmasks, mask the logits) on
CPU logits of ``--concurrency`` rows with one in four constrained by the workload schema,
their matchers walked through a whole sample output, and with none constrained: the
per-step price the constrained rows add on the engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.launcher import HOST, ServerProcess, free_port

SCHEMA_ITEMS = 12  # strings in the workload schema's array: more tokens than --max-tokens


def workload_schema(salt: str = "") -> dict[str, Any]:
    """An object whose output is long: a title, then SCHEMA_ITEMS short strings."""
    return {
        "type": "object",
        "properties": {
            f"title{salt}": {"type": "string", "maxLength": 20},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 3, "maxLength": 10},
                "minItems": SCHEMA_ITEMS,
                "maxItems": SCHEMA_ITEMS,
            },
        },
        "required": [f"title{salt}", "year", "tags"],
    }


@dataclass(slots=True)
class Record:
    constrained: bool
    ttft_s: float
    tpot_s: float | None
    num_tokens: int


@dataclass(slots=True)
class RunResult:
    name: str
    seconds: float
    records: list[Record]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.num_tokens for r in self.records) / self.seconds

    def tpot_p50_ms(self, constrained: bool) -> float | None:
        values = [r.tpot_s for r in self.records if r.constrained == constrained and r.tpot_s]
        return 1000 * statistics.median(values) if values else None


def _body(i: int, max_tokens: int, schema: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Describe film number {i} as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "film", "schema": schema},
        }
    return body


async def _one(http: httpx.AsyncClient, body: dict[str, Any]) -> Record:
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk["choices"]):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    if first is None or last is None:
        raise RuntimeError("a stream without content")
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return Record("response_format" in body, first - start, tpot, num_tokens)


async def _closed_loop(
    url: str, name: str, bodies: list[dict[str, Any]], concurrency: int
) -> RunResult:
    queue = list(reversed(bodies))
    records: list[Record] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def worker() -> None:
            while queue:
                records.append(await _one(http, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return RunResult(name, time.perf_counter() - start, records)


async def _fresh_schema_ttft(url: str, samples: int, max_tokens: int) -> tuple[float, float]:
    """Median TTFT (s) of unconstrained and of fresh-schema requests on the idle server."""
    plain, fresh = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for i in range(samples):
            plain.append((await _one(http, _body(i, max_tokens, None))).ttft_s)
            salt = f"_{os.getpid()}_{time.monotonic_ns()}"
            fresh.append((await _one(http, _body(i, max_tokens, workload_schema(salt)))).ttft_s)
    return statistics.median(plain), statistics.median(fresh)


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    argv = [
        sys.executable, "-m", "server", "--host", HOST, "--port", str(port),
        "--max-num-seqs", str(args.concurrency), "--stats-log-interval", "0",
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
        "--model", args.model, *args.server_args.split(),
    ]  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="structured-bench-")) / "server.log"
    schema = workload_schema()
    unconstrained = [_body(i, args.max_tokens, None) for i in range(args.num_requests)]
    mixed = [
        _body(i, args.max_tokens, schema if i % 4 == 3 else None) for i in range(args.num_requests)
    ]
    with ServerProcess(argv, port, log) as server:
        server.wait_healthy(args.startup_timeout_s)
        url = server.base_url
        print(f"server on {url}, log {log}", flush=True)
        # Warm-up: the schema compiled and cached, every code path run once.
        asyncio.run(_closed_loop(url, "warm-up", mixed[: 2 * 4], 4))
        runs: list[RunResult] = []
        for round_ in range(args.rounds):
            order = [("unconstrained", unconstrained), ("mixed", mixed)]
            for name, bodies in order if round_ % 2 == 0 else order[::-1]:
                result = asyncio.run(_closed_loop(url, name, bodies, args.concurrency))
                runs.append(result)
                print(
                    f"round {round_ + 1} {name}: {result.tokens_per_s:.1f} tok/s, "
                    f"unconstrained TPOT p50 {result.tpot_p50_ms(False):.1f} ms",
                    flush=True,
                )
        ttft_plain, ttft_fresh = asyncio.run(
            _fresh_schema_ttft(url, args.ttft_samples, args.max_tokens)
        )
    summary = _summary(runs, ttft_plain, ttft_fresh)
    summary.update(mask_cost_us(args.model, args.concurrency))
    return summary


SAMPLE_OUTPUT = (
    '{"title": "The Godfather", "year": 1972, "tags": ["crime", "drama", "mafia", "family", '
    '"classic", "italian", "new york", "corleone", "power", "loyalty", "betrayal", "revenge"]}'
)


def mask_cost_us(model: str, num_rows: int) -> dict[str, float]:
    """Mean microseconds of one ``mask_logits`` call over a whole output: a quarter of
    ``num_rows`` rows constrained by the workload schema, their matchers advanced through
    SAMPLE_OUTPUT token by token (a mask's cost depends on the grammar state: inside a
    length-bounded string it is far above the first step's), and with no row constrained."""
    import torch

    from engine.config import ModelConfig
    from engine.loader import load_tokenizer, read_hf_config, resolve_model
    from engine.structured import GrammarCache, StructuredDecoder
    from scheduler.output import ScheduledRequest
    from scheduler.request import Request, SamplingParams, StructuredOutputParams

    path = resolve_model(model).path
    vocab_size = ModelConfig.from_hf(read_hf_config(path)).vocab_size
    tokenizer = load_tokenizer(path)
    cache = GrammarCache(tokenizer, vocab_size, [tokenizer.eos_token_id])
    spec = StructuredOutputParams("json", json.dumps(workload_schema()))
    requests = [
        ScheduledRequest(Request(f"r{i}", [1], SamplingParams()), 0, 1, [1], (0,), True)
        for i in range(num_rows)
    ]
    constrained_ids = [f"r{i}" for i in range(3, num_rows, 4)]
    decoder, plain = StructuredDecoder(cache), StructuredDecoder(cache)
    for request_id in constrained_ids:
        decoder.add(request_id, spec)
        while not decoder.ready(request_id):
            decoder.wait_any(1.0)
    logits = torch.randn(num_rows, vocab_size)
    token_ids = tokenizer.encode(SAMPLE_OUTPUT, add_special_tokens=False)
    masked, unmasked = [], []
    for token_id in token_ids:
        start = time.perf_counter()
        decoder.mask_logits(logits, requests)
        masked.append(time.perf_counter() - start)
        start = time.perf_counter()
        plain.mask_logits(logits, requests)
        unmasked.append(time.perf_counter() - start)
        decoder.accept(constrained_ids, [token_id] * len(constrained_ids))
    cache.shutdown()
    return {
        "mask_us_quarter_constrained": 1e6 * statistics.fmean(masked),
        "mask_us_quarter_constrained_max": 1e6 * max(masked),
        "mask_us_none": 1e6 * statistics.fmean(unmasked),
    }


def _summary(runs: list[RunResult], ttft_plain: float, ttft_fresh: float) -> dict[str, Any]:
    def mean(name: str, value: str) -> float:
        values = [getattr(r, value) if value == "tokens_per_s" else r.tpot_p50_ms(False)
                  for r in runs if r.name == name]  # fmt: skip
        return statistics.fmean(values)

    summary = {
        "unconstrained_tokens_per_s": mean("unconstrained", "tokens_per_s"),
        "mixed_tokens_per_s": mean("mixed", "tokens_per_s"),
        "unconstrained_tpot_p50_ms": mean("unconstrained", "tpot"),
        "mixed_unconstrained_tpot_p50_ms": mean("mixed", "tpot"),
        "mixed_constrained_tpot_p50_ms": statistics.fmean(
            [v for r in runs if r.name == "mixed" and (v := r.tpot_p50_ms(True)) is not None]
        ),
        "ttft_unconstrained_ms": 1000 * ttft_plain,
        "ttft_new_schema_ms": 1000 * ttft_fresh,
    }
    summary["throughput_ratio"] = (
        summary["mixed_tokens_per_s"] / summary["unconstrained_tokens_per_s"]
    )
    summary["tpot_p50_ratio"] = (
        summary["mixed_unconstrained_tpot_p50_ms"] / summary["unconstrained_tpot_p50_ms"]
    )
    summary["ttft_ratio"] = summary["ttft_new_schema_ms"] / summary["ttft_unconstrained_ms"]
    return summary


def print_table(s: dict[str, Any], args: argparse.Namespace) -> None:
    print()
    print(
        f"concurrency {args.concurrency}, {args.num_requests} requests per run, "
        f"{args.max_tokens} output tokens each, {args.rounds} round(s); mixed = 1 in 4 "
        "constrained by a JSON schema"
    )
    rows = [
        ("output tokens/s", s["unconstrained_tokens_per_s"], s["mixed_tokens_per_s"]),
        ("unconstrained TPOT p50 (ms)", s["unconstrained_tpot_p50_ms"],
         s["mixed_unconstrained_tpot_p50_ms"]),
        ("constrained TPOT p50 (ms)", None, s["mixed_constrained_tpot_p50_ms"]),
    ]  # fmt: skip
    print(f"| {'':30} | {'all unconstrained':>17} | {'mixed':>9} |")
    print(f"|{'-' * 32}|{'-' * 18}:|{'-' * 10}:|")
    for label, a, b in rows:
        left = f"{a:.1f}" if a is not None else "-"
        print(f"| {label:30} | {left:>17} | {b:>9.1f} |")
    print()
    checks = [
        ("throughput, mixed / unconstrained", s["throughput_ratio"], ">= 0.9",
         s["throughput_ratio"] >= 0.9),
        ("unconstrained TPOT p50, mixed / unconstrained", s["tpot_p50_ratio"], "<= 1.1",
         s["tpot_p50_ratio"] <= 1.1),
        (f"TTFT new schema / unconstrained ({s['ttft_new_schema_ms']:.0f} / "
         f"{s['ttft_unconstrained_ms']:.0f} ms, idle)", s["ttft_ratio"], "<= 2",
         s["ttft_ratio"] <= 2),
    ]  # fmt: skip
    for label, value, target, ok in checks:
        print(f"{label}: {value:.3f}  (target {target}: {'met' if ok else 'NOT met'})")
    print(
        f"logits hook per step, {args.concurrency} CPU rows, over a {len(SAMPLE_OUTPUT)}-char "
        f"output: {s['mask_us_quarter_constrained']:.0f} us mean "
        f"({s['mask_us_quarter_constrained_max']:.0f} max) with a quarter constrained, "
        f"{s['mask_us_none']:.2f} us with none"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__)
    parser.add_argument("--model", default="default", help="the server's --model")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ttft-samples", type=int, default=5)
    parser.add_argument("--startup-timeout-s", type=float, default=300)
    parser.add_argument("--server-args", default="", help="extra `python -m server` flags")
    parser.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = parser.parse_args(argv)
    if args.num_requests < 4 or args.concurrency < 1 or args.rounds < 1:
        parser.error("--num-requests must be >= 4, --concurrency and --rounds >= 1")
    summary = run(args)
    print_table(summary, args)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
