"""What lossy modes cost in quality, beside what they gain in speed and capacity.

    python -m benchmarks.quality                         # the default model, every mode
    python -m benchmarks.quality --modes float32,w-int8 --out quality.json
    python -m benchmarks.quality --list-modes
    python -m benchmarks.quality --device cuda           # the same on a GPU, in bfloat16

Every engine runs on ``--device`` (the CPU unless asked: the figures are the CPU stack's) in
``--dtype`` (when not given, the engine's default for the device: float32 on the CPU,
bfloat16 on CUDA).

Each mode (``MODES``: a name and the ``LLM`` keyword arguments that turn it on) is compared
with the reference mode (the first one run: float32 weights, float KV) on the same model:

- **perplexity** over text that ships with Python (the Zen of Python and a fixed set of
  stdlib docstrings; ``corpus_text``), cut into windows of ``--window`` tokens, each scored
  from its own start. The logprobs are the engine's own: one prefill step per window through
  the engine's forward (C++ stack, Triton or reference, quantized KV cache included), with
  logits for every row (``prompt_logprobs``);
- **mean |delta logprob|**: the mean over those positions of the absolute difference between
  the mode's and the reference's logprob of the actual next token; **top-1 agreement**: the
  share of those positions where the mode's most likely token is the reference's;
- **greedy agreement**: for each of ``PROMPTS``, greedy decoding of ``--tokens`` (64) tokens,
  EOS ignored; the share of tokens before the first one that differs from the reference's
  (after a divergence the two continue different texts, so later positions are not compared),
  averaged over the prompts; and how many prompts agree on all of them;
- **agreement on the reference's text**: each prompt followed by the reference's greedy
  tokens, scored like the corpus (teacher-forced); the share of those tokens that are the
  mode's own top token after the same history. One flipped near-tie costs one token here,
  where it costs the rest of the prompt in the greedy agreement;
- **the rounding floor** (mode ``kv-bf16-rounding``): float32 with every K/V row rounded
  to bfloat16 as it is stored, what a 16-bit cache's rounding alone costs; near-ties in the
  prompts' greedy text flip under any perturbation, so a quantized cache's figures are read
  against this row, not against 100%;
- **speed**: batch-1 TPOT, the median gap between a lone request's tokens over ``--tokens``
  decode steps (after one warm-up request);
- **bytes**: the weight bytes a batch-1 decode step reads (``engine/cost.py``, the MBU
  model), the KV bytes per token and the tokens the pool holds in ``--kv-cache-memory``.

A mode whose ``LLM`` keyword this build lacks (``--kv-cache-dtype`` arrives with issue 39's
part 1) is listed as skipped, not failed. The text's token count and the Python version are
printed with the table: the docstrings change between Python versions, so figures compare
only within one version.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import json
import math
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.kv_quant import round_stores_to_bfloat16
from benchmarks.wave import run_wave
from engine.input_batch import AttentionMetadata, InputBatch
from engine.llm import LLM
from scheduler.request import SamplingParams
from server.flags import parse_size


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    llm_kwargs: dict[str, Any]
    about: str
    # Applied to the built engine before it is measured (the rounding floor's store hook).
    prepare: Callable[[LLM], None] | None = None


# The first mode run is the reference the others are compared with. A new lossy mode is
# one line here.
MODES: tuple[Mode, ...] = (
    Mode("float32", {"matmul_weights": "float32"}, "float32 weights and KV (the reference)"),
    Mode(
        "kv-bf16-rounding",
        {"matmul_weights": "float32", "attention_backend": "torch"},
        "float32 with every K/V row rounded to bfloat16 as stored: a 16-bit cache's rounding "
        "alone, the floor a quantized cache cannot beat (the reference attention path)",
        prepare=round_stores_to_bfloat16,
    ),
    Mode("gguf", {}, "the default: small batches read the GGUF file's exact blocks (lossless)"),
    Mode("w-int8", {"quantization": "int8"}, "--quantization int8"),
    Mode(
        "kv-int8", {"matmul_weights": "float32", "kv_cache_dtype": "int8"}, "--kv-cache-dtype int8"
    ),
    Mode(
        "w-int8+kv-int8",
        {"quantization": "int8", "kv_cache_dtype": "int8"},
        "--quantization int8 --kv-cache-dtype int8",
    ),
    Mode("w-fp8", {"quantization": "fp8"}, "--quantization fp8 (CUDA only)"),
    Mode(
        "kv-fp8",
        {"matmul_weights": "float32", "kv_cache_dtype": "fp8"},
        "--kv-cache-dtype fp8 (e4m3)",
    ),
)

# Greedy prompts: short openings of the kinds of text the model is asked for.
PROMPTS: tuple[str, ...] = (
    "The Zen of Python says that",
    "A heap is a binary tree in which",
    "def quicksort(items):",
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "To make a cup of tea, first",
    "The three laws of thermodynamics are",
    "import json\n\ndef load_config(path):",
)


def corpus_text() -> str:
    """Text shipped with every CPython: the Zen of Python (the ``this`` module, which prints
    it on import) and the docstrings of a fixed list of stdlib modules and classes."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    zen = "".join(this.d.get(c, c) for c in this.s)
    import argparse as _argparse
    import difflib
    import functools
    import heapq
    import json as _json
    import string

    docs = [
        heapq.__doc__,
        _argparse.__doc__,
        difflib.__doc__,
        _json.__doc__,
        textwrap.TextWrapper.__doc__,
        functools.partial.__doc__,
        string.Formatter.__doc__,
    ]
    return "\n\n".join([zen, *(textwrap.dedent(d or "").strip() for d in docs)])


def corpus_windows(tokenizer: Any, window: int) -> list[list[int]]:
    """The corpus's token ids cut into windows of ``window`` tokens (the last one shorter,
    kept if it has at least 16)."""
    ids = list(tokenizer.encode(corpus_text(), add_special_tokens=False))
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 16]


def prompt_logprobs(llm: LLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([len(token_ids) - 1] float64, [len(token_ids) - 1] int64)``: the logprob the
    engine's model gives each token of ``token_ids`` after the ones before it, and its own
    top token there, from one prefill step with logits for every row
    through the engine's own forward and KV cache (the pool's blocks are taken and given
    back through kvpool, so the engine must be idle)."""
    engine = llm.engine
    n = len(token_ids)
    request_id = "quality-score"
    manager = engine.kv_manager
    assert manager.allocate_slots(request_id, n) is not None, "the KV pool cannot hold a window"
    try:
        device = engine.device
        block_ids = list(manager.block_ids(request_id))

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        batch = InputBatch(
            input_ids=tensor(token_ids, torch.int64),
            positions=tensor(list(range(n)), torch.int64),
            slot_mapping=tensor(manager.slot_mapping(request_id, 0, n), torch.int64),
            attn=AttentionMetadata(
                num_decodes=0,
                block_tables=tensor([block_ids], torch.int32),
                seq_lens=tensor([n], torch.int32),
                query_start_loc=tensor([0, n], torch.int32),
                max_seq_len=n,
            ),
            logits_indices=tensor(list(range(n)), torch.int64),
            sampling=[],
            logits_are_all_rows=True,
        )
        storage = engine.storage
        logits = engine.runner.model(batch, storage.key_caches, storage.value_caches)
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.tensor(token_ids[1:], device=logprobs.device)
        chosen = logprobs[:-1].gather(1, targets[:, None])[:, 0].cpu()
        return chosen, logprobs[:-1].argmax(dim=-1).cpu()
    finally:
        manager.free(request_id)


def greedy(llm: LLM, prompts: tuple[str, ...], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(list(prompts), params)]


def batch1_tpot_s(llm: LLM, num_tokens: int, *, warm_up: bool = True) -> float:
    """Median seconds between a lone request's tokens (decode steps at batch 1)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    if warm_up:
        llm.generate([PROMPTS[0]], params)
    wave = run_wave(llm.engine, [llm.encode(PROMPTS[1])], params, tag="quality-tpot")
    (times,) = wave.token_times
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps)


@dataclass(slots=True)
class ModeResult:
    mode: str
    about: str
    skipped: str | None = None
    perplexity: float | None = None
    perplexity_change: float | None = None  # relative to the reference
    mean_abs_logprob_diff: float | None = None
    top1_agreement: float | None = None  # positions whose top token is the reference's
    greedy_agreement: float | None = None  # share of tokens before the first divergence
    forced_agreement: float | None = None  # the reference's greedy tokens that are our top
    prompts_identical: int | None = None
    tpot_ms: float | None = None
    weight_bytes_per_decode_step: int | None = None
    kv_bytes_per_token: int | None = None
    kv_tokens: int | None = None
    matmul_weights: str | None = None
    greedy_ids: list[list[int]] = field(default_factory=list)


def missing_kwargs(mode: Mode) -> list[str]:
    accepted = inspect.signature(LLM.__init__).parameters
    return [k for k in mode.llm_kwargs if k not in accepted]


Scores = tuple[torch.Tensor, torch.Tensor]  # every scored position's logprob, top token


def run_mode(
    mode: Mode, args: argparse.Namespace, reference: ModeResult | None, ref_scores: Scores | None
) -> tuple[ModeResult, Scores | None]:
    result = ModeResult(mode.name, mode.about)
    lacking = missing_kwargs(mode)
    if lacking:
        result.skipped = f"this build's LLM has no {', '.join(lacking)}"
        return result, None
    try:
        llm = LLM(
            args.model,
            max_num_seqs=len(PROMPTS),
            kv_cache_memory=args.kv_cache_memory,
            seed=0,
            device=args.device,
            dtype=args.dtype,
            **mode.llm_kwargs,
        )
    except (ValueError, RuntimeError) as exc:  # e.g. fp8 on a CPU: say so, go on
        result.skipped = str(exc).splitlines()[0]
        return result, None
    if mode.prepare is not None:
        mode.prepare(llm)
    engine = llm.engine
    windows = corpus_windows(llm.tokenizer, args.window)[: args.max_windows]
    scored = [prompt_logprobs(llm, w) for w in windows]
    flat = torch.cat([lp for lp, _ in scored])
    top = torch.cat([t for _, t in scored])
    result.perplexity = math.exp(-flat.mean().item())
    if reference is not None:
        result.forced_agreement = forced_agreement(llm, reference.greedy_ids, args.prompts)
    result.greedy_ids = greedy(llm, PROMPTS[: args.prompts], args.tokens)
    if not args.no_speed:
        result.tpot_ms = 1e3 * batch1_tpot_s(llm, args.tokens)
    result.weight_bytes_per_decode_step = engine.cost_model.step([(64, 1)], 1).weight_bytes
    result.kv_bytes_per_token = engine.kv_capacity.bytes_per_token
    result.kv_tokens = engine.kv_capacity.num_tokens
    result.matmul_weights = engine.matmul_weights
    if reference is not None and ref_scores is not None:
        assert reference.perplexity is not None
        result.perplexity_change = result.perplexity / reference.perplexity - 1
        ref_flat, ref_top = ref_scores
        result.mean_abs_logprob_diff = (flat - ref_flat).abs().mean().item()
        result.top1_agreement = (top == ref_top).double().mean().item()
        shares, same = [], 0
        for ours, theirs in zip(result.greedy_ids, reference.greedy_ids, strict=True):
            pairs = enumerate(zip(ours, theirs, strict=True))
            prefix = next((i for i, (a, b) in pairs if a != b), len(ours))
            shares.append(prefix / len(ours))
            same += prefix == len(ours)
        result.greedy_agreement = statistics.mean(shares)
        result.prompts_identical = same
    del llm, engine
    gc.collect()
    return result, (flat, top)


def forced_agreement(llm: LLM, reference_ids: list[list[int]], num_prompts: int) -> float:
    """The share of the reference's greedy tokens (``reference_ids``, one list per prompt of
    ``PROMPTS``) that are this engine's own top token after the prompt and the reference's
    tokens before them (one prefill per prompt, ``prompt_logprobs``)."""
    same = total = 0
    for prompt, ids in zip(PROMPTS[:num_prompts], reference_ids, strict=True):
        prompt_ids = llm.encode(prompt)
        _, top = prompt_logprobs(llm, prompt_ids + ids)
        ours = top[len(prompt_ids) - 1 :].tolist()  # the top token after each history
        same += sum(a == b for a, b in zip(ours, ids, strict=True))
        total += len(ids)
    return same / total


def paired_tpot(modes: list[Mode], args: argparse.Namespace) -> dict[str, list[float]]:
    """Batch-1 TPOT (ms) of every mode, all engines built first and then measured in turn,
    ``args.paired_tpot`` rounds: on a shared machine the load drifts by the minute, so
    figures measured minutes apart (one mode after another) compare poorly, and rounds that
    alternate do better. Returns each mode's per-round medians."""
    llms = {m.name: LLM(args.model, max_num_seqs=1, kv_cache_memory=args.kv_cache_memory,
                        device=args.device, dtype=args.dtype, **m.llm_kwargs)
            for m in modes if not missing_kwargs(m)}  # fmt: skip
    for m in modes:
        if m.prepare is not None and m.name in llms:
            m.prepare(llms[m.name])
    for llm in llms.values():
        batch1_tpot_s(llm, 8)
    rounds: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.paired_tpot):
        for name, llm in llms.items():
            rounds[name].append(1e3 * batch1_tpot_s(llm, args.tokens, warm_up=False))
    return rounds


def table(results: list[ModeResult], num_prompts: int) -> str:
    head = (
        "| mode | perplexity | vs ref | greedy agreement (first N) | prompts identical "
        "| agreement on the reference's text | top-1 agreement | mean abs dlogprob "
        "| batch-1 TPOT ms | weight MB / decode step | KV bytes / token | KV tokens |"
    )
    lines = [head, "|" + "---|" * 12]

    def fmt(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in results:
        if r.skipped:
            lines.append(f"| {r.mode} | skipped: {r.skipped} |" + " |" * 10)
            continue
        lines.append(
            f"| {r.mode} | {fmt(r.perplexity, '.3f')} | {fmt(r.perplexity_change, '+.2%')} "
            f"| {fmt(r.greedy_agreement, '.1%')} "
            f"| {'' if r.prompts_identical is None else f'{r.prompts_identical}/{num_prompts}'} "
            f"| {fmt(r.forced_agreement, '.1%')} | {fmt(r.top1_agreement, '.1%')} "
            f"| {fmt(r.mean_abs_logprob_diff, '.4f')} | {fmt(r.tpot_ms, '.1f')} "
            f"| {(r.weight_bytes_per_decode_step or 0) / 1e6:.0f} | {r.kv_bytes_per_token} "
            f"| {r.kv_tokens} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--modes",
        default=",".join(m.name for m in MODES),
        help="comma-separated mode names; the first is the reference (--list-modes)",
    )
    parser.add_argument("--list-modes", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="the model's dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument(
        "--max-windows", type=int, default=None, help="score only the first windows (tests)"
    )
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (N)")
    parser.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help="greedy over the first this many"
    )
    parser.add_argument("--no-speed", action="store_true", help="skip the TPOT measurement")
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=64 << 20,
        help="KV budget of every mode, e.g. 64MiB (the default)",
    )
    parser.add_argument(
        "--paired-tpot",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only batch-1 TPOT: every mode's engine at once, measured in alternating rounds",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    by_name = {m.name: m for m in MODES}
    if args.list_modes:
        for m in MODES:
            lacking = missing_kwargs(m)
            print(f"{m.name:16} {m.about}" + (f" [unavailable: no {lacking}]" if lacking else ""))
        return 0
    names = [n.strip() for n in args.modes.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(by_name)}")
    if args.paired_tpot:
        rounds = paired_tpot([by_name[n] for n in names], args)
        print(f"batch-1 TPOT, ms: median of {args.tokens - 1} gaps per round, {args.paired_tpot} "
              "alternating rounds")  # fmt: skip
        for name, values in rounds.items():
            print(f"{name:16} median {statistics.median(values):7.2f}  rounds "
                  + " ".join(f"{v:.2f}" for v in values))  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "device": args.device, "dtype": args.dtype,
                           "paired_tpot_ms": rounds}, f, indent=1)  # fmt: skip
        return 0
    results: list[ModeResult] = []
    reference: ModeResult | None = None
    ref_scores: Scores | None = None
    for name in names:
        started = time.perf_counter()
        result, scores = run_mode(by_name[name], args, reference, ref_scores)
        if reference is None and result.skipped is None:
            reference, ref_scores = result, scores
        results.append(result)
        print(f"# {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    num_scored = 0 if ref_scores is None else len(ref_scores[0])
    print(
        f"model {args.model} on {args.device} in {args.dtype}; "
        f"reference {reference.mode if reference else 'none'}; "
        f"{num_scored} scored tokens in windows of {args.window}; greedy over {args.prompts} "
        f"prompts x {args.tokens} tokens; KV budget {args.kv_cache_memory / 2**20:.0f} MiB; "
        f"Python {platform.python_version()}; torch threads {torch.get_num_threads()}"
    )
    print(table(results, args.prompts))
    if args.out:
        payload = {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "python": platform.python_version(),
            "scored_tokens": num_scored,
            "window": args.window,
            "tokens": args.tokens,
            "results": [asdict(r) for r in results],
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
