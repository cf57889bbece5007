"""Prefix caching end to end: greedy tokens with caching on equal the tokens with it off.

The shared-prefix workload: 16 requests share a 400-token system prompt and differ afterwards
(suffixes of 1 to 37 tokens), submitted all together, in waves, and under preemption in a
tiny pool. The reference is the same engine with ``enable_prefix_caching=False``; cached K/V
was computed in other batch shapes than recomputed K/V, so a divergence is accepted only at
a reference near-tie (tests/engine/parity.py, top-2 logit margin below 1e-3), and reported.
Every run ends with every block free or evictable, and no block in use.

Fast version: a tiny random Llama. One test runs the embedded SmolLM2-135M (marked slow).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import Reference, assert_parity

SYSTEM_LEN = 400
NUM_REQUESTS = 16
SUFFIX_LENS = [1 + (7 * i) % 37 for i in range(NUM_REQUESTS)]
MAX_TOKENS = 8
# float32 on CPU, and a pool of 512 blocks (8192 tokens) rather than the 1 GiB default: the
# workload needs ~70 blocks, and check_integrity() after every step walks the whole pool.
DEVICE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 512}
WAVES = {0: [0, 1, 2, 3, 4], 4: [5, 6, 7, 8, 9, 10], 11: [11, 12, 13, 14, 15]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-prefix"), num_kv_heads=2, seed=3,
        max_position_embeddings=1024,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 256, (SYSTEM_LEN,), generator=g).tolist()
    return [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in SUFFIX_LENS]


def greedy(**kwargs: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **kwargs)


@pytest.fixture(scope="module")
def references(model_path: Path, prompts: list[list[int]]) -> list[Reference]:
    llm = LLM(str(model_path), enable_prefix_caching=False, **DEVICE)  # type: ignore[arg-type]
    outs = llm.generate(prompts, greedy(logprobs=2))
    assert llm.engine.kv_manager.stats().prefix_cache_queries == 0
    return [Reference.from_output(o) for o in outs]


def check_tokens(outputs: list[list[int]], references: list[Reference], label: str) -> None:
    for i, (ours, ref) in enumerate(zip(outputs, references, strict=True)):
        assert_parity(ours, ref, label=f"{label} request {i}")


def check_idle(engine: LLMEngine) -> None:
    engine.check_integrity()
    stats = engine.kv_manager.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks
    assert engine.num_free_blocks == engine.num_total_blocks


def drive(
    engine: LLMEngine, prompts: list[list[int]], waves: dict[int, list[int]]
) -> tuple[list[list[int]], int]:
    """Add prompts at the given step numbers; check invariants after every step.

    Returns:
        Each prompt's tokens, and the prefix-cache hits summed over the steps' StepStats.
    """
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending, step, hits = dict(waves), 0, 0
    while pending or engine.has_unfinished_requests():
        for i in pending.pop(step, []):
            engine.add_request(f"r{i}", prompts[i], greedy())
        engine.last_step_stats = None  # an empty step records none
        for out in engine.step():
            tokens[int(out.request_id[1:])].extend(out.new_token_ids)
        engine.check_integrity()
        stats = engine.last_step_stats
        if stats is not None:
            assert 0.0 <= stats.kv_waste_fraction < 1.0
            assert stats.num_kv_slots_live <= stats.num_kv_slots_allocated
            hits += stats.prefix_cache_hits
        step += 1
    return [tokens[i] for i in range(len(prompts))], hits


def test_submitted_together_matches_caching_off(model_path, prompts, references):
    llm = LLM(str(model_path), **DEVICE)  # prefix caching is on by default
    assert llm.engine.enable_prefix_caching
    outs = llm.generate(prompts, greedy())
    check_tokens([o.token_ids for o in outs], references, "together")
    check_idle(llm.engine)
    stats = llm.engine.kv_manager.stats()
    # The first request computes the 25 system-prompt blocks; the other 15 wait one step
    # for them (not computing them again) and hit all 25.
    assert stats.prefix_cache_hits == (NUM_REQUESTS - 1) * SYSTEM_LEN
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.num_evictable_blocks >= SYSTEM_LEN // 16


def test_waves_match_caching_off(model_path, prompts, references):
    engine = LLM(str(model_path), **DEVICE).engine
    tokens, hits = drive(engine, prompts, WAVES)
    check_tokens(tokens, references, "waves")
    check_idle(engine)
    # Later waves find the system prompt cached (in use or evictable) on arrival; the
    # per-step StepStats add up to the pool's totals.
    assert hits == engine.kv_manager.stats().prefix_cache_hits == (NUM_REQUESTS - 1) * SYSTEM_LEN
    assert engine.kv_manager.stats().num_evictions == 0


def test_preemption_in_a_tiny_pool_keeps_tokens_exact(model_path, prompts, references):
    # 8-token blocks; 58 blocks hold the shared 50-block system prompt plus a few requests'
    # own blocks (the largest request needs 56): requests preempt each other, cached blocks
    # are evicted, and preempted requests come back to hits on whatever is still cached.
    llm = LLM(
        str(model_path), block_size=8, max_num_batched_tokens=128, **{**DEVICE, "num_kv_blocks": 58}
    )  # type: ignore[arg-type]
    tokens, _ = drive(llm.engine, prompts, {0: list(range(NUM_REQUESTS))})
    assert llm.engine.scheduler.num_preemptions_total >= 3
    assert llm.engine.kv_manager.stats().num_evictions > 0
    check_tokens(tokens, references, "preempted")
    check_idle(llm.engine)


def test_a_fully_cached_prompt_copies_its_last_block(model_path, prompts, references):
    # The system prompt alone is block-aligned (25 blocks): asked twice, the second request
    # recomputes one token into a private copy of block 24 (copy-on-write in the storage).
    llm = LLM(str(model_path), **DEVICE)  # type: ignore[arg-type]
    system = prompts[0][:SYSTEM_LEN]
    first = llm.generate([system], greedy())[0].token_ids
    engine = llm.engine
    engine.add_request("again", system, greedy())
    plan = engine.scheduler.schedule()
    ((src, dst),) = plan.blocks_to_copy
    assert [(s.start, s.num_tokens) for s in plan.scheduled] == [(SYSTEM_LEN - 1, 1)]
    result = engine.runner.execute(plan)
    for cache in (*engine.storage.key_caches, *engine.storage.value_caches):
        # The copy is exact; position 399 was then rewritten with the same token's K/V.
        assert torch.equal(cache[dst, :-1], cache[src, :-1])
        torch.testing.assert_close(cache[dst, -1], cache[src, -1])
    engine.scheduler.update_from_output(
        plan, dict(zip(result.request_ids, result.token_ids, strict=True))
    )
    tokens = list(result.token_ids)
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == first
    check_idle(engine)


SMOL_SYSTEM = """\
You are a careful assistant for a public library. Answer questions about opening hours,
borrowing rules, events and the catalogue. Be brief and friendly, and say so when you do not
know something. Members may borrow up to twelve items at once for three weeks; items can be
renewed twice online unless someone else has reserved them. Late returns cost ten cents a day
for books and one dollar a day for films, capped at the price of the item. The main branch
opens at nine in the morning and closes at eight in the evening on weekdays, and closes at five
on Saturdays; it is closed on Sundays and public holidays. The children's room hosts story time
on Tuesday and Thursday mornings. Study rooms can be booked for two hours a day. Printing costs
fifteen cents a page in black and white and fifty cents in colour. The library offers free
wireless internet, a maker space with two 3D printers, a seed library in spring, and classes
on using e-readers every first Monday of the month. Lost cards are replaced for two dollars.
Donations of books in good condition are accepted at the front desk on weekday mornings.
"""
SMOL_QUESTIONS = [
    "When do you open on Saturday?", "How many books can I borrow?", "Is there story time?",
    "How much is printing?", "Can I renew a film?", "Do you have wifi?", "I lost my card.",
    "Where can I study?", "Are you open on Sunday?", "What is the late fee for a book?",
    "Can I donate books?", "Do you have a 3D printer?", "When are e-reader classes?",
    "What is the seed library?", "How long is a loan?", "Who runs the children's room?",
]  # fmt: skip


@pytest.mark.slow
def test_default_model_shared_system_prompt_matches_caching_off() -> None:
    """SmolLM2-135M: 16 questions after one 400-token system prompt, caching on vs off."""
    on = LLM("default", device="cpu", dtype="float32", num_kv_blocks=256)
    tokenizer = on.tokenizer
    system = tokenizer.encode(SMOL_SYSTEM * 2, add_special_tokens=False)[:SYSTEM_LEN]
    prompts = [system + tokenizer.encode(" " + q, add_special_tokens=False) for q in SMOL_QUESTIONS]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    # Large steps: the off run's 16 prefills go through in few forward passes.
    off = LLM("default", device="cpu", dtype="float32", num_kv_blocks=512,
              max_num_batched_tokens=4096, enable_prefix_caching=False)  # fmt: skip
    references = [Reference.from_output(o) for o in off.generate(prompts, params)]
    outs = on.generate(prompts, params)
    check_tokens([o.token_ids for o in outs], references, "SmolLM2")
    check_idle(on.engine)
    assert on.engine.kv_manager.stats().prefix_cache_hits == 15 * SYSTEM_LEN
