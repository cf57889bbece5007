"""GPU serving speed against its floors, in one run, on any model shape.

    python -m benchmarks.gpu --model llama-3-8b --load-format dummy
    python -m benchmarks.gpu --model llama-3-8b --load-format dummy --enforce-eager   # no graphs
    python -m benchmarks.gpu --model llama-3-8b --load-format dummy --quantization int8
    python -m benchmarks.gpu --model llama-3-8b --load-format dummy --async-scheduling off
    python -m benchmarks.gpu --model tiny-llama --load-format dummy --device cpu --quick  # smoke
    python -m benchmarks.gpu --model tiny-llama --load-format dummy --device cpu --quick \
        --sections http --concurrency 1,2                                 # its HTTP smoke

One engine (``LLM``, prefix caching off so every prompt is computed) measures:

- batch 1: TTFT of a 128-token prompt and TPOT over 128 output tokens, against the
  weight-bytes floor (weights a decode step reads / peak bandwidth): MBU = floor / TPOT;
- prefill steps of 128, 512 and 2,048 tokens against the FLOP floor (2 x the layers' matmul
  weights x tokens, plus the LM head once: only the last token's logits are computed; over
  peak FLOP/s, attention's own FLOPs left out; ``prefill_flop_floor``);
- decode steps at batch 16, 64 and 256 over 512-token contexts, against their memory floor
  (weights + every sequence's K/V);
- offline throughput: 256 requests of 512 prompt tokens and 256 output tokens at once;
- the first request after start-up against the steady TTFT (the warm-up's job);

then, unless ``--skip-http``, the same model through the HTTP server (a subprocess on
127.0.0.1) at concurrency 1, 16 and 64: TPOT, inter-token p50/p99 and throughput, and the
first request after ``/health`` turned 200 against the steady TTFT. A shape preset has no
tokenizer: without ``--tokenizer`` the server gets a synthetic one of exactly the preset's
vocabulary (``engine.presets.write_synthetic_tokenizer``) in a temporary directory, in which
the load generator's prompt words are one token each and every id decodes to text of its own,
so the client's inter-token gaps are the server's, one step each.

Peaks come from the known-device table (``planner/devices.py``) and are also measured here
(a device-to-device copy and a square matmul) and printed beside it; the floors use the
table's figures where the device is in it, else the measured ones. On CPU the same code
runs with measured peaks only (a smoke test of the benchmark, not a speed figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from engine import LLM, SamplingParams
from engine.builder import pick_device
from engine.config import CUDA_GRAPH_PREFILL_MODES, EngineConfig, ModelError
from engine.cost import StepCostModel
from engine.llm_engine import LLMEngine
from engine.outputs import StepStats
from engine.presets import preset
from kernels.attention_tuning import ATTENTION_TUNING_ENV
from kernels.matmul_tuning import MATMUL_TUNING_ENV
from kernels.settings import DECODE_MATMUL_ENV, PDL_ENV, decode_matmul_env
from planner.devices import device_for_cuda_name
from planner.measured import Histogram

GIGA = 1e9
# What --sections may name; batch 1 always runs (every other row's ratios lean on it).
SECTIONS = ("batch1", "prefill", "decode", "offline", "http", "profile")
# --quick on the CPU (the smoke test): a KV cache of this many bytes, not the CPU default,
# whose zero-filling is most of a tiny model's start-up (in-process and in the server).
QUICK_CPU_KV_BYTES = 64 * 2**20
# --async-scheduling's values and what LLM(async_scheduling=) gets for each.
ASYNC_CHOICES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="llama-3-8b", help="a preset (with dummy weights) or a path")
    ap.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    ap.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "float16"),
        help="default: bfloat16 on CUDA, float32 on CPU",
    )  # fmt: skip
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (for the HTTP part)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--cuda-graph-prefill-mode", default="full", choices=CUDA_GRAPH_PREFILL_MODES,
        help="how steps with prefill tokens replay graphs (engine and server; the engine's "
             "--cuda-graph-prefill-mode)",
    )  # fmt: skip
    ap.add_argument(
        "--async-scheduling", nargs="?", const="on", default="auto", choices=ASYNC_CHOICES,
        help="schedule and launch each step while the one before runs (engine and server); "
             "auto: the engine's default (on for one CUDA device); given alone: on",
    )  # fmt: skip
    ap.add_argument(
        "--quantization", default=None, choices=("int8", "fp8"), help="weights quantized at load"
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"),
        help="8-bit KV cache rows (the engine line prints the pool's tokens)",
    )  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--prefill-chunk-tokens", type=int, default=None,
        help="most prompt tokens a step computes when more are waiting (engine and server); "
             "default: the engine's (the whole step budget on a GPU)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not figures")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument(
        "--server-args", default="",
        help="extra flags for the HTTP part's server, e.g. '--target-itl-ms 20'",
    )  # fmt: skip
    ap.add_argument(
        "--sections", default="batch1,prefill,decode,offline,http",
        help="comma-separated subset of batch1,prefill,decode,offline,http,profile "
        "(profile: where a batch-1, -64 and -256 decode step's time goes, a closed loop at "
        "c=64 (with the Triton kernels: mixed steps attending in one launch, replayed whole, "
        "then in pieces, then attending in two launches; and c=4 with long prompts, mixed "
        "steps split, then in one launch), and the offline run step by step)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:  # a misspelt section would otherwise just not run
        ap.error(f"--sections: unknown {', '.join(unknown)} (choose from {','.join(SECTIONS)})")
    try:  # the engine's own rules, before minutes of peaks and loading
        EngineConfig(device=args.device).check_device()
    except ValueError as exc:
        ap.error(str(exc))
    return args


# ---- peaks -------------------------------------------------------------------------------


def measured_peaks(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes/s, FLOP/s): a device copy of 1 GiB (read + write) and a square matmul."""
    size = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def best(fn, reps: int = 10) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    copy_s = best(lambda: dst.copy_(src))
    mm_s = best(lambda: a @ b)
    return 2 * size / copy_s, 2 * n**3 / mm_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- engine measurements -----------------------------------------------------------------


def _prompt(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt * 7919 + 31 * j) % (vocab - 10) + 5 for j in range(n)]


def _run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int, tag: str) -> list[float]:
    """Token arrival gaps of one request served alone: [TTFT, then one per output token].
    Timed by the outputs, not the steps: with asynchronous scheduling a step returns the
    token of the step launched before it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(tag, prompt, params)
    times = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if any(o.new_token_ids for o in outs):
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
    return times


def start_decode_batch(engine: LLMEngine, batch: int, context: int, salt: int) -> list[str]:
    """Add ``batch`` requests of ``context`` prompt tokens and step until every one has its
    first token, so the next steps are pure decodes. Returns their ids (abort them after)."""
    # Enough tokens that nobody finishes while the others prefill (chunked prefill decodes
    # the early ones meanwhile).
    max_tokens = engine.max_model_len - context - 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [f"dec-{salt}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, _prompt(context, vocab, salt * 1000 + i), params)
    while (
        any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    return ids


def prefill_flop_floor(cost: StepCostModel, num_tokens: int, flops: float) -> float:
    """Seconds the matmuls of a prefill of ``num_tokens`` tokens take at ``flops`` FLOP/s:
    2 FLOPs per weight for every token through the decoder layers (a mixture's router and
    top-k experts), and the LM head once: a prefill computes the logits of its last token
    only. Attention's own FLOPs are left out (they grow with the context, not the weights)."""
    _, matmul_flops, _ = cost.parts(num_tokens, 1, 0)
    return matmul_flops / flops


def decode_steps(engine: LLMEngine, batch: int, context: int, steps: int, salt: int) -> float:
    """Median wall time of a decode step of ``batch`` sequences at ``context`` tokens."""
    ids = start_decode_batch(engine, batch, context, salt)
    times = []
    for _ in range(steps):
        assert len(engine.scheduler.running) == batch, "a sequence left the batch"
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_request(ids)
    return statistics.median(times)


def offline_throughput(llm: LLM, num: int, prompt_len: int, output_len: int) -> float:
    vocab = llm.engine.model_config.vocab_size
    prompts = [_prompt(prompt_len, vocab, 50_000 + i) for i in range(num)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / elapsed


def _phase_means(stats: list[StepStats]) -> str:
    keys = sorted({k for st in stats for k in st.phase_s})
    return ", ".join(
        f"{k} {1e3 * sum(st.phase_s.get(k, 0.0) for st in stats) / len(stats):.2f}" for k in keys
    )


def profile_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> dict[str, Any]:
    """Host time per decode step of ``batch`` sequences against the time the device was
    busy, the runner's phases, and the top ops by device and by host time."""
    from torch.profiler import ProfilerActivity, profile

    ids = start_decode_batch(engine, batch, context, salt=70 + batch)
    for _ in range(2):
        engine.step()
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    stats = []
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            assert len(engine.scheduler.running) == batch, "a sequence left the batch"
            engine.step()
            stats.append(engine.last_step_stats)
        _sync(engine.device)
        wall = time.perf_counter() - t0
    engine.abort_request(ids)
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    print(
        f"profile decode, batch {batch} x {context}: host {1e3 * wall / steps:.3f} ms/step, "
        f"device busy {busy_us / 1e3 / steps:.3f} ms/step; phases (ms) {_phase_means(stats)}",
        flush=True,
    )
    for key in ("self_device_time_total", "self_cpu_time_total"):
        top = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:12]
        print(f"  top by {key}:", flush=True)
        for e in top:
            per_step_ms = getattr(e, key, 0.0) / 1e3 / steps
            print(f"    {e.key[:70]:<70} n={e.count:<5} {per_step_ms:.3f} ms/step", flush=True)
    return {"host_s": wall / steps, "device_busy_s": busy_us / 1e6 / steps}


def profile_closed_loop(
    engine: LLMEngine, concurrency: int, prompt_len: int, output_len: int, num: int
) -> dict[str, Any]:
    """The engine alone under a closed loop of ``concurrency`` requests (a new one as each
    finishes, as a load generator does): step-time percentiles, and every step slower than
    4x the median with its shape, so a stall can be told from the HTTP side's."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        prompt = _prompt(prompt_len, vocab, 90_000 + added)
        engine.add_request(f"loop-{added}", prompt, params)
        added += 1

    graphs = engine.runner.prefill_graphs
    replays_before = dict(graphs.replays) if graphs is not None else {}
    for _ in range(min(concurrency, num)):
        add()
    steps: list[tuple[float, StepStats]] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if engine.last_step_stats is not None:
            steps.append((dt, engine.last_step_stats))
        for o in outs:
            if o.finished and added < num:
                add()
    times = sorted(dt for dt, _ in steps)
    p50, p99 = times[len(times) // 2], times[int(0.99 * (len(times) - 1))]
    mixed = [dt for dt, st in steps if st.num_prefill_tokens and st.num_decode_tokens]
    mixed_mean = statistics.mean(mixed) if mixed else None
    print(
        f"closed loop c={concurrency}, {num} x {prompt_len} in / {output_len} out: "
        f"{len(steps)} steps, step p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
        f"max {times[-1] * 1e3:.2f} ms; {len(mixed)} mixed steps"
        + (f", {mixed_mean * 1e3:.2f} ms each" if mixed_mean else ""),
        flush=True,
    )
    after = graphs.replays if graphs is not None else {}
    replays = {how: count - replays_before[how] for how, count in after.items()}
    if replays:
        print(
            f"  steps with prefill tokens replayed whole: {replays['whole']}, "
            f"in pieces: {replays['pieces']}",
            flush=True,
        )
    for i, (dt, st) in enumerate(steps):
        if dt > 4 * p50:
            print(
                f"  slow step {i}: {dt * 1e3:.1f} ms, {st.num_prefill_tokens} prefill + "
                f"{st.num_decode_tokens} decode tokens, {st.num_running} running, "
                f"{st.replay or 'replay not known'}; "
                f"phases (ms) {_phase_means([st])}",
                flush=True,
            )
    return {
        "step_p50_s": p50, "step_p99_s": p99, "step_max_s": times[-1],
        "mixed_steps": len(mixed), "mixed_step_mean_s": mixed_mean, "replays": replays,
    }  # fmt: skip


def _closed_loop_splitting(
    engine: LLMEngine, splits: int, heading: str, *loop: int
) -> dict[str, Any]:
    """``profile_closed_loop(engine, *loop)`` with the decode kernel's split heuristic
    answering ``splits`` to every step's attention plan (2: mixed steps attend in two
    launches; 1: in one), put back after."""
    import kernels.paged_attention as decode_kernel

    chosen = decode_kernel.choose_num_splits
    decode_kernel.choose_num_splits = lambda *args, **kwargs: splits  # type: ignore[assignment]
    try:
        print(heading, flush=True)
        return profile_closed_loop(engine, *loop)
    finally:
        decode_kernel.choose_num_splits = chosen


def _print_mixed_ratio(label: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    """``a``'s mean mixed step over ``b``'s, and their step p99s (two closed loops)."""
    if a["mixed_step_mean_s"] and b["mixed_step_mean_s"]:
        print(
            f"{label}: {a['mixed_step_mean_s'] / b['mixed_step_mean_s']:.2f}x; step p99 "
            f"{a['step_p99_s'] * 1e3:.2f} / {b['step_p99_s'] * 1e3:.2f} ms",
            flush=True,
        )


def profile_mixed_attention(
    engine: LLMEngine, concurrency: int, prompt_len: int, output_len: int, num: int
) -> dict[str, Any]:
    """The closed loop on one engine: mixed steps attending in one launch where the decode
    kernel would not split (the default, ``engine.attention.AttentionPlan``), which then
    replay the whole-forward graph; the same replaying pieces cut at attention (where the
    engine captured whole graphs: ``--cuda-graph-prefill-mode full``); then with the decode
    and prefill kernels launched apart in every mixed step (pieces)."""
    loop = (concurrency, prompt_len, output_len, num)
    one = profile_closed_loop(engine, *loop)
    result: dict[str, Any] = {"one_launch": one}
    graphs = engine.runner.prefill_graphs
    if graphs is not None and graphs.whole:
        graphs.whole = False
        try:
            print("the same with steps with prefill tokens replaying pieces:", flush=True)
            result["one_launch_pieces"] = profile_closed_loop(engine, *loop)
        finally:
            graphs.whole = True
        _print_mixed_ratio("mixed steps, pieces / whole", result["one_launch_pieces"], one)
    heading = "the same with the decode and prefill kernels launched apart:"
    result["two_launches"] = _closed_loop_splitting(engine, 2, heading, *loop)
    _print_mixed_ratio("mixed steps, two launches / one", result["two_launches"], one)
    return result


def profile_split_mixed_steps(
    engine: LLMEngine, concurrency: int, prompt_len: int, output_len: int, num: int
) -> dict[str, Any]:
    """A closed loop of few requests with long prompts: its mixed steps hold few decodes
    over long contexts, which the decode kernel splits, so by default they replay graph
    pieces (the decode and prefill kernels launched apart between them). Then the same with
    every mixed step attending in one launch (the split heuristic answering 1), so that they
    replay the whole graph: whether whole graphs should take these steps too."""
    loop = (concurrency, prompt_len, output_len, num)
    split = profile_closed_loop(engine, *loop)
    heading = "the same with every mixed step attending in one launch:"
    one = _closed_loop_splitting(engine, 1, heading, *loop)
    _print_mixed_ratio("few long mixed steps, one launch / split", one, split)
    return {"split": split, "one_launch": one}


def profile_offline(llm: LLM, num: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    """The offline run step by step: how many steps of each kind, and what each cost."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"prof-off-{i}", _prompt(prompt_len, vocab, 60_000 + i), params)
    kinds: dict[str, list[StepStats]] = {"prefill-only": [], "mixed": [], "decode-only": []}
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        st = engine.last_step_stats
        if st is None:
            continue
        kind = (
            "decode-only" if st.num_prefill_tokens == 0
            else "prefill-only" if st.num_decode_tokens == 0 else "mixed"
        )  # fmt: skip
        kinds[kind].append(st)
    wall = time.perf_counter() - t0
    print(f"profile offline: {tokens / wall:.0f} output tok/s over {wall:.2f} s", flush=True)
    out = {}
    for kind, stats in kinds.items():
        if not stats:
            continue
        total = sum(st.step_time_s for st in stats)
        rows = statistics.mean(st.num_decode_tokens + st.num_prefill_tokens for st in stats)
        out[kind] = {"steps": len(stats), "s": total}
        print(
            f"  {kind:<12} {len(stats):>4} steps, {total:6.2f} s ({100 * total / wall:4.1f}%), "
            f"{1e3 * total / len(stats):7.2f} ms/step, {rows:6.0f} tokens/step; "
            f"phases (ms) {_phase_means(stats)}",
            flush=True,
        )
    return out


# ---- HTTP --------------------------------------------------------------------------------


def server_ttft(base_url: str) -> Histogram | None:
    """The server's TTFT histogram so far (``/metrics``); None if it exports none."""
    from benchmarks.servers import TTFT_METRIC
    from loadtest.probe import parse_prometheus_text

    text = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=30, trust_env=False).text
    return Histogram.from_samples(parse_prometheus_text(text), TTFT_METRIC)


def _mean_between(before: Histogram | None, after: Histogram | None) -> float | None:
    return after.minus(before).mean() if after is not None else None


def first_request_ttft(
    base_url: str, model: str, prompt_tokens: int, reps: int
) -> tuple[float, float, float | None, float | None]:
    """TTFT of the first streamed request after start-up and the median of ``reps`` more,
    as the client saw them; then the server's own (its histogram: arrival to the first
    token) for the first request and the mean of the others, None where it exports none."""
    import random

    from loadtest.workloads import make_prompt

    body: dict[str, Any] = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True}

    def one(salt: int) -> float:
        # Fresh words every time: a prefix cache must not answer the prompt.
        body["prompt"] = make_prompt(prompt_tokens, random.Random(f"first-ttft:{salt}"))
        # A new connection each time, but the client is made before the clock starts: making
        # one loads a TLS context (16-45 ms), which is not the server's time.
        with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as http:
            t0 = time.perf_counter()
            with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"{resp.status_code}: {resp.read().decode()[:300]}")
                for line in resp.iter_lines():
                    if line.startswith("data: ") and '"text"' in line:
                        return time.perf_counter() - t0
        raise RuntimeError("no token streamed")

    h0 = server_ttft(base_url)
    first = one(0)
    h1 = server_ttft(base_url)
    steady = statistics.median(one(i) for i in range(1, reps + 1))
    h2 = server_ttft(base_url)
    return first, steady, _mean_between(h0, h1), _mean_between(h1, h2)


def server_command(
    args: argparse.Namespace,
    max_num_seqs: int,
    tokenizer: str | None = None,
    kv_cache_memory: int | None = None,
    peaks: tuple[float, float] | None = None,
) -> str:
    """The HTTP part's server command line (``{host}``/``{port}`` left for the launcher),
    serving what the engine part measured, plus ``--server-args``. ``tokenizer``: the
    directory it gets (default: ``--tokenizer``'s); ``kv_cache_memory``: bytes (default:
    the server's own budget); ``peaks``: (bytes/s, FLOP/s) its MBU and MFU divide by
    (default: its own, the device table's or a probe's)."""
    flags = f"--model {args.model} --load-format {args.load_format} --max-num-seqs {max_num_seqs}"
    for flag, value in (
        ("--dtype", args.dtype),
        ("--device", args.device),
        ("--tokenizer", tokenizer or args.tokenizer),
        ("--quantization", args.quantization),
        ("--kv-cache-dtype", None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype),
        ("--prefill-chunk-tokens", args.prefill_chunk_tokens),
        (
            "--cuda-graph-prefill-mode",
            None if args.cuda_graph_prefill_mode == "full" else args.cuda_graph_prefill_mode,
        ),
        ("--kv-cache-memory", kv_cache_memory),
        ("--peak-bandwidth-gbps", f"{peaks[0] / GIGA:.4g}" if peaks else None),
        ("--peak-tflops", f"{peaks[1] / 1e12:.4g}" if peaks else None),
    ):
        if value:
            flags += f" {flag} {value}"
    if args.enforce_eager:
        flags += " --enforce-eager"
    if args.async_scheduling != "auto":
        flags += f" --async-scheduling {args.async_scheduling}"
    if args.server_args:
        flags += f" {args.server_args}"
    return f"{sys.executable} -m server --host {{host}} --port {{port}} {flags}"


def quick_kv_bytes(args: argparse.Namespace, quick: bool) -> int | None:
    """The KV budget of a ``--quick`` run on the CPU; None (the default budget) otherwise."""
    device = torch.device(EngineConfig(device=args.device).resolved_device())
    return QUICK_CPU_KV_BYTES if quick and device.type == "cpu" else None


def synthetic_tokenizer(args: argparse.Namespace, directory: Path) -> str | None:
    """For a shape preset with dummy weights and no ``--tokenizer``: a tokenizer of exactly
    its vocabulary written into ``directory``, whose words include every word the load
    generator's prompts are made of (one token each, so a prompt of n words is n tokens).
    None otherwise (the server reads ``--tokenizer`` or the checkpoint's own)."""
    from server.cli import write_preset_tokenizer

    if args.tokenizer or args.load_format != "dummy" or preset(args.model) is None:
        return None
    write_preset_tokenizer(args.model, directory)
    return str(directory)


def tokenizer_shortfall(tokenizer: Any, vocab: int) -> str | None:
    """A warning when ``tokenizer`` decodes far fewer ids than the model samples from (a
    smaller model's tokenizer on a preset): a random model's ids past its end decode to no
    text, so the client sees tokens in bursts, not one per step. None when it is close."""
    num = len(tokenizer)
    if num >= 0.99 * vocab:  # a real vocabulary padded past its tokenizer's last id
        return None
    return (
        f"WARNING: the tokenizer has {num} tokens for a vocabulary of {vocab}: ids past "
        f"{num - 1} decode to no text, so HTTP inter-token gaps span several steps (leave "
        "--tokenizer out on a shape preset for a synthetic one of the right size)"
    )


def measure_http(
    args: argparse.Namespace,
    concurrencies: list[int],
    prompt: int,
    output: int,
    tokenizer: str | None = None,
    *,
    quick: bool = False,
    peaks: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The first request after start-up on a server of its own, then one closed-loop point
    per concurrency on another (``benchmarks/servers.py``). ``quick``: a few requests each,
    for the CPU smoke test; ``peaks``: as ``server_command``'s."""
    from benchmarks.servers import measure_server
    from loadtest.launcher import ServerProcess, build_command, free_port

    cmd = server_command(args, max(concurrencies), tokenizer, quick_kv_bytes(args, quick), peaks)
    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-gpu-bench-"))
    # The first request after /health: its own server, so no earlier request warmed it.
    port = free_port()
    server = ServerProcess(
        build_command(cmd, port=port, host="127.0.0.1"), port, log_dir / "first.log"
    )
    server.start()
    try:
        startup = server.wait_healthy(timeout_s=900)
        first, steady, server_first, server_steady = first_request_ttft(
            server.base_url, args.model, prompt, reps=2 if quick else 5
        )
    finally:
        server.stop()
    on_server = (
        f"; the server's histogram {server_first * 1e3:.1f} vs {server_steady * 1e3:.1f} ms "
        f"({server_first / server_steady:.2f}x)"
        if server_first and server_steady
        else ""
    )
    print(
        f"HTTP: healthy after {startup:.1f} s; first request TTFT {first * 1e3:.1f} ms, "
        f"steady {steady * 1e3:.1f} ms ({first / steady:.2f}x){on_server}",
        flush=True,
    )
    # Each point sends max(32, 2 x its concurrency) requests (4 when quick): c=1 then takes
    # seconds, not the minutes that 2 x the largest concurrency of sequential requests would.
    result = measure_server(
        "pagedserve", cmd, Path("."), concurrencies, prompt, output,
        num_requests=4 if quick else 32, log_dir=log_dir, startup_timeout_s=900,
    )  # fmt: skip
    result["first_ttft_s"], result["steady_ttft_s"], result["health_s"] = first, steady, startup
    result["server_first_ttft_s"], result["server_steady_ttft_s"] = server_first, server_steady
    return result


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def run_http_section(
    args: argparse.Namespace,
    model_tokenizer: Any,
    vocab: int,
    tokenizer_dir: Path,
    quick: bool,
    tpot: float,
    peaks: tuple[float, float] | None = None,
) -> dict[str, Any] | None:
    """The HTTP part, after the engine part: None if there is no tokenizer to serve text
    with. ``model_tokenizer``: the one the engine part loaded (``--tokenizer`` or the
    checkpoint's), or None; a synthetic one is written into ``tokenizer_dir`` for a shape
    preset without ``--tokenizer``. ``tpot``: the engine's batch-1 TPOT, which each point's
    is printed against; ``peaks``: as ``server_command``'s."""
    tokenizer = synthetic_tokenizer(args, tokenizer_dir)
    if tokenizer is not None:
        print(
            f"HTTP part: a synthetic tokenizer of {vocab} tokens (the preset has none)", flush=True
        )
    elif model_tokenizer is None:
        print("HTTP part skipped: the model has no tokenizer (pass --tokenizer DIR)", flush=True)
        return None
    else:
        warning = tokenizer_shortfall(model_tokenizer, vocab)
        if warning is not None:
            print(warning, flush=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    size = 16 if quick else 128
    http = measure_http(args, concurrencies, size, size, tokenizer, quick=quick, peaks=peaks)
    http["tokenizer"] = "synthetic" if tokenizer is not None else "the model's"
    for c, row in http["points"].items():
        # Issue 35's bar at c=64 is on this ratio (the server's own token arrivals).
        server_p50, server_p99 = row.get("server_itl_p50_s"), row.get("server_itl_p99_s")
        spread = f", p99 / p50 {server_p99 / server_p50:.2f}x" if server_p50 and server_p99 else ""
        print(
            f"HTTP c={c}: TTFT p50 {_ms(row['ttft_p50_s'])} ms (server's histogram "
            f"{_ms(row.get('server_ttft_p50_s'))} ms), "
            f"TPOT p50 {row['tpot_p50_s'] * 1e3:.2f} ms "
            f"(engine step at batch 1: {tpot * 1e3:.2f} ms -> "
            f"{row['tpot_p50_s'] / tpot:.2f}x), ITL p50 / p99 {_ms(row['itl_p50_s'])} / "
            f"{_ms(row['itl_p99_s'])} ms (server's histogram "
            f"{_ms(server_p50)} / {_ms(server_p99)} ms{spread}), "
            f"{row['output_tok_s']:.0f} tok/s",
            flush=True,
        )
    return http


# ---- report ------------------------------------------------------------------------------


def build_llm(
    args: argparse.Namespace,
    dtype_name: str,
    device: torch.device,
    max_seqs: int,
    prefills: tuple[int, ...],
    quick: bool,
) -> LLM:
    """The offline engine every section runs on, as the command line asks."""
    return LLM(
        model=args.model, load_format=args.load_format, dtype=dtype_name, device=str(device),
        tokenizer=args.tokenizer, enforce_eager=args.enforce_eager, max_num_seqs=max_seqs,
        cuda_graph_prefill_mode=args.cuda_graph_prefill_mode,
        max_num_batched_tokens=max(2048, max(prefills)), enable_prefix_caching=False,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=quick_kv_bytes(args, quick),
        async_scheduling=ASYNC_CHOICES[args.async_scheduling],
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = set(args.sections.split(","))
    if args.skip_http:
        sections.discard("http")
    device, dtype = pick_device(EngineConfig(device=args.device, dtype=args.dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    quick = args.quick
    max_seqs = 16 if quick else args.max_num_seqs
    batches = [b for b in ((2, 4) if quick else (16, 64, 256)) if b <= max_seqs]
    prefills = (16, 64) if quick else (128, 512, 2048)
    context = 32 if quick else 512
    tpot_tokens = 16 if quick else 128

    table = (
        device_for_cuda_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    bw_meas, fl_meas = measured_peaks(device, dtype)
    if table is not None:
        key = "bf16" if dtype == torch.bfloat16 else "fp16" if dtype == torch.float16 else "tf32"
        bandwidth, flops = table.memory_bandwidth, table.peak_flops[key]
        source = f"table: {table.description}"
    else:
        bandwidth, flops, source = bw_meas, fl_meas, "measured"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"device: {name}; {dtype_name}; peaks ({source}) {bandwidth / GIGA:.0f} GB/s, "
        f"{flops / 1e12:.3g} TFLOP/s; measured copy {bw_meas / GIGA:.0f} GB/s, "
        f"matmul {fl_meas / 1e12:.3g} TFLOP/s",
        flush=True,
    )

    t0 = time.perf_counter()
    try:
        llm = build_llm(args, dtype_name, device, max_seqs, prefills, quick)
    except ModelError as exc:  # a model or setting to change: one line, as the server says it
        print(f"python -m benchmarks.gpu: error: {exc}", file=sys.stderr)
        return 2
    engine = llm.engine
    switches = "".join(
        f", {name}={os.environ[name]}"
        for name in (PDL_ENV, DECODE_MATMUL_ENV, MATMUL_TUNING_ENV, ATTENTION_TUNING_ENV)
        if os.environ.get(name)
    )
    print(
        f"engine ready in {time.perf_counter() - t0:.1f} s "
        f"({'eager' if args.enforce_eager or device.type != 'cuda' else 'CUDA graphs'}"
        f"{', async scheduling' if engine.async_scheduling else ''}{switches}); "
        f"{engine.kv_capacity.describe()}",
        flush=True,
    )
    mc = engine.model_config
    vocab = mc.vocab_size
    cost = engine.cost_model
    decode_weight_bytes = cost.body_weight_bytes + cost.lm_head_bytes
    if cost.block_rows:  # --quantization (or GGUF blocks): what a small step reads
        decode_weight_bytes = cost.body_block_bytes + cost.lm_head_block_bytes
    kv_per_token = engine.kv_capacity.bytes_per_token
    out: dict[str, Any] = {"device": name, "dtype": dtype_name, "model": args.model,
                           "quantization": args.quantization,
                           "async_scheduling": engine.async_scheduling,
                           "graphs": not args.enforce_eager and device.type == "cuda",
                           "pdl": os.environ.get(PDL_ENV, ""),
                           "decode_matmul": decode_matmul_env(),
                           "matmul_tuning": os.environ.get(MATMUL_TUNING_ENV, ""),
                           "attention_tuning": os.environ.get(ATTENTION_TUNING_ENV, ""),
                           "bandwidth": bandwidth, "flops": flops}  # fmt: skip

    # Batch 1: the first request after the engine is ready, then a steady one.
    first = _run_alone(engine, _prompt(128, vocab, 1), 2, "first")
    steady = _run_alone(engine, _prompt(128, vocab, 2), tpot_tokens + 1, "steady")
    ttft, tpot = steady[0], statistics.median(steady[1:])
    floor = decode_weight_bytes / bandwidth
    out["batch1"] = {"ttft_s": ttft, "tpot_s": tpot, "floor_s": floor, "first_ttft_s": first[0]}
    print(
        f"batch 1: TTFT {ttft * 1e3:.2f} ms (first request {first[0] * 1e3:.2f} ms, "
        f"{first[0] / ttft:.2f}x), TPOT {tpot * 1e3:.3f} ms vs floor {floor * 1e3:.3f} ms "
        f"({decode_weight_bytes / 1e9:.2f} GB): {tpot / floor:.2f}x floor, MBU {floor / tpot:.2f}, "
        f"{1 / tpot:.0f} tok/s",
        flush=True,
    )

    out["prefill"] = {}
    for n in prefills if "prefill" in sections else ():
        times = [
            _run_alone(engine, _prompt(n, vocab, 100 + n + r), 1, f"pf-{n}-{r}")[0]
            for r in range(3)
        ]
        t = statistics.median(times)
        floor = prefill_flop_floor(cost, n, flops)
        out["prefill"][n] = {"s": t, "floor_s": floor}
        print(
            f"prefill {n:>5} tokens: {t * 1e3:8.2f} ms vs FLOP floor {floor * 1e3:7.2f} ms "
            f"({t / floor:.2f}x, MFU {floor / t:.2f})",
            flush=True,
        )

    out["decode"] = {}
    for b in batches if "decode" in sections else ():
        t = decode_steps(engine, b, context, steps=8 if quick else 16, salt=b)
        kv_bytes = b * (context + 2) * kv_per_token
        floor = (decode_weight_bytes + kv_bytes) / bandwidth
        out["decode"][b] = {"s": t, "floor_s": floor}
        print(
            f"decode step, batch {b:>3} x {context}: {t * 1e3:7.3f} ms "
            f"vs floor {floor * 1e3:6.3f} ms "
            f"({t / floor:.2f}x, MBU {floor / t:.2f}; {b / t:.0f} tok/s)",
            flush=True,
        )

    num, pin, pout = (8, 32, 16) if quick else (max_seqs, 512, 256)
    if "offline" in sections:
        tput = offline_throughput(llm, num, pin, pout)
        out["offline_tok_s"] = tput
        print(
            f"offline: {num} requests x {pin} in / {pout} out: {tput:.0f} output tok/s", flush=True
        )

    if "profile" in sections:
        prof: dict[str, Any] = {"batch1": profile_decode(engine, 1, 128, 32)}
        if max_seqs >= 64:  # issue 35's batch-64 step target
            prof["batch64"] = profile_decode(engine, 64, context, 8)
        if max_seqs >= 256:
            prof["batch256"] = profile_decode(engine, 256, context, 8)
        if engine.attention_backend == "triton":
            prof["closed_loop"] = profile_mixed_attention(
                engine, min(64, max_seqs), 128, tpot_tokens, 3 * min(64, max_seqs)
            )
            # Prompts that fill the largest prefill-graph bucket (1,024 tokens) beside a
            # few decodes.
            long_prompt = 64 if quick else 896
            prof["split_mixed"] = profile_split_mixed_steps(
                engine, min(4, max_seqs), long_prompt, tpot_tokens, 3 * min(4, max_seqs)
            )
        else:
            prof["closed_loop"] = profile_closed_loop(
                engine, min(64, max_seqs), 128, tpot_tokens, 3 * min(64, max_seqs)
            )
        prof["offline"] = profile_offline(llm, num, pin, pout)
        # The same engine (graphs captured, kernels compiled) with the chunk limit lifted:
        # every step may prefill up to max_num_batched_tokens (already so on CUDA).
        sched = engine.scheduler
        chunk = sched.config.prefill_chunk_tokens
        if chunk != sched.config.max_num_batched_tokens:
            sched.config = dataclasses.replace(
                sched.config, prefill_chunk_tokens=sched.config.max_num_batched_tokens
            )
            print(f"offline again, prefill chunk {chunk} -> {sched.config.prefill_chunk_tokens}:")
            prof["offline_full_chunks"] = profile_offline(llm, num, pin, pout)
            sched.config = dataclasses.replace(sched.config, prefill_chunk_tokens=chunk)
        out["profile"] = prof

    if "http" in sections:
        model_tokenizer = llm.tokenizer
        del llm, engine  # the server needs the memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory(prefix="pagedserve-tokenizer-") as tokenizer_dir:
            # The CPU smoke run's server gets the peaks measured above: it skips its own
            # probe (seconds of each start-up), and its MBU divides by the engine part's.
            cpu_peaks = (bandwidth, flops) if quick and device.type == "cpu" else None
            http = run_http_section(
                args, model_tokenizer, vocab, Path(tokenizer_dir), quick, tpot, cpu_peaks
            )
        if http is not None:
            out["http"] = http
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
