"""Tensor parallelism on this machine: offline throughput at TP=1 and TP=N, and what one
all-reduce of a decode step's hidden state costs between N gloo ranks.

    python -m benchmarks.tensor_parallel                  # default model, TP=1 vs TP=2
    python -m benchmarks.tensor_parallel --requests 16 --output-tokens 32
    python -m benchmarks.tensor_parallel --device cuda    # N GPUs, NCCL

Both runs serve the same requests (seeded prompts, greedy, EOS ignored), all submitted at
once; then one request alone (batch-1 decode). On the CPU, TP=1 runs the CPU fast path (the
fused C++ stack); TP=N runs each rank's shard on the model's own layers (engine/tensor_parallel.py
says why) with the host's threads split between the ranks. The all-reduce probe times
``[rows, hidden]`` all-reduces between N spawned ranks (gloo on the CPU in float32, NCCL on
CUDA in the run's dtype, rank r on GPU r), the collective a TP decode step runs twice per
layer. ``--device`` and ``--dtype`` default to the engine's choice (CUDA when one is visible;
float32 on the CPU, bfloat16 on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.offline import corpus_ids, make_workload
from engine.llm import LLM
from scheduler.request import SamplingParams


def run(llm: LLM, work: list[tuple[list[int], int]]) -> dict[str, float]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:2]], params[:2])  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    batch_s = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    prompt, n = work[0]
    start = time.perf_counter()
    (alone,) = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    alone_s = time.perf_counter() - start
    return {
        "batch_tokens_per_s": tokens / batch_s,
        "alone_tokens_per_s": len(alone.token_ids) / alone_s,
    }


def _allreduce_rank(
    rank: int, world: int, port: int, rows: int, hidden: int, cuda_dtype: str | None, q: object
) -> None:
    """One rank of the probe: gloo on the CPU (``cuda_dtype`` None), else NCCL on GPU
    ``rank`` in that dtype."""
    torch.set_num_threads(1)
    if cuda_dtype is not None:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "gloo" if cuda_dtype is None else "nccl", init_method=f"tcp://127.0.0.1:{port}",
        rank=rank, world_size=world, timeout=timedelta(seconds=60),
    )  # fmt: skip
    if cuda_dtype is None:
        x = torch.randn(rows, hidden)
    else:
        x = torch.randn(rows, hidden, device=f"cuda:{rank}", dtype=getattr(torch, cuda_dtype))
    sync = torch.cuda.synchronize if cuda_dtype is not None else (lambda: None)
    for _ in range(50):
        dist.all_reduce(x)
    sync()
    n = 500
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    sync()  # NCCL calls return once queued: time until the last one is done
    if rank == 0:
        q.put((time.perf_counter() - start) / n)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def allreduce_us(world: int, rows: int, hidden: int, cuda_dtype: str | None = None) -> float:
    """Mean microseconds of one all-reduce of ``[rows, hidden]`` over ``world`` ranks on this
    host: gloo in float32, or with ``cuda_dtype`` NCCL over ``world`` GPUs in that dtype."""
    from loadtest.launcher import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, world, port, rows, hidden, cuda_dtype, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    seconds = q.get(timeout=300)
    for p in procs:
        p.join()
    return seconds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when visible)")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    args = ap.parse_args()
    results: dict[str, object] = {"load_average_before": os.getloadavg()}
    common = dict(
        num_kv_blocks=256, max_model_len=512, max_num_seqs=args.requests, device=args.device,
        dtype=args.dtype,
    )  # fmt: skip
    hidden = 0
    cuda_dtype: str | None = None
    for tp in (1, args.tensor_parallel_size):
        llm = LLM(args.model, tensor_parallel_size=tp, **common)  # type: ignore[arg-type]
        work = make_workload(
            args.requests,
            corpus_ids(llm.tokenizer),
            args.seed,
            (32, 96),
            (args.output_tokens, args.output_tokens),
        )
        results[f"tp{tp}"] = run(llm, work)
        results[f"tp{tp}_threads"] = torch.get_num_threads()
        hidden = llm.engine.model_config.hidden_size
        if llm.engine.device.type == "cuda":
            cuda_dtype = str(llm.engine.dtype).removeprefix("torch.")
        results["device"] = str(llm.engine.device)
        llm.shutdown()
        print(json.dumps({f"tp{tp}": results[f"tp{tp}"]}), flush=True)
    for rows in (1, args.requests):
        results[f"allreduce_us_rows{rows}"] = allreduce_us(
            args.tensor_parallel_size, rows, hidden, cuda_dtype
        )
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
