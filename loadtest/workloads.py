"""Workloads: the seeded list of requests a sweep point sends.

A workload is a list of :class:`RequestSpec` built before any traffic is sent, so every sweep
point (and every server in a comparison) receives exactly the same prompts and output lengths.

Prompt length is a *target* in tokens. Prompts are random words from a fixed vocabulary of
short, common English words; tokenizers of Llama-family models (SentencePiece / byte-level
BPE) turn each of these, with its leading space, into one token. So with no calibration the
prompt for a target of T tokens has T words ("about 1 token per word"). When the server has a
``/tokenize`` endpoint, :mod:`loadtest.probe` measures the real tokens-per-word ratio and the
word count is scaled by it. The server's ``usage.prompt_tokens`` is recorded per request either
way, so the error of the estimate is visible in the results.

Each concern draws from its own named random stream (``"{seed}:prompt_len"``, ...), so changing
e.g. the output distribution does not change the prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest.distributions import LengthDist

# Short, frequent words: one token each (with the leading space) in Llama 2/3, Mistral,
# Qwen2 and SmolLM tokenizers. Order matters for reproducibility: append, never reorder.
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(  # de-duplicate, keeping first-seen order
        """
    the of and to in is was for on that with as by at from his her it an are were which be
    this has had not but have or its one all their new first two after also been they who
    time more other she would city there some into over can most when many these only where
    than about world out up may made year years three between during since people part
    under he then well both later you school each state such team through war end both back
    used known them four could own best long high just before group old called film way
    area work day life home while found water light house small great music place early book
    name field game power line main left right free road point side town land open hand head
    family body night king case form story level play close sea low red green blue black
    white dark hard clear river tree stone fire wind rain snow sun moon star cloud sky hill
    garden door window table chair paper letter word page voice color sound money market price
    bank trade plan rule law court army ship train car bus plane horse dog cat bird fish
    food bread milk tea wine salt sugar fruit apple rice corn seed leaf root flower grass
    wood iron gold silver glass cloth wool cotton silk rope wheel engine machine tool box bag
    cup plate knife fork spoon bed room wall floor roof bridge tower castle church temple
    garden farm field forest desert island lake ocean coast valley mountain bay port harbor
    """.split()
    )
)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload.

    Args:
        index: position in the workload (stable across sweep points and servers).
        prompt: the prompt text sent to ``/v1/completions``.
        prompt_len: target prompt length in tokens (an estimate; see module docstring).
        max_tokens: ``max_tokens`` sent; with ``ignore_eos`` it is the output length.
        arrival_s: trace replay only: when to send, in seconds after the first request.
        cancel_after_chunks: if set, the client hangs up after this many streamed chunks
            (to measure a server under client disconnects).
    """

    index: int
    prompt: str
    prompt_len: int
    max_tokens: int
    arrival_s: float | None = None
    cancel_after_chunks: int | None = None


def make_prompt(num_tokens: int, rng: random.Random, tokens_per_word: float = 1.0) -> str:
    """Random words whose tokenization is about ``num_tokens`` tokens long."""
    num_words = max(1, round(num_tokens / tokens_per_word))
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def synthetic_workload(
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    seed: int,
    tokens_per_word: float = 1.0,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
    cancel_fraction: float = 0.0,
    text_salt: str = "",
) -> list[RequestSpec]:
    """Build a reproducible synthetic workload.

    Args:
        num_requests: number of requests.
        prompt_len: distribution of prompt lengths; with a shared prefix, of the part after it.
        output_len: distribution of ``max_tokens``.
        seed: the same seed gives the same workload, byte for byte.
        tokens_per_word: measured or assumed tokens per vocabulary word.
        shared_prefix_len: if > 0, every prompt starts with one of ``num_prefixes`` long
            "system prompts" of this many tokens (request i uses prefix i % num_prefixes),
            which is what prefix caching can reuse.
        num_prefixes: number of distinct shared prefixes.
        cancel_fraction: fraction of requests (chosen at random) that the client abandons
            after a random number of chunks in [1, max_tokens - 1].
        text_salt: varies the prompts' words (not the shared prefixes) and nothing else:
            the same seed with another salt gives the same lengths and cancellations over
            different text, which a server's prefix cache has not seen.

    Returns:
        ``num_requests`` specs, indexed 0..n-1.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not 0.0 <= cancel_fraction <= 1.0:
        raise ValueError(f"cancel_fraction must be in [0, 1], got {cancel_fraction}")
    if shared_prefix_len < 0 or num_prefixes < 1:
        raise ValueError("shared_prefix_len must be >= 0 and num_prefixes >= 1")
    prompt_lens = prompt_len.sample_many(num_requests, random.Random(f"{seed}:prompt_len"))
    output_lens = output_len.sample_many(num_requests, random.Random(f"{seed}:output_len"))
    text_rng = random.Random(f"{seed}:prompt_text{text_salt}")
    prefix_rng = random.Random(f"{seed}:prefix_text")
    cancel_rng = random.Random(f"{seed}:cancel")
    prefixes = [
        make_prompt(shared_prefix_len, prefix_rng, tokens_per_word) if shared_prefix_len else ""
        for _ in range(num_prefixes)
    ]
    specs: list[RequestSpec] = []
    for i in range(num_requests):
        body = make_prompt(prompt_lens[i], text_rng, tokens_per_word)
        prefix = prefixes[i % num_prefixes]
        # NOTE: the prefix ends at a word boundary and the body starts with a space-led word,
        # so the prefix tokenizes identically in every request (prefix-cache hits are real).
        prompt = f"{prefix} {body}" if prefix else body
        cancel_after: int | None = None
        # Draw for every request (not only cancelled ones) so the choice for request i does
        # not depend on earlier requests' outcomes.
        draw, point = cancel_rng.random(), cancel_rng.random()
        if draw < cancel_fraction and output_lens[i] > 1:
            cancel_after = 1 + int(point * (output_lens[i] - 1))
        specs.append(
            RequestSpec(
                index=i,
                prompt=prompt,
                prompt_len=shared_prefix_len + prompt_lens[i],
                max_tokens=output_lens[i],
                cancel_after_chunks=cancel_after,
            )
        )
    return specs


def load_trace(
    path: str | Path,
    seed: int = 0,
    tokens_per_word: float = 1.0,
    max_requests: int | None = None,
    time_scale: float = 1.0,
) -> list[RequestSpec]:
    """Read a JSONL trace for replay.

    Each non-blank line (``#`` starts a comment line) is an object with:

    - ``arrival_s`` (number, default 0): send time in seconds; shifted so the first is 0;
    - ``prompt`` (string) or ``prompt_len`` (int: a synthetic prompt of that many tokens);
    - ``max_tokens`` (int, required).

    Args:
        path: the JSONL file.
        seed: seeds the synthetic prompts of ``prompt_len`` entries.
        tokens_per_word: as in :func:`synthetic_workload`.
        max_requests: keep only the first N entries (by arrival time).
        time_scale: divide arrival times by this (2.0 replays twice as fast).

    Returns:
        Specs sorted by arrival time, indexed in that order.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    rng = random.Random(f"{seed}:trace_text")
    entries: list[tuple[float, str, int, int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
                arrival = float(obj.get("arrival_s", 0.0))
                max_tokens = int(obj["max_tokens"])
                if "prompt" in obj:
                    prompt = str(obj["prompt"])
                    # Rough estimate only; usage.prompt_tokens gives the real count.
                    prompt_len = max(1, round(len(prompt.split()) * tokens_per_word))
                else:
                    prompt_len = int(obj["prompt_len"])
                    prompt = make_prompt(prompt_len, rng, tokens_per_word)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace entry ({exc!r})") from exc
            if max_tokens < 1 or arrival < 0:
                raise ValueError(f"{path}:{lineno}: max_tokens must be >= 1 and arrival_s >= 0")
            entries.append((arrival, prompt, prompt_len, max_tokens))
    if not entries:  # a sweep of nothing would report zeros as if it had run
        raise ValueError(f"{path}: the trace has no entries (one JSON object per line)")
    entries.sort(key=lambda e: e[0])  # stable: equal arrivals keep file order
    if max_requests is not None:
        entries = entries[:max_requests]
    t0 = entries[0][0] if entries else 0.0
    return [
        RequestSpec(
            index=i,
            prompt=prompt,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            arrival_s=(arrival - t0) / time_scale,
        )
        for i, (arrival, prompt, prompt_len, max_tokens) in enumerate(entries)
    ]


# ---- input-grounded prompts -------------------------------------------------------------

# Standard-library modules whose docstrings are long prose (with some code): every Python
# install ships them, so any machine builds the same texts (for one Python version).
GROUNDED_MODULES: tuple[str, ...] = (
    "argparse", "json", "heapq", "csv", "statistics", "sched",
    "copy", "hashlib", "timeit", "unittest", "configparser", "site",
)  # fmt: skip
# A task whose answer copies its input: the passage, then the start of its copy. The first
# words of the copy are given, so even a small model recognises the task; the output then
# repeats long spans of the prompt, as summaries, edits and quoting answers do.
GROUNDED_TEMPLATE = "Original text:\n{passage}\n\nThe same text, copied exactly:\n{lead}"
GROUNDED_LEAD_WORDS = 6
# Tokens per word of this English-and-code prose in Llama-family tokenizers (an estimate
# for ``RequestSpec.prompt_len``; the server's usage figures are recorded anyway).
GROUNDED_TOKENS_PER_WORD = 1.35


def grounded_passage(module: str, start: int, num_words: int) -> str:
    """``num_words`` words of a standard-library module's docstring from word ``start``
    (wrapping around), whitespace collapsed."""
    import importlib

    words = (importlib.import_module(module).__doc__ or module).split()
    start %= len(words)
    return " ".join((words[start:] + words[:start])[:num_words])


def grounded_prompt(passage: str) -> str:
    """The copy-task prompt for a passage (``GROUNDED_TEMPLATE``)."""
    lead = " ".join(passage.split()[:GROUNDED_LEAD_WORDS])
    return GROUNDED_TEMPLATE.format(passage=passage, lead=lead)


def grounded_workload(
    num_requests: int, output_len: LengthDist, seed: int, passage_words: int = 150
) -> list[RequestSpec]:
    """An input-grounded workload: each prompt is a passage of Python's own documentation
    and the start of its copy (``GROUNDED_TEMPLATE``), so a good answer repeats the prompt.
    This is the load speculative decoding by prompt lookup (n-gram) is for; send it to any
    OpenAI-compatible server to compare them on it.

    Args:
        num_requests: number of requests; request i uses module i mod 12, from a random word.
        output_len: distribution of ``max_tokens``.
        seed: the same seed gives the same prompts and lengths.
        passage_words: words per passage.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    rng = random.Random(f"{seed}:grounded")
    output_lens = output_len.sample_many(num_requests, random.Random(f"{seed}:output_len"))
    specs = []
    for i in range(num_requests):
        module = GROUNDED_MODULES[i % len(GROUNDED_MODULES)]
        passage = grounded_passage(module, rng.randrange(1_000_000), passage_words)
        prompt = grounded_prompt(passage)
        specs.append(
            RequestSpec(
                index=i,
                prompt=prompt,
                prompt_len=round(len(prompt.split()) * GROUNDED_TOKENS_PER_WORD),
                max_tokens=output_lens[i],
            )
        )
    return specs
