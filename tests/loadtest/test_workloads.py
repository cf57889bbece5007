from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.distributions import LengthDist
from loadtest.workloads import WORDS, load_trace, synthetic_workload


def make(seed: int = 0, **kw: object) -> list:  # type: ignore[type-arg]
    args: dict[str, object] = {
        "num_requests": 50,
        "prompt_len": LengthDist.parse("uniform:10:40"),
        "output_len": LengthDist.parse("exponential:16:64"),
        "seed": seed,
    }
    args.update(kw)
    return synthetic_workload(**args)  # type: ignore[arg-type]


def test_same_seed_same_workload() -> None:
    assert make(3) == make(3)
    different = make(4)
    assert [s.prompt for s in different] != [s.prompt for s in make(3)]


def test_text_salt_changes_the_words_and_nothing_else() -> None:
    plain, salted = make(0), make(0, text_salt="point-1")
    assert make(0, text_salt="") == plain and make(0, text_salt="point-1") == salted
    assert [(s.prompt_len, s.max_tokens) for s in salted] == [
        (s.prompt_len, s.max_tokens) for s in plain
    ]
    assert all(a.prompt != b.prompt for a, b in zip(plain, salted, strict=True))
    # Shared prefixes stay shared (they are what a prefix cache is meant to reuse).
    a = make(0, shared_prefix_len=20)
    b = make(0, shared_prefix_len=20, text_salt="x")
    assert a[0].prompt.split()[:20] == b[0].prompt.split()[:20]


def test_streams_are_independent() -> None:
    # Changing the output distribution must not change the prompts (separate random streams).
    a = make(0)
    b = make(0, output_len=LengthDist.parse("fixed:5"))
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert {s.max_tokens for s in b} == {5}


def test_prompt_lengths_follow_target() -> None:
    specs = make(0)
    assert [s.index for s in specs] == list(range(50))
    for s in specs:
        words = s.prompt.split()
        assert len(words) == s.prompt_len  # ~1 token per word when not calibrated
        assert all(w in WORDS for w in words)
        assert 10 <= s.prompt_len <= 40 and 1 <= s.max_tokens <= 64


def test_calibrated_tokens_per_word_scales_word_count() -> None:
    for s in make(0, tokens_per_word=2.0):
        assert len(s.prompt.split()) == max(1, round(s.prompt_len / 2.0))


def test_shared_prefix() -> None:
    specs = make(0, shared_prefix_len=100, num_prefixes=2)
    prefixes = [" ".join(s.prompt.split()[:100]) for s in specs]
    assert len(set(prefixes[0::2])) == 1 and len(set(prefixes[1::2])) == 1
    assert prefixes[0] != prefixes[1]
    # prompt_len counts the prefix too (1 token per word when not calibrated)
    assert all(s.prompt_len == len(s.prompt.split()) for s in specs)
    # The part after the prefix differs between requests sharing a prefix.
    assert specs[0].prompt != specs[2].prompt


def test_cancel_fraction() -> None:
    specs = make(0, num_requests=400, cancel_fraction=0.25)
    cancelled = [s for s in specs if s.cancel_after_chunks is not None]
    assert 0.18 < len(cancelled) / len(specs) < 0.32
    assert all(1 <= s.cancel_after_chunks < s.max_tokens for s in cancelled)  # type: ignore[operator]
    assert all(s.cancel_after_chunks is None for s in make(0))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        make(0, cancel_fraction=1.5)
    with pytest.raises(ValueError):
        make(0, num_prefixes=0)


def test_load_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"arrival_s": 12.0, "prompt": "hello there world", "max_tokens": 4},
        {"arrival_s": 10.0, "prompt_len": 20, "max_tokens": 8},
        {"arrival_s": 11.0, "prompt_len": 5, "max_tokens": 2},
    ]
    path.write_text("# a comment\n\n" + "\n".join(json.dumps(x) for x in lines) + "\n")
    specs = load_trace(path, seed=1, time_scale=2.0)
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 1.0]  # sorted, shifted, scaled
    assert [s.max_tokens for s in specs] == [8, 2, 4]
    assert len(specs[0].prompt.split()) == 20 and specs[2].prompt == "hello there world"
    assert load_trace(path, seed=1, time_scale=2.0) == specs  # reproducible
    assert len(load_trace(path, max_requests=2)) == 2


def test_load_trace_rejects_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x"}\n')  # no max_tokens
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(path)
    path.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="the trace has no entries"):
        load_trace(path)


def test_grounded_workload_prompts_end_with_the_start_of_their_own_passage():
    from loadtest.workloads import GROUNDED_MODULES, grounded_workload

    output = LengthDist.parse("uniform:10:20")
    specs = grounded_workload(len(GROUNDED_MODULES) + 1, output, seed=3)
    assert specs == grounded_workload(len(GROUNDED_MODULES) + 1, output, seed=3)
    assert len({s.prompt for s in specs}) == len(specs)
    for spec in specs:
        head, lead = spec.prompt.split("\n\nThe same text, copied exactly:\n")
        passage = head.removeprefix("Original text:\n")
        assert passage.startswith(lead) and len(lead.split()) == 6
        assert len(passage.split()) == 150
        assert 10 <= spec.max_tokens <= 20
