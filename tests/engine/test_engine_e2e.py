"""The embedded SmolLM2-135M-Instruct through LLMEngine vs transformers' generate().

Eight prompts from 1 to 530 tokens; greedy output must be token-identical to transformers
(see tests/engine/parity.py for the one allowed near-tie slack) when generated together,
when added at different steps, and under heavy preemption in a tiny pool.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.step_replay import replay
from engine import LLM, SamplingParams
from engine.loader import resolve_model
from engine.step_trace import ENV as TRACE_ENV
from engine.step_trace import read_trace
from tests.engine.parity import Reference, assert_parity, hf_greedy

pytestmark = pytest.mark.slow  # the embedded default model

PROMPT_LENS = [1, 5, 23, 64, 130, 260, 400, 530]
MAX_TOKENS = 16
# float32 on the CPU wherever the suite runs (a CUDA machine's default is bfloat16 on the GPU,
# with 90% of free GPU memory for the KV cache); the default model's prompts here need ~100
# blocks of 16 tokens, so 256 blocks (about 190 MB) instead of the CPU default's 1 GiB.
DEVICE = {"device": "cpu", "dtype": "float32"}

TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
combined movable metal type, oil-based ink and a wooden press adapted from wine making.
Before him, books were copied by hand, a slow and costly process that kept literacy rare.
Within fifty years, presses had spread to more than two hundred cities across Europe, and
millions of volumes were in circulation. Pamphlets, newspapers and scientific journals
followed, changing how ideas moved between people.
In the kitchen, bread is one of the oldest prepared foods. Flour, water, salt and yeast are
mixed into a dough, kneaded to develop gluten, left to rise, shaped and baked. The crust
browns through the Maillard reaction, while steam in the oven keeps it from setting too early.
Mountains form where tectonic plates collide. The Himalayas are still rising by a few
millimetres every year as the Indian plate pushes north into Asia. Erosion by rivers and
glaciers works against this uplift, carving valleys and carrying sediment to the plains.
A good programmer writes code for the next reader. Clear names, small functions and tests
that describe behaviour make a program easier to change. Comments explain why a decision
was made, not what the code obviously does. Version control keeps a history of every change.
The ocean covers about seventy percent of the planet. Its currents carry heat from the
equator toward the poles, and its surface absorbs a large share of the carbon dioxide that
people release. Plankton at the base of the food web produce much of the oxygen we breathe.
Music theory describes how notes relate. A major scale follows a pattern of whole and half
steps; chords are built by stacking thirds; a cadence gives a phrase its sense of ending.
"""


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", num_kv_blocks=256, **DEVICE)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(TEXT * 2, add_special_tokens=False)
    assert len(ids) > max(PROMPT_LENS) + 40
    # Different starting offsets, so prompts are not prefixes of one another.
    return [ids[i * 5 : i * 5 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def references(llm: LLM, prompts: list[list[int]]) -> list[Reference]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model("default").path, dtype=torch.float32)
    return [hf_greedy(hf.eval(), p, MAX_TOKENS, llm.engine.eos_token_id) for p in prompts]


def _check(outputs: dict[int, list[int]], references: list[Reference]) -> None:
    for i, ref in enumerate(references):
        assert_parity(outputs[i], ref, label=f"prompt {i} ({PROMPT_LENS[i]} tokens)")


def test_together_matches_transformers(llm, prompts, references):
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    _check({i: o.token_ids for i, o in enumerate(outs)}, references)
    llm.engine.check_integrity()
    llm.engine.check_idle()
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def _drive(engine, prompts, arrivals: dict[int, list[int]], params) -> dict[int, list[int]]:
    """Add prompts at the given step numbers; check invariants after every step."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    pending = dict(arrivals)
    while pending or engine.has_unfinished_requests():
        for i in pending.pop(step, []):
            engine.add_request(f"r{i}", prompts[i], params)
        for out in engine.step():
            tokens[int(out.request_id[1:])].extend(out.new_token_ids)
        engine.check_integrity()
        if engine.has_unfinished_requests():
            with pytest.raises(AssertionError, match="requests left"):
                engine.check_idle()  # what the server runs when it believes it is idle
        step += 1
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.check_idle()
    return tokens


def test_staggered_arrivals_match_transformers(llm, prompts, references):
    arrivals = {0: [7, 0], 2: [3], 3: [5, 1], 9: [6], 12: [2, 4]}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    _check(_drive(llm.engine, prompts, arrivals, params), references)


def test_preemption_keeps_every_request_exact(prompts, references):
    """A pool that holds barely more than the largest request: preemption must happen many
    times, and every request still ends with exactly its own tokens. Small blocks make decodes
    cross block boundaries often, so running requests keep needing new blocks."""
    block_size = 4
    needed = -(-(max(PROMPT_LENS) + MAX_TOKENS) // block_size)
    # Prefix caching off: re-admitted requests would find most of their blocks still
    # cached and preempt far less; this test is about recompute. Preemption with caching
    # on is covered in tests/engine/test_prefix_caching.py.
    small = LLM(
        "default", block_size=block_size, num_kv_blocks=needed + 3, max_num_batched_tokens=128,
        enable_prefix_caching=False, **DEVICE,
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    tokens = _drive(small.engine, prompts, {0: list(range(len(prompts)))}, params)
    assert small.engine.scheduler.num_preemptions_total >= 8
    _check(tokens, references)


def test_step_phases_add_up_to_the_step(llm, prompts):
    """Every step reports where its time went; the phases of engine.step() cover it."""
    engine = llm.engine
    engine.add_request("phases", prompts[3], SamplingParams(max_tokens=3, temperature=0.0))
    seen = 0
    while engine.has_unfinished_requests():
        engine.last_step_stats = None
        engine.step()
        stats = engine.last_step_stats
        if stats is None:
            continue
        seen += 1
        assert set(stats.phase_s) == {"schedule", "prepare", "forward", "sample", "update"}
        assert all(v >= 0 for v in stats.phase_s.values())
        assert sum(stats.phase_s.values()) == pytest.approx(stats.step_time_s, rel=1e-6)
        assert stats.phase_s["forward"] > 0
    assert seen == 3


def test_latency_targets_leave_greedy_tokens_unchanged(prompts, references, tmp_path, monkeypatch):
    """An ITL target no step can keep (1 ms) caps every step's prompt tokens at the minimum
    chunk while requests decode: prompts split at many more places than the plain budgets
    split them, beside decodes. Arriving at different steps, tokens must still match
    transformers. The engine writes a step trace, and replaying it through a fresh predictor
    gives back the live predictions exactly (benchmarks/step_replay.py)."""
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "steps-{pid}.jsonl"))
    llm = LLM(
        "default", num_kv_blocks=256, target_itl_ms=1.0, target_ttft_ms=50.0,
        min_prefill_chunk_tokens=24, **DEVICE,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    arrivals = {0: [7, 0], 2: [3], 3: [5, 1], 9: [6], 12: [2, 4]}
    capped, chosen = [], []
    original_step = engine.step

    def step_and_record():
        outputs = original_step()
        stats = engine.last_step_stats
        if stats is not None and stats.num_decode_tokens and stats.num_prefill_tokens:
            capped.append(stats.num_prefill_tokens)
        if stats is not None:
            chosen.append(stats.target_prefill_cap)
        return outputs

    engine.step = step_and_record
    _check(_drive(engine, prompts, arrivals, params), references)
    # The first step prefills prompt 7 beside prompt 0, whose one token looks like a decode
    # row; nobody was decoding when that step was planned, so it was not capped.
    assert len(capped) > 10 and max(capped[1:]) <= 24, capped
    # The chosen chunk is recorded where the targets chose it: the minimum chunk on every
    # step planned with decodes, nothing on that first step (its cap was the whole budget).
    assert chosen[0] is None and set(chosen[1:]) - {None} == {24}, chosen
    assert engine.step_predictor is not None and engine.step_predictor.num_observed > 20
    engine.shutdown()
    trace = read_trace(tmp_path / f"steps-{os.getpid()}.jsonl")
    assert trace.header["model"] == "default"
    assert len(trace.steps) == engine.step_predictor.num_observed
    live = [s.step_s / s.predicted_s if s.predicted_s else None for s in trace.steps]
    assert live[0] is None and replay(trace) == live
    assert {s.replay for s in trace.steps} == {"eager"}  # no CUDA graphs on the CPU
