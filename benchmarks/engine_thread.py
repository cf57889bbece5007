"""``python -m benchmarks.engine_thread``: what the engine *thread* costs the HTTP event loop,
and what an
engine *process* would cost instead. The figures back the choice in engine_client.py.

Three measurements on the same requests (greedy, ``--num-requests`` at once):

1. ``alone``: the engine stepped by a plain loop on the main thread, outputs detokenized
   inline: the throughput with no asyncio and no second thread.
2. ``thread``: the same through ``AsyncEngineClient`` while the event loop detokenizes every
   stream (the server's per-token work) and a probe task measures event-loop lag (how late a
   1 ms sleep wakes up): what HTTP handling would feel while the engine steps.
3. ``ipc``: the round trip of one step's ``RequestOutput`` list through a
   ``multiprocessing`` pipe to another process and back, i.e. the per-step cost a process
   split adds on top of ``alone`` (before any GIL relief it buys).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from engine.outputs import RequestOutput
from loadtest.stats import percentile  # the load generator's definition, one for both
from scheduler.request import SamplingParams
from server.detokenizer import IncrementalDetokenizer
from server.engine_client import AsyncEngineClient
from server.engine_types import EngineRequest


def _prompts(tokenizer: Any, num: int) -> list[list[int]]:
    base = "The history of science shows that careful measurement matters because"
    return [tokenizer.encode(f"{base} ({i})") for i in range(num)]


def run_alone(engine: Any, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    detoks = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"alone-{i}", ids, params)
        detoks[f"alone-{i}"] = IncrementalDetokenizer(engine.tokenizer, ids)
    start, tokens, steps = time.perf_counter(), 0, 0
    sample: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        for out in outputs:
            detoks[out.request_id].add(out.new_token_ids)
            tokens += len(out.new_token_ids)
        if len(outputs) > len(sample):
            sample = outputs
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens / wall, "step_ms": 1000 * wall / steps, "sample": sample}


async def run_threaded(
    engine: Any, prompts: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    client = AsyncEngineClient(engine)
    client.start()
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    async def consume(i: int, ids: list[int]) -> int:
        stream = await client.add([EngineRequest(f"thread-{i}", ids, params)])
        detok, n = IncrementalDetokenizer(engine.tokenizer, ids), 0
        while batch := await stream.get():
            for out in batch:
                detok.add(out.new_token_ids)
                n += len(out.new_token_ids)
        return n

    probe_task = asyncio.create_task(probe())
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*[consume(i, p) for i, p in enumerate(prompts)]))
    wall = time.perf_counter() - start
    done.set()
    await probe_task
    steps = client.snapshot.num_steps
    await client.shutdown()
    return {
        "tokens_per_s": tokens / wall,
        "step_ms": 1000 * wall / max(steps, 1),
        "lag_p50_ms": 1000 * percentile(lags, 50),
        "lag_p99_ms": 1000 * percentile(lags, 99),
        "lag_max_ms": 1000 * max(lags),
    }


def _echo(conn: Connection) -> None:
    while (msg := conn.recv()) is not None:
        conn.send(msg)


def ipc_round_trip_ms(sample: list[RequestOutput], repeats: int = 200) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_echo, args=(child,), daemon=True)
    worker.start()
    parent.send(sample)
    parent.recv()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        parent.send(sample)
        parent.recv()
    elapsed = time.perf_counter() - start
    parent.send(None)
    worker.join(5)
    return 1000 * elapsed / repeats


def main(argv: list[str] | None = None) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kvpool.config import KVPoolConfig
    from scheduler.config import SchedulerConfig

    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_thread", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device), KVPoolConfig(),
                       SchedulerConfig(max_num_seqs=args.num_requests))  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompts = _prompts(engine.tokenizer, args.num_requests)
    run_alone(engine, prompts[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    alone = run_alone(engine, prompts, params)
    threaded = asyncio.run(run_threaded(engine, prompts, params))
    ipc = ipc_round_trip_ms(alone["sample"])
    print(f"requests={args.num_requests} max_tokens={args.max_tokens} device={engine.device}")
    print(f"alone:  {alone['tokens_per_s']:8.1f} tokens/s, {alone['step_ms']:.2f} ms/step")
    print(f"thread: {threaded['tokens_per_s']:8.1f} tokens/s, {threaded['step_ms']:.2f} ms/step; "
          f"event-loop lag p50 {threaded['lag_p50_ms']:.2f} ms, p99 {threaded['lag_p99_ms']:.2f}"
          f" ms, max {threaded['lag_max_ms']:.2f} ms")  # fmt: skip
    print(f"ipc:    {ipc:.3f} ms round trip per step ({len(alone['sample'])} outputs)")


if __name__ == "__main__":
    main()
