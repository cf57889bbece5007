"""Speculative decoding on vs off, on the embedded default model (bounded: minutes on CPU).

    python -m benchmarks.speculative                  # all parts, prints a table
    python -m benchmarks.speculative --skip-draft --out results/speculative.json
    python -m benchmarks.speculative --skip-draft --concurrency "" --threads 1  # busy machine

Parts, each measured with speculation off and on in the *same* engine (the speculator is
detached for the "off" runs, so weights, pool and threads are identical), alternating the
order per prompt, greedy, prefix caching off so no run warms the next:

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
4. **Draft model.** The default model as target, its first ``--draft-layers`` layers as the
   draft (engine/spec_decode/truncate.py), on parts 1 and 2: it shows the machinery; a
   truncated draft is not a trained one.

Greedy outputs with speculation must equal those without (the near-tie rule aside): the
table says whether they did. Acceptance = accepted drafts / verified drafts. The c=1 parts
also give the process's CPU time per output token (every thread), the work done, which a
busy shared machine disturbs less than TPOT; TPOT is what the targets are set on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import wave as engine_wave
from engine.llm import LLM
from engine.loader import resolve_model
from engine.outputs import RequestOutput
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


@contextmanager
def speculation(llm: LLM, on: bool) -> Iterator[None]:
    """Run with the engine's speculator attached (on) or detached (off)."""
    engine = llm.engine
    saved = engine.speculator
    engine.speculator = saved if on else None
    try:
        yield
    finally:
        engine.speculator = saved


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


def compare_c1(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
    """Each prompt alone, off and on (alternating which goes first)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    off: list[Run] = []
    on: list[Run] = []
    for i, prompt in enumerate(prompts):
        order = (False, True) if i % 2 == 0 else (True, False)
        for mode in order:
            with speculation(llm, mode):
                (on if mode else off).append(run_wave(llm, [prompt], params))
    return summarize(off, on, per_token=True)


def compare_wave(
    llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int
) -> dict[str, object]:
    """The wave off and on, ``repeats`` times each in the order off, on, on, off, ...; the
    fastest run of each mode counts (a busy shared machine only ever slows a run down)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runs: dict[bool, list[Run]] = {False: [], True: []}
    for i in range(repeats):
        for mode in (False, True) if i % 2 == 0 else (True, False):
            with speculation(llm, mode):
                runs[mode].append(run_wave(llm, prompts, params))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0]
    )
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
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    waves = [int(c) for c in args.concurrency.split(",") if c]

    result: dict[str, object] = {
        "k": args.k,
        "threads": torch.get_num_threads(),
        "load_average_start": os.getloadavg(),
    }
    llm = LLM("default", enable_prefix_caching=False, num_kv_blocks=2048,
              speculative_method="ngram", num_speculative_tokens=args.k)  # fmt: skip
    result["max_step_tokens"] = llm.engine.speculator.policy.max_step_tokens
    with speculation(llm, False):  # first-call costs
        llm.generate([grounded_ids(llm, 0, 20)], SamplingParams(max_tokens=4, temperature=0))
    n = args.c1_prompts
    grounded = [grounded_ids(llm, i, args.passage_words) for i in range(n)]
    stories = [story_ids(llm, i) for i in range(n)]
    result["ngram_grounded_c1"] = compare_c1(llm, grounded, args.grounded_tokens)
    print("grounded c=1:", result["ngram_grounded_c1"], flush=True)
    result["ngram_free_c1"] = compare_c1(llm, stories, args.free_tokens)
    print("free c=1:", result["ngram_free_c1"], flush=True)
    for c in waves:
        prompts = [
            grounded_ids(llm, i, args.wave_passage_words) if i % 2 == 0 else story_ids(llm, i)
            for i in range(c)
        ]
        result[f"ngram_wave_c{c}"] = compare_wave(llm, prompts, args.wave_tokens, args.repeats)
        print(f"wave c={c}:", result[f"ngram_wave_c{c}"], flush=True)
    del llm
    gc.collect()

    if not args.skip_draft:
        with tempfile.TemporaryDirectory() as tmp:
            draft_dir = write_truncated_checkpoint(
                resolve_model("default").path, Path(tmp) / "draft", args.draft_layers
            )
            llm = LLM("default", enable_prefix_caching=False, num_kv_blocks=1024,
                      speculative_method="draft", speculative_model=str(draft_dir),
                      num_speculative_tokens=args.k)  # fmt: skip
            with speculation(llm, False):
                llm.generate([grounded[0][:20]], SamplingParams(max_tokens=4, temperature=0))
            result["draft_layers"] = args.draft_layers
            result["draft_grounded_c1"] = compare_c1(llm, grounded, args.grounded_tokens)
            print("draft grounded c=1:", result["draft_grounded_c1"], flush=True)
            result["draft_free_c1"] = compare_c1(llm, stories, args.free_tokens)
            print("draft free c=1:", result["draft_free_c1"], flush=True)
            del llm
            gc.collect()
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result, indent=2, default=str))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
