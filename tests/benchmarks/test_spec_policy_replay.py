"""The offline policy replay (benchmarks/spec_policy_replay.py) on synthetic outputs: a pure
copy of the prompt keeps every draft, an output with nothing to copy pays only the probes."""

from __future__ import annotations

import pytest

from benchmarks.spec_policy_replay import fixed_k, replay, score
from engine.spec_decode.policy import MIN_PAUSE, SpeculationPolicy

PROMPT = [*range(100), 49]  # ends where the copy starts: its first 2-gram (49, 50) matches
COPY = list(range(50, 91))  # 41 tokens copied from the prompt


def test_a_copy_keeps_every_draft_of_a_fixed_k():
    r = replay(PROMPT, COPY, fixed_k(4)(0.4), row_cost=0.4)
    # 40 tokens after the prefill's first: 8 steps of 4 kept drafts + the bonus token
    assert (r.tokens, r.drafts, r.kept) == (40, 32, 32)
    assert r.cost == pytest.approx(8 * (1 + 4 * 0.4))
    assert score([(PROMPT, COPY)], fixed_k(4), 0.4) == pytest.approx(40 / (8 * 2.6))


def test_the_acceptance_aware_policy_ramps_up_on_a_copy():
    r = replay(PROMPT, COPY, SpeculationPolicy(4, 16, row_cost=0.4), row_cost=0.4)
    assert r.kept == r.drafts  # every draft of a copy is right
    # it starts with a one-draft probe, so it spends less than always-4 but makes fewer tokens
    # a step; a copy this clean still beats plain decoding by far
    assert 40 / r.cost > 1.5


def test_nothing_to_copy_costs_only_the_probes():
    output = [1000 + i for i in range(60)]  # no 2-gram of it occurs earlier
    r = replay(PROMPT, output, SpeculationPolicy(4, 16, row_cost=0.4), row_cost=0.4)
    assert r.kept == 0
    # the n-gram lookup finds no earlier match: no draft at all, every step a plain decode
    assert (r.drafts, r.cost) == (0, 59)
    # A prompt whose 2-grams recur with other continuations: every draft misses, so after
    # the fresh one-draft probe the request pauses MIN_PAUSE steps, then probes again.
    prompt = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7]
    output = [8] + [t for i in range(20) for t in (7, 8, 100 + i)]  # (7, 8) then a new token
    r = replay(prompt, output, SpeculationPolicy(4, 16, row_cost=0.4), row_cost=0.4)
    assert r.drafts >= 2 and r.drafts <= 2 + r.tokens // MIN_PAUSE
    assert r.cost == pytest.approx(r.tokens - r.kept + 0.4 * r.drafts)
