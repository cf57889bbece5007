"""Prefix caching on vs off: a shared system prompt at concurrency 16, offline.

    python -m benchmarks.prefix_caching                    # the embedded default model
    python -m benchmarks.prefix_caching --max-tokens 64 --json

The shared-prefix workload: ``--num-requests`` requests (16) share a ``--system-len``-token
system prompt (400) and differ afterwards (a short distinct question each); all of them are
submitted at once, so the concurrency is the request count. Each mode runs in a fresh
engine, so the cache starts cold; the same requests are then run a second time with new
questions ("warm": the system prompt is already cached when they arrive, as for a server
that has been up for a while).

Measured in the step loop (``LLMEngine.add_request`` / ``step``, what ``LLM.generate``
does): TTFT = time from submission to each request's first token (p50 and p90 over the
requests); output tokens/s = output tokens / wall time of the run; hit rate = prefix-cache
hit tokens / queried tokens; prefill = prompt tokens actually computed. Greedy, EOS
ignored, so both modes produce the same number of tokens; the report says whether their
tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass

import torch

from benchmarks.wave import run_wave
from engine.llm import LLM
from scheduler.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from scheduler.request import SamplingParams

SYSTEM_TEXT = """\
You are the help desk assistant of a city library. Answer questions about opening hours,
borrowing rules, events, rooms and the catalogue, briefly and kindly, and say so when you do
not know. Members borrow up to twelve items for three weeks and may renew twice online unless
an item is reserved. Late fees are ten cents a day for books and a dollar a day for films,
capped at the item's price. The main branch opens at nine and closes at eight on weekdays and
at five on Saturdays; it is closed on Sundays and public holidays. Story time for children is
on Tuesday and Thursday mornings. Study rooms may be booked for two hours a day. Printing costs
fifteen cents a page, fifty in colour. There is free wireless internet, a maker space with two
3D printers, a seed library in spring and e-reader classes on the first Monday of the month.
"""
QUESTIONS = [
    "When do you open on Saturday", "How many books can I borrow", "Is there story time",
    "How much does printing cost", "Can I renew a film online", "Do you have wifi",
    "I lost my library card", "Where can I study quietly", "Are you open on Sunday",
    "What is the late fee for a book", "Can I donate old books", "Do you have a 3D printer",
    "When are the e-reader classes", "What is the seed library", "How long is a loan",
    "Who runs the children's room", "Can I book a room for a meeting", "Do you sell books",
]  # fmt: skip


@dataclass(slots=True)
class RunResult:
    mode: str  # "off", "on (cold)", "on (warm)", ...
    ttft_p50_ms: float
    ttft_p90_ms: float
    seconds: float
    output_tokens: int
    output_tokens_per_s: float
    prefill_tokens: int
    hit_rate: float


def make_prompts(llm: LLM, num_requests: int, system_len: int, round_: int) -> list[list[int]]:
    """The system prompt (``system_len`` tokens of SYSTEM_TEXT), then a distinct question."""
    tok = llm.tokenizer
    if tok is None:  # a tokenizer-less test model: deterministic ids
        system = [3 + (i * 37) % 250 for i in range(system_len)]
        return [system + [3 + (round_ * 97 + r * 13 + j) % 250 for j in range(12)]
                for r in range(num_requests)]  # fmt: skip
    system = tok.encode(SYSTEM_TEXT * (1 + system_len // 100), add_special_tokens=False)
    if len(system) < system_len:
        raise ValueError(f"the system text has only {len(system)} tokens")
    system = system[:system_len]
    prompts = []
    for r in range(num_requests):
        question = QUESTIONS[(r + round_ * 7) % len(QUESTIONS)]
        text = f"\nQuestion {round_ * num_requests + r + 1}: {question}?\nAnswer:"
        prompts.append(system + tok.encode(text, add_special_tokens=False))
    return prompts


def run(
    llm: LLM, prompts: list[list[int]], max_tokens: int, mode: str
) -> tuple[RunResult, list[list[int]]]:
    """Submit every prompt at once and step until all finish; time each first token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.kv_manager.stats()
    wave = run_wave(engine, prompts, params, tag=mode)
    after = engine.kv_manager.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    ttfts = sorted(s * 1e3 for s in wave.first_token_s)
    result = RunResult(
        mode=mode,
        ttft_p50_ms=statistics.median(ttfts),
        ttft_p90_ms=ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))],
        seconds=wave.seconds,
        output_tokens=wave.output_tokens,
        output_tokens_per_s=wave.output_tokens / wave.seconds,
        prefill_tokens=wave.total("num_prefill_tokens"),
        hit_rate=hits / queries if queries else 0.0,
    )
    return result, wave.tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefix_caching", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=16, help="also the concurrency")
    ap.add_argument("--system-len", type=int, default=400, help="shared system-prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)

    results: list[RunResult] = []
    outputs: dict[str, list[list[int]]] = {}
    for enable in (False, True):
        llm = LLM(
            args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=enable,
            max_num_seqs=max(64, args.num_requests),
            max_num_batched_tokens=args.max_num_batched_tokens,
        )  # fmt: skip
        # Warm-up on unrelated tokens: first calls pay for lazy initialisation, and the
        # system prompt must not be cached before the cold run.
        llm.generate([[5, 6, 7, 8] * 8], SamplingParams(max_tokens=4, temperature=0.0))
        name = "on" if enable else "off"
        for round_, phase in enumerate(("cold", "warm")):
            prompts = make_prompts(llm, args.num_requests, args.system_len, round_)
            result, tokens = run(llm, prompts, args.max_tokens, f"{name} ({phase})")
            results.append(result)
            outputs[result.mode] = tokens
        del llm

    by_mode = {r.mode: r for r in results}
    identical = all(outputs[f"on ({p})"] == outputs[f"off ({p})"] for p in ("cold", "warm"))
    ratios = {
        phase: {
            "ttft_p50_off_over_on": by_mode[f"off ({phase})"].ttft_p50_ms
            / by_mode[f"on ({phase})"].ttft_p50_ms,
            "tokens_per_s_on_over_off": by_mode[f"on ({phase})"].output_tokens_per_s
            / by_mode[f"off ({phase})"].output_tokens_per_s,
        }
        for phase in ("cold", "warm")
    }
    if args.json:
        print(json.dumps({"args": vars(args), "threads": torch.get_num_threads(),
                          "results": [asdict(r) for r in results], "ratios": ratios,
                          "greedy_identical": identical}, indent=2))  # fmt: skip
        return 0
    print(
        f"{args.num_requests} requests at once, {args.system_len}-token shared system prompt, "
        f"{args.max_tokens} output tokens each, {torch.get_num_threads()} threads"
    )
    header = f"{'prefix caching':16}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'out tok/s':>11}"
    print(header + f"{'hit rate':>10}{'prefill tok':>13}{'seconds':>9}")
    for r in results:
        print(f"{r.mode:16}{r.ttft_p50_ms:>13.0f}{r.ttft_p90_ms:>13.0f}"
              f"{r.output_tokens_per_s:>11.1f}{r.hit_rate:>10.1%}{r.prefill_tokens:>13}"
              f"{r.seconds:>9.1f}")  # fmt: skip
    for phase, ratio in ratios.items():
        print(f"{phase}: TTFT p50 {ratio['ttft_p50_off_over_on']:.2f}x lower with caching, "
              f"output tokens/s {ratio['tokens_per_s_on_over_off']:.2f}x")  # fmt: skip
    print(f"greedy tokens identical on vs off: {identical}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
