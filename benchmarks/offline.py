"""Offline throughput: pagedserve's continuous batching vs transformers.generate().

    python -m benchmarks.offline                      # 64 requests, the embedded default model
    python -m benchmarks.offline --hf-requests 16     # time transformers on the first 16 only

Both sides run the same requests (mixed prompt and output lengths, seeded), greedy, with
EOS ignored so every request produces exactly its target length. pagedserve gets all of
them at once; transformers runs them one at a time, as a plain script would. The
transformers figure is output tokens / seconds over the requests it ran (a subset when
``--hf-requests`` is given: the lengths are drawn i.i.d., so the rate is comparable).
The report also says whether the greedy tokens of the requests both ran are identical.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from engine.llm import LLM
from engine.loader import resolve_model
from scheduler.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from scheduler.request import SamplingParams


def make_workload(
    num_requests: int,
    vocab_ids: list[int],
    seed: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; prompts are slices of real text."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        start = rng.randrange(0, max(1, len(vocab_ids) - n))
        prompt = (vocab_ids * (1 + n // max(1, len(vocab_ids))))[start : start + n]
        work.append((prompt, rng.randint(*output_range)))
    return work


def corpus_ids(tokenizer) -> list[int]:  # noqa: ANN001 - an HF tokenizer
    # Any English text works; this module's docstring and the stdlib's are at hand offline.
    import textwrap

    text = " ".join(
        textwrap.dedent(mod.__doc__ or "")
        for mod in (argparse, json, random, time, __import__("os"))
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def run_pagedserve(llm: LLM, work: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


@torch.inference_mode()
def run_transformers(model, work: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    tokens = []
    start = time.perf_counter()
    for prompt, n in work:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        tokens.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.offline", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument(
        "--hf-requests", type=int, default=None, help="run transformers on only the first N"
    )
    ap.add_argument("--prompt-len", default="16,256", help="min,max prompt tokens")
    ap.add_argument("--output-len", default="16,128", help="min,max output tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    prompt_range = tuple(int(x) for x in args.prompt_len.split(","))
    output_range = tuple(int(x) for x in args.output_len.split(","))

    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    work = make_workload(
        args.num_requests, corpus_ids(llm.tokenizer), args.seed, prompt_range, output_range
    )  # type: ignore[arg-type]
    # Warm-up: first calls pay for allocator growth and lazy initialisation.
    llm.generate([work[0][0]], SamplingParams(max_tokens=4, temperature=0))
    ps_time, ps_tokens = run_pagedserve(llm, work)
    ps_out = sum(len(t) for t in ps_tokens)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        resolve_model(args.model).path, dtype=torch.float32
    ).eval()
    hf_work = work[: args.hf_requests] if args.hf_requests else work
    hf_time, hf_tokens = run_transformers(hf, hf_work)
    hf_out = sum(len(t) for t in hf_tokens)
    identical = sum(a == b for a, b in zip(ps_tokens, hf_tokens, strict=False))

    result = {
        "threads": torch.get_num_threads(),
        "num_requests": len(work),
        "pagedserve": {
            "seconds": ps_time,
            "output_tokens": ps_out,
            "tokens_per_s": ps_out / ps_time,
        },
        "transformers_one_at_a_time": {
            "requests": len(hf_work),
            "seconds": hf_time,
            "output_tokens": hf_out,
            "tokens_per_s": hf_out / hf_time,
        },
        "ratio": (ps_out / ps_time) / (hf_out / hf_time),
        "greedy_identical": f"{identical}/{len(hf_work)}",
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{len(work)} requests, prompts {args.prompt_len} tokens, "
        f"outputs {args.output_len} tokens, "
        f"{result['threads']} threads"
    )
    print(f"{'':32}{'requests':>10}{'out tokens':>12}{'seconds':>10}{'tok/s':>10}")
    print(
        f"{'pagedserve (continuous)':32}{len(work):>10}{ps_out:>12}{ps_time:>10.1f}"
        f"{ps_out / ps_time:>10.1f}"
    )
    print(
        f"{'transformers (one at a time)':32}{len(hf_work):>10}{hf_out:>12}{hf_time:>10.1f}"
        f"{hf_out / hf_time:>10.1f}"
    )
    print(f"ratio: {result['ratio']:.2f}x   greedy tokens identical: {result['greedy_identical']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
