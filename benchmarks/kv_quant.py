"""Quantized KV cache (``--kv-cache-dtype``): what it costs in quality, what it buys in speed.

    python -m benchmarks.kv_quant --quality                 # the default model, float32 CPU
    python -m benchmarks.kv_quant --throughput              # concurrency 64, 1,024-token prompts
    python -m benchmarks.kv_quant --capacity                # the pool's tokens per dtype
    python -m benchmarks.kv_quant --quality --dtypes int8 --json
    python -m benchmarks.kv_quant --quality --ab-key-offsets     # each dtype without and with
    # on a GPU (bfloat16 by default there; the Triton kernels):
    python -m benchmarks.kv_quant --capacity --device cuda --model llama-3-8b --load-format dummy
    python -m benchmarks.kv_quant --quality --device cuda --model MODEL.gguf

Every engine runs on ``--device`` (cpu or cuda) in ``--dtype`` (float32 on the CPU and
bfloat16 on CUDA unless given), with ``--attention-backend`` (auto: the C++ kernels on the
CPU in float32, the PyTorch reference in other CPU dtypes, Triton on CUDA). ``--model`` is
the embedded default, an HF directory or a .gguf file; with ``--load-format dummy`` it may
name a shape preset (``engine/presets.py``, e.g. ``llama-3-8b``) of random weights, which
serves ``--capacity`` and ``--throughput`` (token ids, no text) but not ``--quality``.

The reference (``auto``) is the model's own dtype: a float32 cache on the CPU, a bfloat16
cache on a GPU. The report names it in its labels (``auto (bfloat16)``), and every "vs"
column compares with it.

Quality (each KV dtype against the model's own dtype, ``auto``, same engine otherwise):

- **Perplexity** of a passage of text that ships with Python (the language reference's
  "compound statements" topic, ``pydoc_data.topics``), teacher-forced through the paged
  cache: the passage is prefilled in chunks of ``--chunk`` tokens with the logits of every
  row, so every position attends to K/V read back from the (quantized) cache, as served.
  Also the mean and max absolute difference of the target tokens' log-probabilities.
- **Greedy agreement**: ``--prompts`` prompts cut from other reference topics, ``--tokens``
  (64) greedy tokens each; per prompt, the length of the common prefix with the ``auto``
  run over ``--tokens`` (a divergence makes everything after it differ, so the prefix, not
  the positionwise match, is the figure), and the mean over prompts.
- **Agreement on auto's text** (teacher-forced): each prompt followed by ``auto``'s greedy
  tokens, prefilled through the mode's cache with the logits of every row; the share of
  those ``--tokens`` positions where the mode's top token is ``auto``'s, and ``auto``'s
  largest top-2 log-probability margin at a position where they differ. Unlike the prefix,
  one flipped near-tie costs one position, not the rest of the prompt.
- **The rounding floor** (``--rounding-floor``, float32 only): a row for ``auto`` with every
  K/V row rounded to bfloat16 as it is stored (the reference attention path), what a 16-bit
  cache's rounding alone does to these figures; a quantized dtype cannot be expected to beat
  it. In bfloat16 the reference is such a cache already, so there is no floor row to add.

Quantized dtypes run as the server's defaults do (keys stored as they are);
``--ab-key-offsets`` adds a row per dtype with the calibrated key offsets
(``--kv-key-offsets``: ``kernels/kv_quant.py``, ``engine/kv_calibration.py``), from its own
engine in the same run.

Capacity (``--capacity``): an engine per dtype at the same ``--kv-cache-memory``, nothing
run: the pool's bytes per token and tokens (what the start-up log and ``/health`` show), and
the ratio to ``auto``'s tokens.

Throughput (``--throughput``): ``--num-requests`` (64) requests of ``--prompt-tokens``
(1,024) tokens submitted at once, ``--max-tokens`` (64) greedy tokens each, EOS ignored, in
the step loop (``LLM.generate``'s path; no HTTP, no sockets) with the same
``--kv-cache-memory`` for every dtype, chosen so that the ``auto`` pool holds only a few of
the requests (the default, 300 MiB, does so for the default model in float32; an 8B shape
in bfloat16 needs a few GiB): the batch is then bounded by KV memory, and the quantized pool
runs more of them at once. Reported: the pool's tokens, wall time, output tokens/s, total
tokens/s, the mean number of running requests per step, and preemptions.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pydoc_data.topics import topics

import torch

from engine.config import ModelError
from engine.input_batch import AttentionMetadata, InputBatch
from engine.llm import LLM
from engine.presets import PRESETS
from scheduler.request import SamplingParams

PPL_TOPIC = "compound"
PROMPT_TOPICS = [
    "assignment", "comparisons", "execmodel", "import", "try", "calls", "function", "naming",
]  # fmt: skip
# Further prompts for --prompts above 8 (a steadier estimate: one near-tie among 8 prompts
# moves the figure by up to 12 points); the first 8 are always PROMPT_TOPICS, so the report's
# 8-prompt figure stays comparable (printed beside).
EXTRA_PROMPT_TOPICS = [
    "assert", "async", "binary", "booleans", "class", "context-managers", "customization",
    "dict", "exceptions", "floating", "formatstrings", "lambda", "numeric-types",
    "specialnames", "string-methods", "typesseq",
]  # fmt: skip


@dataclass(slots=True)
class QualityResult:
    kv_cache_dtype: str  # the row's label: the dtype, "... (key offsets)" for the A/B row
    attention_backend: str  # the backend the row's engine ran (the floor's: torch)
    bytes_per_token: int
    perplexity: float
    perplexity_change: float  # relative to auto
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    greedy_prefix: list[int]  # common-prefix length with auto, per prompt
    greedy_agreement: float  # mean prefix / tokens
    # teacher-forced on auto's greedy text: the share of positions whose top token is auto's
    forced_agreement: float
    # auto's largest top-2 margin where the mode's top token differs on auto's text (0: none)
    forced_max_margin: float
    # auto's top-2 log-probability margin where each diverging prompt diverged: a small one
    # is a near-tie that any perturbation of the arithmetic may flip
    divergence_margins: list[float]


@dataclass(slots=True)
class CapacityResult:
    kv_cache_dtype: str
    bytes_per_token: int
    num_blocks: int
    kv_tokens: int
    ratio: float  # kv_tokens / auto's, at the same --kv-cache-memory


@dataclass(slots=True)
class ThroughputResult:
    run: int  # 1, 2, ...: the round (--repeat), every dtype once a round
    kv_cache_dtype: str
    kv_tokens: int
    wall_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    mean_running: float
    max_running: int
    preemptions: int


class SetupError(Exception):
    """An engine these options cannot build (e.g. ``--attention-backend cpu`` in bfloat16):
    ``main`` prints the engine's reason as one line."""


def make_llm(kv_cache_dtype: str, args: argparse.Namespace, **kwargs: object) -> LLM:
    """An engine of ``args``' model, device, dtype and backend (``parse_args``) with this KV
    cache dtype; ``kwargs`` go to ``LLM`` (and override ``args``' backend)."""
    kwargs.setdefault("attention_backend", args.attention_backend)
    try:
        return LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            tokenizer=args.tokenizer,
            kv_cache_dtype=kv_cache_dtype,
            **kwargs,  # type: ignore[arg-type]
        )
    except ModelError:
        raise
    except ValueError as exc:  # the engine's config checks: an option to change
        raise SetupError(f"--kv-cache-dtype {kv_cache_dtype}: {exc}") from exc


def free_device_memory(device: str) -> None:
    """Return a dropped engine's weights and pool to the device before the next engine is
    built (an 8B shape's 16 GB must): call it once no name refers to the engine. On the
    CPU the allocator returns it as the references go; a collection there costs a quarter
    of a second for nothing the next engine needs."""
    if device == "cuda":
        gc.collect()  # the engine's parts refer to each other
        torch.cuda.empty_cache()


def reference_label(args: argparse.Namespace) -> str:
    """What ``auto`` is in this run: a cache in the model's own dtype."""
    return f"auto ({args.dtype})"


def target_logprobs(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for every i, through the paged cache."""
    return score(llm, ids, chunk)[0]


def score(llm: LLM, ids: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprob, top)``: log p(ids[i + 1] | ids[: i + 1]) and the most likely token after
    ``ids[: i + 1]``, for every i, through the paged cache.

    The text goes into blocks 0, 1, ... of this idle engine's pool directly (no request,
    so kvpool's allocator is not involved and keeps every block free): this engine is this
    benchmark's own, and nothing else runs in it meanwhile. Blocks the prefix cache kept
    are overwritten, so score before ``generate``, never after (the report's engines cache
    no prefixes at all: on CUDA the start-up warm-up leaves its prompts' blocks cached).
    """
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks, "the engine must be idle"
    storage, forward, device = engine.storage, engine.runner.model, engine.runner.device
    bs = storage.block_size
    num_blocks = -(-len(ids) // bs)
    assert num_blocks <= storage.num_blocks, "the text does not fit in the pool"
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    out, tops = [], []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        n = end - start
        positions = torch.arange(start, end, device=device)
        rows = torch.arange(n, device=device)
        batch = InputBatch(
            input_ids=torch.tensor(ids[start:end], device=device),
            positions=positions,
            slot_mapping=positions.clone(),  # blocks 0, 1, ...: slot == position
            attn=AttentionMetadata(
                num_decodes=1 if n == 1 else 0,
                block_tables=table,
                seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                max_seq_len=end,
            ),
            logits_indices=rows,
            sampling=[],
            logits_are_all_rows=True,
        )
        logits = forward(batch, storage.key_caches, storage.value_caches)  # [n, vocab]
        logp = torch.log_softmax(logits.float(), dim=-1)
        out.append(logp[rows, torch.tensor(ids[start + 1 : end + 1], device=device)].cpu())
        tops.append(logp.argmax(dim=-1).cpu())
    return torch.cat(out), torch.cat(tops)


def round_stores_to_bfloat16(llm: LLM) -> None:
    """Round every K/V row this engine stores to bfloat16 and back (``--rounding-floor``).

    Benchmark-only instrumentation of the reference attention path's store (the engine
    must run ``attention_backend="torch"``, whose stores all go through
    ``PagedAttention.store``): the cache stays float32, its contents carry a 16-bit
    cache's rounding."""
    attention = llm.engine.runner.model.attention
    assert llm.engine.attention_backend == "torch", "the rounding floor needs the torch path"
    store = attention._store_kv

    def rounded(key: torch.Tensor, value: torch.Tensor, *args: object) -> None:
        bf16 = torch.bfloat16
        store(key.to(bf16).to(key.dtype), value.to(bf16).to(value.dtype), *args)

    attention._store_kv = rounded


ROUNDING_FLOOR = "auto, K/V rounded to bfloat16"


def quality_modes(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(label, KV dtype, key offsets) of each engine the quality report builds: ``auto``
    first, then the rounding floor with ``--rounding-floor``, then each dtype, each followed
    by its key-offset row with ``--ab-key-offsets``."""
    modes = [("auto", "auto", False)]
    if args.rounding_floor:
        modes.append((ROUNDING_FLOOR, "auto", False))
    for kv in args.dtypes:
        modes.append((kv, kv, False))
        if args.ab_key_offsets:
            modes.append((f"{kv} (key offsets)", kv, True))
    return modes


def quality(args: argparse.Namespace) -> list[QualityResult]:
    runs: dict[str, tuple[torch.Tensor, list[list[int]], int, list[list[int]], str]] = {}
    margins: list[list[float]] = []  # auto's top-2 margin per prompt and position
    base_tokens: list[list[int]] = []
    for label, kv, offsets in quality_modes(args):
        floor = label == ROUNDING_FLOOR
        llm = make_llm(
            kv,
            args,
            num_kv_blocks=256,
            kv_key_offsets=offsets,
            enable_prefix_caching=False,
            **({"attention_backend": "torch"} if floor else {}),
        )
        if floor:
            round_stores_to_bfloat16(llm)
        tok = llm.tokenizer
        if tok is None:
            raise ModelError(f"{args.model} has no tokenizer: --quality scores text")
        passage = tok.encode(topics[PPL_TOPIC], add_special_tokens=False)[: args.ppl_tokens]
        prompts = [
            tok.encode(topics[t], add_special_tokens=False)[: args.prompt_len]
            for t in (PROMPT_TOPICS + EXTRA_PROMPT_TOPICS)[: args.prompts]
        ]
        lp = target_logprobs(llm, passage, args.chunk)
        # The top token at each of auto's greedy tokens, teacher-forced (auto's own: none).
        forced = (
            [
                score(llm, p + t, args.chunk)[1][len(p) - 1 :].tolist()
                for p, t in zip(prompts, base_tokens, strict=True)
            ]
            if base_tokens
            else []
        )
        params = SamplingParams(
            max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=2
        )
        outs = llm.generate(prompts, params)
        if label == "auto":  # the first engine: the reference the others are read against
            margins = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
            base_tokens = [o.token_ids for o in outs]
            forced = base_tokens
        per_token = llm.engine.kv_capacity.bytes_per_token
        backend = llm.engine.attention_backend
        runs[label] = (lp, [o.token_ids for o in outs], per_token, forced, backend)
        print(
            f"# {label}: {args.dtype} on {args.device}, backend {backend}, "
            f"{len(passage)} passage tokens",
            flush=True,
        )
        llm.shutdown()
        del llm
        free_device_memory(args.device)
    base_lp = runs["auto"][0]
    base_ppl = math.exp(-float(base_lp.mean()))
    results = []
    for kv, (lp, tokens, per_token, forced, backend) in runs.items():
        ppl = math.exp(-float(lp.mean()))
        prefix = [common_prefix(a, b) for a, b in zip(tokens, base_tokens, strict=True)]
        diff = (lp - base_lp).abs()
        # Positions of auto's text where the mode's top token differs, with auto's margin.
        differ = [
            m[i]
            for f, b, m in zip(forced, base_tokens, margins, strict=True)
            for i in range(len(b))
            if f[i] != b[i]
        ]
        positions = sum(len(b) for b in base_tokens)
        results.append(
            QualityResult(
                kv_cache_dtype=kv,
                attention_backend=backend,
                bytes_per_token=per_token,
                perplexity=ppl,
                perplexity_change=ppl / base_ppl - 1,
                mean_abs_logprob_diff=float(diff.mean()),
                max_abs_logprob_diff=float(diff.max()),
                greedy_prefix=prefix,
                greedy_agreement=sum(prefix) / (len(prefix) * args.tokens),
                forced_agreement=1 - len(differ) / positions,
                forced_max_margin=round(max(differ, default=0.0), 4),
                divergence_margins=[
                    round(m[n], 4) for m, n in zip(margins, prefix, strict=True) if n < args.tokens
                ],
            )
        )
    return results


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def throughput(args: argparse.Namespace) -> list[ThroughputResult]:
    results = []
    rounds = [(run, kv) for run in range(1, args.repeat + 1) for kv in ["auto", *args.dtypes]]
    for run, kv in rounds:
        llm = make_llm(
            kv, args, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.num_requests
        )
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.model_config.vocab_size
        prompts = [
            torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=g).tolist()
            for _ in range(args.num_requests)
        ]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        running: list[int] = []
        out_tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                out_tokens += len(out.new_token_ids)
            running.append(len(engine.scheduler.running))
            if args.progress and len(running) % 100 == 0:
                print(
                    f"# {kv}: step {len(running)}, {out_tokens} output tokens, "
                    f"{time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
        wall = time.perf_counter() - t0
        total = out_tokens + args.num_requests * args.prompt_tokens
        results.append(
            ThroughputResult(
                run=run,
                kv_cache_dtype=kv,
                kv_tokens=engine.kv_capacity.num_tokens,
                wall_s=wall,
                output_tokens_per_s=out_tokens / wall,
                total_tokens_per_s=total / wall,
                mean_running=sum(running) / len(running),
                max_running=max(running),
                preemptions=engine.scheduler.num_preemptions_total,
            )
        )
        print(f"# {kv}: {results[-1]}", flush=True)
        llm.shutdown()
        del llm, engine
        free_device_memory(args.device)
    return results


def capacity(args: argparse.Namespace) -> list[CapacityResult]:
    """Each dtype's pool at ``--kv-cache-memory``, from the engine that would serve it."""
    results: list[CapacityResult] = []
    for kv in ["auto", *args.dtypes]:
        # Nothing runs on these engines: no CUDA graphs to capture.
        llm = make_llm(kv, args, kv_cache_memory=args.kv_cache_memory, enforce_eager=True)
        cap = llm.engine.kv_capacity
        base = results[0].kv_tokens if results else cap.num_tokens
        results.append(
            CapacityResult(
                kv_cache_dtype=kv,
                bytes_per_token=cap.bytes_per_token,
                num_blocks=cap.num_blocks,
                kv_tokens=cap.num_tokens,
                ratio=cap.num_tokens / base,
            )
        )
        print(f"# {kv}: {cap.describe()}", flush=True)
        llm.shutdown()
        del llm
        free_device_memory(args.device)
    return results


PROG = "python -m benchmarks.kv_quant"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: each invalid combination is one line and exit status 2.
    ``dtype`` comes back resolved (float32 on the CPU, bfloat16 on CUDA, unless given) and
    ``dtypes`` as a list."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--quality", action="store_true", help="perplexity and greedy agreement")
    p.add_argument("--throughput", action="store_true", help="KV-bound batch throughput")
    p.add_argument("--capacity", action="store_true", help="each dtype's pool at --kv-cache-memory")
    p.add_argument(
        "--model",
        default="default",
        help="'default' (the embedded model), an HF directory or a .gguf file; with "
        f"--load-format dummy also a shape preset ({', '.join(sorted(PRESETS))})",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights (--capacity and --throughput only)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="the model's dtype, and auto's KV cache dtype (default: float32 on cpu, "
        "bfloat16 on cuda)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "triton", "cpu", "torch"),
        help="auto: Triton on cuda; on cpu the C++ kernels in float32, else torch",
    )
    p.add_argument("--dtypes", default="int8,fp8", help="KV dtypes to compare with auto")
    p.add_argument(
        "--ab-key-offsets",
        action="store_true",
        help="--quality: also run each dtype with the calibrated key offsets",
    )
    p.add_argument(
        "--rounding-floor",
        action="store_true",
        help="--quality, float32 only: also run auto with its K/V rounded to bfloat16 (the "
        "reference path)",
    )
    p.add_argument("--ppl-tokens", type=int, default=1024, help="passage length (tokens)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk when scoring")
    p.add_argument(
        "--prompts",
        type=int,
        default=len(PROMPT_TOPICS),
        help=f"greedy prompts (at most {len(PROMPT_TOPICS) + len(EXTRA_PROMPT_TOPICS)})",
    )
    p.add_argument("--prompt-len", type=int, default=96, help="greedy prompts' tokens")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=300 * 2**20,
        help="bytes, --throughput and --capacity (default 300 MiB: a few of the default "
        "model's float32 requests; 4294967296 = 4 GiB bounds an 8B shape's bfloat16 batch)",
    )
    p.add_argument("--progress", action="store_true", help="a line every 100 steps")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="--throughput: rounds, each running every dtype once (auto, int8, auto, ...): "
        "on a shared machine, compare the rows of one round",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if not 1 <= args.prompts <= len(PROMPT_TOPICS) + len(EXTRA_PROMPT_TOPICS):
        p.error(f"--prompts must be 1..{len(PROMPT_TOPICS) + len(EXTRA_PROMPT_TOPICS)}")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if not (args.quality or args.throughput or args.capacity):
        p.error("give --quality, --throughput and/or --capacity")
    if args.quality and args.load_format == "dummy":
        p.error(
            "--quality needs real weights and text, and --load-format dummy gives random "
            "ones: drop it (--capacity and --throughput take dummy weights)"
        )
    if args.rounding_floor and args.dtype != "float32":
        p.error(
            f"--rounding-floor rounds a float32 cache to bfloat16; with --dtype {args.dtype} "
            "auto's cache is 16-bit already: drop it"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (ModelError, SetupError) as exc:  # a --model or other option to change: one line
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if "gguf" not in str(exc).lower():
            raise
        print(
            f"{PROG}: error: {args.model} is (or converts from) a GGUF file, which needs the "
            "gguf package: pip install gguf (benchmarks/README.md: on a GPU machine, carry "
            "its wheel)",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def run(args: argparse.Namespace) -> dict[str, object]:
    """Each asked-for section, its table printed as it completes; the JSON report."""
    ref = reference_label(args)
    report: dict[str, object] = {
        "setup": {
            "model": args.model,
            "load_format": args.load_format,
            "device": args.device,
            "dtype": args.dtype,
            "attention_backend": args.attention_backend,
            "reference": ref,
        }
    }
    if args.capacity:
        c = capacity(args)
        report["capacity"] = [asdict(r) for r in c]
        mib = args.kv_cache_memory / 2**20
        print(f"# {args.model}, {args.dtype} on {args.device}, --kv-cache-memory {mib:.0f} MiB")
        print(f"| KV dtype | bytes/token | blocks | pool tokens | vs {ref} |")
        print("|---|---|---|---|---|")
        for cr in c:
            label = ref if cr.kv_cache_dtype == "auto" else cr.kv_cache_dtype
            print(
                f"| {label} | {cr.bytes_per_token} | {cr.num_blocks} | {cr.kv_tokens} | "
                f"{cr.ratio:.2f}x |"
            )
    if args.quality:
        q = quality(args)
        report["quality"] = [asdict(r) for r in q]
        print(
            f"| KV dtype | backend | bytes/token | perplexity | vs {ref} | mean abs Δ logprob "
            f"| max | greedy prefix agreement with {ref} (first {args.tokens}) | per prompt | "
            f"{ref}'s top-2 margin where they diverge | agreement on {ref}'s text | {ref}'s "
            "largest margin where that differs |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in q:
            label = ref if r.kv_cache_dtype == "auto" else r.kv_cache_dtype
            print(
                f"| {label} | {r.attention_backend} | {r.bytes_per_token} | "
                f"{r.perplexity:.4f} | {r.perplexity_change:+.3%} | "
                f"{r.mean_abs_logprob_diff:.4f} | {r.max_abs_logprob_diff:.3f} | "
                f"{r.greedy_agreement:.1%} | {' '.join(map(str, r.greedy_prefix))} | "
                f"{' '.join(map(str, r.divergence_margins)) or '-'} | "
                f"{r.forced_agreement:.1%} | {r.forced_max_margin} |"
            )
        if args.prompts > len(PROMPT_TOPICS):
            n = len(PROMPT_TOPICS)
            for r in q:
                first = sum(r.greedy_prefix[:n]) / (n * args.tokens)
                label = f"greedy agreement over the first {n} prompts"
                print(f"# {r.kv_cache_dtype}: {label} {first:.1%}")
    if args.throughput:
        t = throughput(args)
        report["throughput"] = [asdict(r) for r in t]
        base = {tr.run: tr.output_tokens_per_s for tr in t if tr.kv_cache_dtype == "auto"}
        print(
            f"| run | KV dtype | pool tokens | wall s | output tok/s | vs {ref} | total tok/s | "
            "mean running | max running | preemptions |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for tr in t:
            label = ref if tr.kv_cache_dtype == "auto" else tr.kv_cache_dtype
            print(
                f"| {tr.run} | {label} | {tr.kv_tokens} | {tr.wall_s:.1f} | "
                f"{tr.output_tokens_per_s:.1f} | {tr.output_tokens_per_s / base[tr.run]:.2f}x | "
                f"{tr.total_tokens_per_s:.0f} | {tr.mean_running:.1f} | {tr.max_running} | "
                f"{tr.preemptions} |"
            )
    return report


if __name__ == "__main__":
    raise SystemExit(main())
