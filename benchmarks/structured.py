"""What structured output costs the requests around it: a closed loop at concurrency 16 with one
request in four constrained by a JSON schema, against the same loop all unconstrained, and the
TTFT of a request whose schema the server has never seen.

    python -m benchmarks.structured                      # the embedded default model
    python -m benchmarks.structured --rounds 3 --num-requests 96
    python -m benchmarks.structured --device cuda --dtype bfloat16   # on a GPU

One server (``python -m server`` on 127.0.0.1 with ``--device`` and ``--dtype``, float32 on the
CPU by default; ``--server-args`` adds flags) serves every run, after a warm-up of one full
batch. Each round runs the two workloads back to back, alternating which goes first, so a
machine whose speed drifts treats both alike:

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

Last, in this process and without the server, the grammar's own cost (``grammar_cost``):
the offline engine runs the same batch (``--concurrency`` requests, a quarter constrained) with
the sampler masking every constrained row first and checking picks first (engine/structured.py
has the two modes; the CPU's default is checking), interleaved, and reports the engine
thread's CPU time in the grammar hooks per step, the step time, and whether the greedy outputs
of the two modes are identical; then what xgrammar's mask fill costs one row by grammar state
over a sample output. That is the per-step price the constrained rows put on every row of
the step, measured so that other load on the machine moves it little.
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
        "--device", args.device, "--dtype", args.dtype, "--max-model-len", "1024",
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
        # Warm-up: the schema compiled and cached, every code path run once at the full
        # batch, so neither workload's first run pays for first times.
        asyncio.run(_closed_loop(url, "warm-up", mixed[: args.concurrency], args.concurrency))
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
    print("the grammar's cost per step, offline ...", flush=True)
    summary.update(grammar_cost(args))
    return summary


SAMPLE_OUTPUT = (
    '{"title": "The Godfather", "year": 1972, "tags": ["crime", "drama", "mafia", "family", '
    '"classic", "italian", "new york", "corleone", "power", "loyalty", "betrayal", "revenge"]}'
)
FEW_TOKENS = 100  # a grammar state allowing at most this many tokens: structure, keys, digits


class _TimedConstraint:
    """The engine's StructuredDecoder as the sampler sees it, with the engine thread's CPU
    time in its hooks, and in the engine's ``accept`` (matchers advanced over the
    step's tokens), summed into ``cpu_ns``."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.cpu_ns = 0

    @property
    def num_constrained(self) -> int:
        return int(self.decoder.num_constrained)

    def _timed(self, method: Any, *args: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return method(*args)
        finally:
            self.cpu_ns += time.thread_time_ns() - start

    def mask_before_sampling(self, logits: Any, requests: Any) -> Any:
        return self._timed(self.decoder.mask_before_sampling, logits, requests)

    def refused_rows(self, token_ids: Any, requests: Any) -> Any:
        return self._timed(self.decoder.refused_rows, token_ids, requests)

    def first_allowed(self, candidates: Any, requests: Any, rows: Any) -> Any:
        return self._timed(self.decoder.first_allowed, candidates, requests, rows)

    def mask_rows(self, logits: Any, requests: Any, rows: Any) -> Any:
        return self._timed(self.decoder.mask_rows, logits, requests, rows)


def grammar_cost(args: argparse.Namespace) -> dict[str, Any]:
    """What the constrained rows cost the engine thread, without the server: the offline
    engine runs the workload's batch (``--concurrency`` requests, one in four constrained by
    the workload schema, greedy, ``--max-tokens`` each) twice per mode, interleaved, the
    grammar work timed as the engine thread's CPU time (fills serial, so that thread does all
    of it; a busy machine slows it less than wall time). On CUDA compare the step times
    instead: there the check's read of the picks waits for the GPU's forward pass, and that
    wait counts as CPU time. Then one matcher walked through SAMPLE_OUTPUT:
    ``fill_next_token_bitmask``'s CPU time by grammar state."""
    import xgrammar as xgr

    from engine import LLM, SamplingParams
    from scheduler.request import StructuredOutputParams

    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, max_model_len=1024,
        max_num_seqs=args.concurrency,
    )  # fmt: skip
    engine = llm.engine
    decoder = engine.structured
    decoder._fill_threads = 1
    timed = _TimedConstraint(decoder)
    engine.sampler.constraint = timed
    accept = decoder.accept
    decoder.accept = lambda request_ids, token_ids: timed._timed(accept, request_ids, token_ids)
    tokenizer = engine.tokenizer
    spec = StructuredOutputParams("json", json.dumps(workload_schema()))
    prompts = [
        tokenizer.apply_chat_template(_body(i, 1, None)["messages"], add_generation_prompt=True,
                                      tokenize=False)
        for i in range(args.concurrency)
    ]  # fmt: skip
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    def one_batch(
        tag: str, check_first: bool, constrained: bool = True
    ) -> tuple[list[tuple[float, float]], dict[int, list[int]]]:
        decoder.check_first = check_first
        for i, ids in enumerate(prompt_ids):
            params = SamplingParams(
                max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                structured=spec if constrained and i % 4 == 3 else None,
            )  # fmt: skip
            engine.add_request(f"{tag}-{i}", ids, params)
        steps: list[tuple[float, float]] = []
        tokens: dict[int, list[int]] = {}
        while engine.has_unfinished_requests():
            timed.cpu_ns = 0
            start = time.perf_counter()
            for out in engine.step():
                tokens.setdefault(int(out.request_id.rsplit("-", 1)[1]), []).extend(
                    out.new_token_ids
                )
            steps.append((timed.cpu_ns / 1e3, 1e3 * (time.perf_counter() - start)))
        return steps, tokens

    one_batch("warm-up", True)
    # name -> (check_first, constrained)
    modes = {
        "mask first": (False, True),
        "check first": (True, True),
        "none constrained": (True, False),
    }
    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    outputs: dict[str, dict[int, list[int]]] = {}
    for round_ in range(2):
        order = list(modes) if round_ == 0 else list(modes)[::-1]
        for name in order:
            batch_steps, outputs[name] = one_batch(f"{name}{round_}", *modes[name])
            steps[name] += batch_steps
    result: dict[str, Any] = {
        "grammar_outputs_identical": outputs["mask first"] == outputs["check first"],
        "grammar_check_first_default": engine.device.type == "cpu",
    }
    for name, values in steps.items():
        key = name.replace(" ", "_")
        result[f"grammar_{key}_us_mean"] = statistics.fmean(v[0] for v in values)
        result[f"grammar_{key}_us_p50"] = statistics.median(v[0] for v in values)
        result[f"grammar_{key}_us_max"] = max(v[0] for v in values)
        result[f"grammar_{key}_step_ms_p50"] = statistics.median(v[1] for v in values)

    # One matcher through a whole output: the fill's cost by grammar state.
    entry = engine.grammars.compile(spec)[0].result()
    matcher = xgr.GrammarMatcher(entry.grammar)
    bitmask = xgr.allocate_token_bitmask(1, engine.grammars.vocab_size)
    few, many = [], []
    for token_id in tokenizer.encode(SAMPLE_OUTPUT, add_special_tokens=False):
        start = time.thread_time_ns()
        matcher.fill_next_token_bitmask(bitmask, 0)
        cost_us = (time.thread_time_ns() - start) / 1e3
        allowed = int(sum(bin(word & 0xFFFFFFFF).count("1") for word in bitmask[0].tolist()))
        (few if allowed <= FEW_TOKENS else many).append(cost_us)
        assert matcher.accept_token(token_id)
    for label, values in (("few", few), ("many", many)):
        result[f"fill_{label}_n"] = len(values)
        result[f"fill_{label}_us_mean"] = statistics.fmean(values) if values else 0.0
        result[f"fill_{label}_us_max"] = max(values, default=0.0)
    engine.grammars.shutdown()
    return result


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
    print()
    print(
        f"grammar work per step on the engine thread (CPU time: hooks + matchers advanced; "
        f"fills serial), offline: "
        f"{args.concurrency} rows, a quarter constrained, {args.max_tokens} tokens, "
        f"{args.device} {args.dtype}"
    )
    print(f"| {'mode':36} | {'mean us':>8} | {'p50 us':>7} | {'max us':>7} | {'step p50 ms':>11} |")
    print(f"|{'-' * 38}|{'-' * 9}:|{'-' * 8}:|{'-' * 8}:|{'-' * 12}:|")
    default = "check first" if s["grammar_check_first_default"] else "mask first"
    for name in ("mask first", "check first", "none constrained"):
        key = name.replace(" ", "_")
        label = name + (" (this device's default)" if name == default else "")
        print(
            f"| {label:36} | {s[f'grammar_{key}_us_mean']:8.0f} | "
            f"{s[f'grammar_{key}_us_p50']:7.0f} | {s[f'grammar_{key}_us_max']:7.0f} | "
            f"{s[f'grammar_{key}_step_ms_p50']:11.1f} |"
        )
    print(
        "greedy outputs of the two modes identical: "
        f"{'yes' if s['grammar_outputs_identical'] else 'NO'}"
    )
    print(
        f"one row's mask fill over a {len(SAMPLE_OUTPUT)}-char output, by grammar state: "
        f"<= {FEW_TOKENS} tokens allowed (structure, keys, digits) {s['fill_few_n']} fills, "
        f"{s['fill_few_us_mean']:.0f} us mean ({s['fill_few_us_max']:.0f} max); inside string "
        f"values {s['fill_many_n']} fills, {s['fill_many_us_mean']:.0f} us mean "
        f"({s['fill_many_us_max']:.0f} max)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__)
    parser.add_argument("--model", default="default", help="the server's --model")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-samples", type=int, default=5)
    parser.add_argument("--startup-timeout-s", type=float, default=300)
    parser.add_argument("--device", default="cpu", help="the server's and offline engine's")
    parser.add_argument("--dtype", default="float32", help="the server's and offline engine's")
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
