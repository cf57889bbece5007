"""Speculative decoding on vs off, on the embedded default model (bounded: minutes on CPU).

    python -m benchmarks.speculative                  # all parts, prints a table
    python -m benchmarks.speculative --skip-draft --out results/speculative.json
    python -m benchmarks.speculative --skip-draft --concurrency "" --threads 1  # busy machine
    python -m benchmarks.speculative --device cuda --dtype bfloat16             # on a GPU
    python -m benchmarks.speculative --device cuda --model llama-3.2-1b --load-format dummy \
        --skip-draft                 # a preset's shapes, random weights: the cost side only

Each part is measured with speculation off and on in two engines built side by side in this
process from the same model and flags, the "off" one without speculation: on CUDA it keeps
what the engine does by default (asynchronous scheduling, which speculation turns off:
engine/config.py ``async_scheduling_for``), so "off" is what a user gets without the flag.
Runs alternate between them (A, B, B, A, ...), greedy, prefix caching off so no run warms
the next:

1. **Input-grounded, concurrency 1.** Copy a passage of Python's own documentation
   (loadtest/workloads.py ``grounded_prompt``): the output repeats the prompt, the case
   n-gram prompt lookup is for. TPOT (first token to last / (tokens - 1)) off vs on.
2. **Free generation, concurrency 1.** Chat-template story prompts: little to copy; the
   acceptance-aware k (engine/spec_decode/policy.py: one-draft probes between pauses)
   should keep the cost of failed proposals small.
3. **Concurrency 16 and 64.** Waves of grounded and free prompts together, EOS ignored:
   output tokens per second over the wave, and over its decode phase (after every request
   has its first token); each mode ``--repeats`` times, the fastest run counting. The
   auto-disable rule (engine/spec_decode/policy.py) decides how
   much these speculate.
4. **Draft model.** The model as target, its first ``--draft-layers`` layers as the draft
   (engine/spec_decode/truncate.py), on parts 1 and 2: it shows the machinery; a truncated
   draft is not a trained one. It needs a checkpoint to truncate (not with
   ``--load-format dummy``).

Greedy outputs with speculation must equal those without (the near-tie rule aside; in
bfloat16 the two engines' steps round differently more often): the table says whether they
did. Acceptance = accepted drafts / verified drafts. The c=1 parts also give the process's
CPU time per output token (every thread), the work done, which a busy shared machine
disturbs less than TPOT; TPOT is what the targets are set on. With random weights
(``--load-format dummy``) acceptance says nothing about real text: such a run measures what
verification and the loss of asynchronous scheduling cost. A model without a tokenizer
(a preset) takes the default model's (``--tokenizer`` overrides), whose ids fit any
vocabulary at least as large.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import wave as engine_wave
from engine.llm import LLM
from engine.loader import resolve_model
from engine.outputs import RequestOutput
from engine.presets import preset
from engine.spec_decode.truncate import write_truncated_checkpoint
from loadtest.workloads import GROUNDED_MODULES, grounded_passage, grounded_prompt
from scheduler.request import SamplingParams

STORY_TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to bake bread",
    "two friends lost in a mountain storm",
    "a city where it never stops raining",
)


@dataclass
class Run:
    """One measured run: its outputs and the speculation counters over it."""

    seconds: float
    output_tokens: int
    tpot_s: float | None = None  # concurrency 1 only
    cpu_per_token_s: float | None = None  # concurrency 1: the process's CPU time (every
    # thread) from the first token to the last / (tokens - 1), as TPOT
    decode_tokens_per_s: float | None = None  # waves only
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    tokens: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def run_wave(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    """All prompts at once, stepped to the end."""
    cpu_first: list[float] = []  # the process's CPU time when the first token came

    def on_step(outputs: list[RequestOutput]) -> None:
        if not cpu_first and any(out.new_token_ids for out in outputs):
            cpu_first.append(time.process_time())

    tag = f"bench-{time.monotonic_ns()}"
    wave = engine_wave.run_wave(llm.engine, prompts, params, tag=tag, on_step=on_step)
    cpu_last = time.process_time()
    run = Run(
        wave.seconds,
        wave.output_tokens,
        draft_tokens=wave.total("num_draft_tokens"),
        accepted_tokens=wave.total("num_accepted_tokens"),
        verifications=wave.total("num_spec_verifications"),
        tokens=wave.tokens,
    )
    if len(prompts) == 1:
        (n,) = map(len, run.tokens)
        (times,) = wave.token_times
        run.tpot_s = (times[-1] - times[0]) / (n - 1) if n > 1 else None
        if n > 1 and cpu_first:
            run.cpu_per_token_s = (cpu_last - cpu_first[0]) / (n - 1)
    else:
        # The decode phase starts once every request has its first token; with EOS ignored
        # and one max_tokens for all, every request emits all but its first after it.
        decode_start = max(times[0] for times in wave.token_times)
        after = run.output_tokens - len(prompts)
        span = max(times[-1] for times in wave.token_times) - decode_start
        run.decode_tokens_per_s = after / span if span > 0 else None
    return run


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tok.encode(rendered, add_special_tokens=False))


def grounded_ids(llm: LLM, index: int, words: int) -> list[int]:
    module = GROUNDED_MODULES[index % len(GROUNDED_MODULES)]
    return llm.encode(grounded_prompt(grounded_passage(module, 37 * index, words)))


def story_ids(llm: LLM, index: int) -> list[int]:
    return chat_ids(llm, f"Write a short story about {STORY_TOPICS[index % len(STORY_TOPICS)]}.")


def compare_c1(
    plain: LLM, spec: LLM, prompts: list[list[int]], max_tokens: int
) -> dict[str, object]:
    """Each prompt alone, off (``plain``) and on (``spec``), alternating which goes first."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    off: list[Run] = []
    on: list[Run] = []
    for i, prompt in enumerate(prompts):
        order = (False, True) if i % 2 == 0 else (True, False)
        for mode in order:
            (on if mode else off).append(run_wave(spec if mode else plain, [prompt], params))
    return summarize(off, on, per_token=True)


def compare_wave(
    plain: LLM, spec: LLM, prompts: list[list[int]], max_tokens: int, repeats: int
) -> dict[str, object]:
    """The wave off and on, ``repeats`` times each in the order off, on, on, off, ...; the
    fastest run of each mode counts (a busy shared machine only ever slows a run down)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runs: dict[bool, list[Run]] = {False: [], True: []}
    for i in range(repeats):
        for mode in (False, True) if i % 2 == 0 else (True, False):
            runs[mode].append(run_wave(spec if mode else plain, prompts, params))
    best = {mode: min(r, key=lambda run: run.seconds) for mode, r in runs.items()}
    out = summarize([best[False]], [best[True]], per_token=False)
    out["seconds_off"] = [round(r.seconds, 2) for r in runs[False]]
    out["seconds_on"] = [round(r.seconds, 2) for r in runs[True]]
    return out


def summarize(off: list[Run], on: list[Run], *, per_token: bool) -> dict[str, object]:
    pairs = [p for x, y in zip(off, on, strict=True) for p in zip(x.tokens, y.tokens, strict=True)]
    identical = sum(a == b for a, b in pairs)
    total = sum(len(x.tokens) for x in off)
    drafts = sum(r.draft_tokens for r in on)
    accepted = sum(r.accepted_tokens for r in on)
    verifications = sum(r.verifications for r in on)
    out: dict[str, object] = {
        "identical_outputs": f"{identical}/{total}",
        "acceptance": accepted / drafts if drafts else None,
        "mean_accepted_length": 1 + accepted / verifications if verifications else None,
        "verified_drafts": drafts,
        "output_tokens": sum(r.output_tokens for r in on),
    }
    if per_token:
        tpot_off = statistics.median(r.tpot_s for r in off if r.tpot_s is not None)
        tpot_on = statistics.median(r.tpot_s for r in on if r.tpot_s is not None)
        out |= {"tpot_off_ms": 1e3 * tpot_off, "tpot_on_ms": 1e3 * tpot_on,
                "tpot_ratio_off_over_on": tpot_off / tpot_on}  # fmt: skip
        # CPU time per output token, all threads: the work done, which a busy machine
        # disturbs less than the wall time (a team's waits spin briefly, then sleep).
        cpu_off = statistics.median(r.cpu_per_token_s for r in off if r.cpu_per_token_s)
        cpu_on = statistics.median(r.cpu_per_token_s for r in on if r.cpu_per_token_s)
        out |= {"cpu_per_token_off_ms": 1e3 * cpu_off, "cpu_per_token_on_ms": 1e3 * cpu_on,
                "cpu_ratio_off_over_on": cpu_off / cpu_on}  # fmt: skip
    else:
        (a,), (b,) = off, on
        out |= {
            "tokens_per_s_off": a.output_tokens / a.seconds,
            "tokens_per_s_on": b.output_tokens / b.seconds,
            "throughput_ratio_on_over_off": (b.output_tokens / b.seconds)
            / (a.output_tokens / a.seconds),
            "decode_tokens_per_s_off": a.decode_tokens_per_s,
            "decode_tokens_per_s_on": b.decode_tokens_per_s,
        }
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="default",
                    help="a checkpoint, 'default' (the embedded model), or with --load-format "
                         "dummy a shape preset (engine/presets.py)")  # fmt: skip
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer directory (default: the model's; for a preset, the "
                         "default model's)")  # fmt: skip
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"),
                    help="default: cuda when present")  # fmt: skip
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="default: bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    ap.add_argument("--num-kv-blocks", type=int, default=2048, help="each engine's pool")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--c1-prompts", type=int, default=2, help="prompts per c=1 part")
    ap.add_argument("--grounded-tokens", type=int, default=128, help="max_tokens, grounded c=1")
    ap.add_argument("--free-tokens", type=int, default=64, help="max_tokens, free c=1")
    ap.add_argument("--wave-tokens", type=int, default=32, help="max_tokens in the waves")
    ap.add_argument("--passage-words", type=int, default=150)
    ap.add_argument("--wave-passage-words", type=int, default=60)
    ap.add_argument("--concurrency", default="16,64", help="wave sizes")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode of each wave")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 makes the CPU time per token "
                         "a measure of work that other processes barely disturb")  # fmt: skip
    args = ap.parse_args(argv)
    if args.load_format == "dummy" and not args.skip_draft:
        ap.error("--load-format dummy has no checkpoint to truncate into a draft: add --skip-draft")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    try:
        args.waves = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        ap.error(f"--concurrency takes comma-separated integers, got {args.concurrency!r}")
    if args.tokenizer is None and args.load_format == "dummy" and preset(args.model) is not None:
        args.tokenizer = str(resolve_model("default").path)
    return args


def build_pair(args: argparse.Namespace, **speculative: Any) -> tuple[LLM, LLM]:
    """Two engines of the same model and flags, the second with ``speculative`` (LLM's
    speculative_* arguments) and the first without."""
    common = dict(
        model=args.model, load_format=args.load_format, tokenizer=args.tokenizer,
        device=args.device, dtype=args.dtype, enable_prefix_caching=False,
        num_kv_blocks=args.num_kv_blocks,
    )  # fmt: skip
    plain = LLM(**common)
    spec = LLM(**common, num_speculative_tokens=args.k, **speculative)
    return plain, spec


def describe(plain: LLM, spec: LLM) -> dict[str, object]:
    """What differs between the two engines besides speculation, and the speculation rules."""
    engine = spec.engine
    return {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "async_scheduling_off": plain.engine.async_scheduling,
        "async_scheduling_on": engine.async_scheduling,
        "max_step_tokens": engine.speculator.policy.max_step_tokens,
        "row_cost": engine.speculator.policy.row_cost,
    }


def warm_up(plain: LLM, spec: LLM, prompt: list[int]) -> None:
    """First-call costs (kernel loads, CUDA graphs' first replays), outside the figures."""
    for llm in (plain, spec):
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    result: dict[str, object] = {
        "model": args.model,
        "k": args.k,
        "threads": torch.get_num_threads(),
        "load_average_start": os.getloadavg(),
    }
    plain, llm = build_pair(args, speculative_method="ngram")
    vocab, tokenizer = plain.engine.model_config.vocab_size, plain.tokenizer
    if tokenizer is None:
        print("the model has no tokenizer: pass --tokenizer DIR", file=sys.stderr)
        return 2
    if len(tokenizer) > vocab:
        print(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab}: "
              "pass --tokenizer DIR with a smaller vocabulary", file=sys.stderr)  # fmt: skip
        return 2
    result["ngram"] = describe(plain, llm)
    print("ngram engines:", result["ngram"], flush=True)
    warm_up(plain, llm, grounded_ids(llm, 0, 20))
    n = args.c1_prompts
    grounded = [grounded_ids(llm, i, args.passage_words) for i in range(n)]
    stories = [story_ids(llm, i) for i in range(n)]
    result["ngram_grounded_c1"] = compare_c1(plain, llm, grounded, args.grounded_tokens)
    print("grounded c=1:", result["ngram_grounded_c1"], flush=True)
    result["ngram_free_c1"] = compare_c1(plain, llm, stories, args.free_tokens)
    print("free c=1:", result["ngram_free_c1"], flush=True)
    for c in args.waves:
        prompts = [
            grounded_ids(llm, i, args.wave_passage_words) if i % 2 == 0 else story_ids(llm, i)
            for i in range(c)
        ]
        result[f"ngram_wave_c{c}"] = compare_wave(
            plain, llm, prompts, args.wave_tokens, args.repeats
        )
        print(f"wave c={c}:", result[f"ngram_wave_c{c}"], flush=True)
    del plain, llm
    gc.collect()

    if not args.skip_draft:
        with tempfile.TemporaryDirectory() as tmp:
            draft_dir = write_truncated_checkpoint(
                resolve_model(args.model).path, Path(tmp) / "draft", args.draft_layers
            )
            plain, llm = build_pair(
                args, speculative_method="draft", speculative_model=str(draft_dir)
            )
            result["draft"] = describe(plain, llm) | {"draft_layers": args.draft_layers}
            print("draft engines:", result["draft"], flush=True)
            warm_up(plain, llm, grounded[0][:20])
            result["draft_grounded_c1"] = compare_c1(plain, llm, grounded, args.grounded_tokens)
            print("draft grounded c=1:", result["draft_grounded_c1"], flush=True)
            result["draft_free_c1"] = compare_c1(plain, llm, stories, args.free_tokens)
            print("draft free c=1:", result["draft_free_c1"], flush=True)
            del plain, llm
            gc.collect()
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result, indent=2, default=str))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
