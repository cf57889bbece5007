"""Speculative decoding end to end on tiny random models, and its verification's statistics.

Exactness: greedy output with speculation (n-gram and draft model, every k in 1..8, each
alone and with prompts arriving at different steps; k = 1, 5 and 8 in a pool small enough to
preempt) is transformers' greedy output (tests/engine/parity.py's near-tie rule), and a row
of k drafts was verified in each run (n-gram lookups under preemption: as many as the text
offers). The target is the suite's tiny C++-kernel Llama; drafts are its first layer (a
truncated draft, engine/spec_decode/truncate.py) and an unrelated random model with the
same vocabulary.

Distribution: rejection sampling is tested where it lives (engine/spec_decode/verify.py),
with many draws on a peaked vocabulary against the target distribution (chi-square).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.penalties import TokenCounts
from engine.sampler import truncated_probs
from engine.spec_decode.ngram import TokenHistory, propose_ngram
from engine.spec_decode.truncate import write_truncated_checkpoint
from engine.spec_decode.verify import accept_greedy, accept_sampled, verify_rows
from scheduler.output import ScheduledRequest
from scheduler.request import Request
from tests.engine.parity import Reference, assert_parity, hf_greedy
from tests.triton_devices import ON_COMPILED_CUDA, ON_INTERPRETED_CPU

MAX_TOKENS = 24
# Random tiny models' drafts are mostly wrong, so the acceptance-aware rule would soon stop
# them proposing; the exactness tests turn it off (row cost 0: every request proposes k),
# and lift the auto-disable cap (16 rows on the CPU: four requests would get 3 drafts each)
# so that k is the k verified.
CPU = {"device": "cpu", "dtype": "float32", "speculative_row_cost": 0.0,
       "speculative_max_step_tokens": 64}  # fmt: skip


@pytest.fixture(scope="module")
def target(tiny_llama_cpu_shapes: Path) -> Path:
    return tiny_llama_cpu_shapes


@pytest.fixture(scope="module")
def truncated_draft(target: Path, tmp_path_factory) -> Path:
    return write_truncated_checkpoint(target, tmp_path_factory.mktemp("draft-1-layer"), 1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat spans (so n-gram lookups find matches), of several lengths."""
    rng = random.Random(0)
    out = []
    for length in (5, 17, 40, 70):
        span = [rng.randrange(3, 256) for _ in range(max(3, length // 3))]
        out.append((span * 4)[:length])
    return out


@pytest.fixture(scope="module")
def every_token() -> list[int]:
    """Every token of the vocabulary once: whatever a request emits has an earlier match
    here, mostly far from the end, so n-gram lookups propose the full k (a random model's own
    repeats are too short for k up to 8)."""
    return random.Random(1).sample(range(256), 256)


@pytest.fixture(scope="module")
def hf_target(target: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def references(hf_target, prompts: list[list[int]]) -> list[Reference]:
    return [hf_greedy(hf_target, p, MAX_TOKENS, None) for p in prompts]


@pytest.fixture(scope="module")
def every_token_reference(hf_target, every_token: list[int]) -> Reference:
    return hf_greedy(hf_target, every_token, MAX_TOKENS, None)


def generate(
    llm: LLM, prompts, arrivals=None, params=None
) -> tuple[dict[int, list[int]], int, int]:
    """Run prompts (all at step 0, or step -> prompt indices), checking integrity after every
    step. Returns the tokens per prompt, the drafts accepted and the most drafts any row
    verified."""
    engine = llm.engine
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    arrivals = arrivals if arrivals is not None else {0: list(range(len(prompts)))}
    tokens: dict[int, list[int]] = {}
    accepted = step = longest = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(f"p{i}-{id(params)}", prompts[i], params)
            tokens[i] = []
        for out in engine.step():
            tokens[int(out.request_id[1:].split("-")[0])].extend(out.new_token_ids)
        if engine.speculator is not None:  # this step's verified rows
            verified = engine.speculator._verified.values()
            longest = max([longest, *(v.num_drafts for v in verified)])
        if engine.last_step_stats is not None:
            accepted += engine.last_step_stats.num_accepted_tokens
        engine.check_integrity()
        step += 1
    assert engine.num_free_blocks == engine.num_total_blocks
    draft = engine.speculator.draft if engine.speculator is not None else None
    if draft is not None:
        assert draft.kv.num_free_blocks == draft.kv.num_blocks, "draft K/V leaked"
    return tokens, accepted, longest


def check(tokens: dict[int, list[int]], references: list[Reference], label: str) -> None:
    for i, ours in tokens.items():
        assert_parity(ours, references[i], label=f"{label}, prompt {i}")


# Each prompt alone (one after another in one engine), or all four arriving at different
# steps so rows of different lengths and drafts share steps.
LOADS = {"alone": None, "together": {0: [2], 3: [0, 3], 5: [1]}}


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_speculation_matches_transformers(
    target, truncated_draft, prompts, references, every_token, every_token_reference, method,
    k, load
):  # fmt: skip
    """Every k in 1..8, both methods, alone and together: transformers' tokens, and the
    step really verified k-draft rows (the cap of the auto-disable rule is lifted). n-gram
    lookups also get the every-token prompt, as prompt 4 (a draft model proposes k drafts
    whatever the text)."""
    if method == "ngram":
        extra = {"ngram_min": 1}
        prompts, references = [*prompts, every_token], [*references, every_token_reference]
    else:
        extra = {"speculative_model": str(truncated_draft)}
    llm = LLM(str(target), num_kv_blocks=64, speculative_method=method,
              num_speculative_tokens=k, **extra, **CPU)  # fmt: skip
    if LOADS[load] is None:
        runs = [generate(llm, prompts, arrivals={0: [i]}) for i in range(len(prompts))]
    else:
        arrivals = LOADS[load] if method == "draft" else {**LOADS[load], 4: [4]}
        runs = [generate(llm, prompts, arrivals=arrivals)]
    for tokens, _, _ in runs:
        check(tokens, references, f"{method} k={k}, {load}")
    assert sum(accepted for _, accepted, _ in runs) > 0, "no draft was accepted"
    assert max(longest for _, _, longest in runs) == k, "no row verified k drafts"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_token_biases_under_speculation_give_the_plain_steps_tokens(
    target, truncated_draft, prompts, references, method
):
    """Verification biases the target's logits as the plain sampler does, at each draft's
    own output position (the drafts are proposed without the biases, so banned tokens get
    proposed and must be rejected): greedy rows with a logit bias and a min_tokens-banned
    stop token emit the tokens of an engine without speculation."""
    banned = {t: -100.0 for ref in references for t in ref.token_ids[:3]}
    bias = {**banned, 17: 2.0}
    # A stop token each prompt's biased run would say early without the minimum.
    stop_ids = tuple(ref.token_ids[5] for ref in references)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            logit_bias=bias, min_tokens=10, stop_token_ids=stop_ids)  # fmt: skip
    plain_llm = LLM(str(target), num_kv_blocks=64, **CPU)
    plain, _, _ = generate(plain_llm, prompts, params=params)
    early, _, _ = generate(plain_llm, prompts, params=replace(params, min_tokens=0))
    assert any(len(row) < 10 for row in early.values()), "no stop token came early"
    assert all(len(row) >= 10 for row in plain.values())
    extra = {"ngram_min": 1} if method == "ngram" else {"speculative_model": str(truncated_draft)}
    llm = LLM(str(target), num_kv_blocks=64, speculative_method=method,
              num_speculative_tokens=4, **extra, **CPU)  # fmt: skip
    tokens, _, longest = generate(llm, prompts, arrivals=LOADS["together"], params=params)
    assert tokens == plain and longest > 0
    assert all(t not in banned for row in tokens.values() for t in row)


def test_unrelated_random_draft_alone_matches_transformers(
    target, tiny_llama_gqa, prompts, references
):
    """A draft of other shapes (head_dim 16: the torch attention path) and other weights."""
    llm = LLM(str(target), num_kv_blocks=64, speculative_method="draft",
              speculative_model=str(tiny_llama_gqa), num_speculative_tokens=3, **CPU)  # fmt: skip
    for i in range(len(prompts)):
        tokens, _, _ = generate(llm, prompts, arrivals={0: [i]})
        check(tokens, references, "random draft, alone")


@pytest.mark.parametrize("k", [1, 5, 8])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_mid_speculation_stays_exact(
    target, truncated_draft, prompts, references, method, k
):
    block_size = 4
    needed = -(-(max(len(p) for p in prompts) + MAX_TOKENS) // block_size)
    extra = {"speculative_model": str(truncated_draft)} if method == "draft" else {}
    llm = LLM(str(target), block_size=block_size, num_kv_blocks=needed + 4,
              enable_prefix_caching=False, speculative_method=method,
              num_speculative_tokens=k, ngram_min=1, **extra, **CPU)  # fmt: skip
    tokens, accepted, longest = generate(llm, prompts)
    assert llm.engine.scheduler.num_preemptions_total > 0
    check(tokens, references, f"{method} k={k}, preempting")
    assert accepted > 0
    # n-gram lookups find at most 5 tokens to copy in these prompts' outputs (the
    # every-token prompt would not fit this pool beside them).
    assert longest == (k if method == "draft" else min(k, 5))


def test_abort_mid_speculation_frees_both_pools(target, truncated_draft, prompts):
    llm = LLM(str(target), num_kv_blocks=64, speculative_method="draft",
              speculative_model=str(truncated_draft), num_speculative_tokens=4, **CPU)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        engine.step()
    engine.abort_request(["r0", "r2"])
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks
    draft = engine.speculator.draft
    assert draft.kv.num_free_blocks == draft.kv.num_blocks


def test_sampled_requests_keep_max_tokens_logprobs_and_seeds(target, truncated_draft, prompts):
    params = SamplingParams(max_tokens=13, temperature=0.8, top_k=20, seed=5, logprobs=2,
                            ignore_eos=True, frequency_penalty=0.5)  # fmt: skip
    for method, extra in [("ngram", {}), ("draft", {"speculative_model": str(truncated_draft)})]:
        runs = []
        for _ in range(2):
            llm = LLM(str(target), num_kv_blocks=64, speculative_method=method,
                      num_speculative_tokens=4, ngram_min=1, **extra, **CPU)  # fmt: skip
            outs = llm.generate(prompts, params)
            for out in outs:
                assert len(out.token_ids) == 13
                assert [lp.token_id for lp in out.logprobs] == out.token_ids
                assert all(len(lp.top) == 2 for lp in out.logprobs)
            runs.append([out.token_ids for out in outs])
        assert runs[0] == runs[1], f"{method}: a seeded request is not reproducible"


# ---- proposals and verification, without a model --------------------------------------


def test_ngram_proposes_the_most_recent_earlier_match_longest_first():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # Last 2 tokens (2, 3) occur at 1 and 6; the most recent earlier is 6 -> 7, 8, 5.
    assert propose_ngram(tokens, 2, 2, 3) == [7, 8, 5]
    # A 3-gram (5, 2, 3) has no earlier match; 2-grams are tried next.
    assert propose_ngram(tokens, 2, 3, 2) == [7, 8]
    assert propose_ngram([4, 5, 6], 1, 3, 4) == []
    assert propose_ngram([4, 5, 4], 1, 3, 4) == [5, 4]


def _reference_ngram(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The search one position at a time, as a Python loop (what the vectorised one does)."""
    total = len(tokens)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        tail = tokens[total - n :]
        for start in range(total - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_ngram_search_equals_the_position_by_position_one(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 8)
        expected = _reference_ngram(tokens, lo, hi, k)
        assert propose_ngram(tokens, lo, hi, k) == expected, (tokens, lo, hi, k)


def test_token_history_follows_each_request_and_forgets_it():
    """Histories grow with their requests' outputs (past their first capacity), equal the
    token lists, start afresh for a new request under a reused id, and go when forgotten."""
    histories = TokenHistory()
    rng = random.Random(3)
    a = Request("a", [rng.randrange(100) for _ in range(5)], SamplingParams())
    b = Request("b", [rng.randrange(100) for _ in range(40)], SamplingParams())
    for step in range(50):
        for r in (a, b):
            r.output_token_ids += [rng.randrange(100) for _ in range(rng.randint(1, 4))]
            assert histories.tokens(r).tolist() == r.token_ids(0, r.num_tokens), (step, r)
    reused = Request("a", [7, 7, 7], SamplingParams())
    assert histories.tokens(reused).tolist() == [7, 7, 7]
    histories.forget("a")
    histories.forget("a")
    assert histories.request_ids() == {"b"}


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_one():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_greedy([5, 1, 7, 8], [5, 6, 7]) == [5, 1]
    assert accept_greedy([2, 6, 7, 8], [5, 6, 7]) == [2]


def _peaked(vocab: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=gen) * 2.5
    return torch.softmax(logits, dim=-1)


def _chi_square(counts: dict[int, int], probs: torch.Tensor, label: str) -> None:
    """Pool the tail (expected < 5) and test the counts against ``probs``."""
    total = sum(counts.values())
    expected = (probs * total).tolist()
    observed = [counts.get(i, 0) for i in range(len(expected))]
    big = [i for i, e in enumerate(expected) if e >= 5]
    small = [i for i in range(len(expected)) if i not in big]
    obs = [observed[i] for i in big] + [sum(observed[i] for i in small)]
    exp = [expected[i] for i in big] + [sum(expected[i] for i in small)]
    if exp[-1] < 5:  # fold a tiny tail into the smallest big bin
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    statistic = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    # The chi-square survival function, 1 - P(df/2, x/2) (regularised incomplete gamma).
    df = len(obs) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2)))
    assert p_value > 1e-3, f"{label}: chi-square p = {p_value:.2e}\nobs {obs}\nexp {exp}"


@pytest.mark.parametrize("method", ["point mass (ngram)", "draft distribution"])
def test_rejection_sampling_emits_the_target_distribution(method):
    vocab, k, draws = 12, 3, 6000
    p = _peaked(vocab, k, seed=1)
    gen = torch.Generator().manual_seed(2)
    q = _peaked(vocab, k - 1, seed=3) if method != "point mass (ngram)" else None
    first: dict[int, int] = {}
    second: dict[int, int] = {}  # given the first emitted token was the first draft
    drafts = [int(p[0].argmax()), 4, 7]  # a likely first draft, so the second is tested
    for _ in range(draws):
        if q is not None:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        emitted = accept_sampled(p, drafts, q, gen)
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if emitted[0] == drafts[0] and len(emitted) > 1 and q is None:
            second[emitted[1]] = second.get(emitted[1], 0) + 1
    _chi_square(first, p[0], f"{method}: first token")
    if q is None:
        _chi_square(second, p[1], f"{method}: second token after an accepted draft")


def test_verify_rows_samples_the_penalised_truncated_distribution():
    """verify_rows applies penalties (drafts before a row count as output), temperature and
    top-k as the plain sampler does, then rejection-samples: its first token follows the
    plain sampler's distribution."""
    vocab = 10
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, vocab, generator=gen) * 2
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=6, presence_penalty=1.5)
    request = Request("r", [1, 2, 3], params)
    request.output_token_ids = [int(logits[0].argmax())]  # penalised at row 0
    item = ScheduledRequest(request, 3, 3, [request.output_token_ids[0], 5, 6], (0,), True,
                            draft_token_ids=(5, 6))  # fmt: skip
    penalised = logits[0].clone()
    penalised[request.output_token_ids[0]] -= 1.5
    target = truncated_probs(penalised[None], [params])[0]
    target = target / target.sum()
    counts: dict[int, int] = {}
    penalties = TokenCounts(torch.device("cpu"))
    for _ in range(800):
        [result] = verify_rows(logits, [item], argmax=lambda x: x.argmax(-1), penalties=penalties,
                               generator=lambda _: gen, draft_probs=[None])  # fmt: skip
        counts[result.token_ids[0]] = counts.get(result.token_ids[0], 0) + 1
    _chi_square(counts, target, "verify_rows first token")


def test_auto_disable_shrinks_k_with_the_batch():
    from engine.spec_decode.policy import SpeculationPolicy, default_max_step_tokens

    policy = SpeculationPolicy(num_speculative_tokens=4, max_step_tokens=16)
    assert policy.drafts_per_request(1, 1) == 4
    assert policy.drafts_per_request(4, 4) == 3  # 4 decodes + 12 drafts = 16
    assert policy.drafts_per_request(8, 8) == 1
    assert policy.drafts_per_request(9, 9) == 0  # more than half the budget: plain decodes
    assert default_max_step_tokens("cpu", 8) == 8
    assert default_max_step_tokens("cpu", 64) == 16
    assert policy.wanted("any") == 4  # row cost 0: the acceptance rule is off


def test_cuda_auto_disable_is_half_the_steps_ridge_at_the_devices_peaks():
    from engine.config import ModelConfig
    from engine.cost import StepCostModel
    from engine.presets import preset
    from engine.spec_decode.policy import (
        CUDA_STEP_TOKENS,
        default_max_step_tokens,
        ridge_rows_for,
    )

    h100 = "NVIDIA H100 80GB HBM3"
    bf16 = StepCostModel.from_config(ModelConfig.from_hf(preset("llama-3-8b")), 2)
    ridge = ridge_rows_for(bf16, h100, "bfloat16")
    # The first row count whose matmul time reaches its weight-reading time.
    for rows, memory_bound in ((ridge - 1, True), (ridge, False)):
        weight_bytes, flops, _ = bf16.parts(rows, rows, 0)
        assert (flops / 989.4e12 < weight_bytes / 3350e9) == memory_bound
    # Dense bf16: 2 bytes and 2 FLOPs a weight and row, so about the peaks' ratio (295.3).
    assert ridge == 296
    assert default_max_step_tokens("cuda", 0, ridge) == 148
    assert ridge_rows_for(bf16, "NVIDIA H200", "bfloat16") == 207  # 4.8 TB/s
    # int8 weights: half the bytes a step reads, half the ridge.
    int8 = bf16.with_blocks(2**62, bf16.body_weight_bytes // 2, bf16.lm_head_bytes // 2)
    assert ridge_rows_for(int8, h100, "bfloat16") == 148
    # A GPU not in the table, a dtype without a peak, a mixture: the fixed default.
    assert ridge_rows_for(bf16, "Some GPU", "bfloat16") is None
    assert ridge_rows_for(bf16, h100, "float64") is None
    moe = StepCostModel.from_config(ModelConfig.from_hf(preset("mixtral-8x7b")), 2)
    assert ridge_rows_for(moe, h100, "bfloat16") is None
    assert default_max_step_tokens("cuda", 0, None) == CUDA_STEP_TOKENS == 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_caps_speculation_at_its_ridge(tiny_llama_gqa):
    """The builder's CUDA path: the engine's cap is the rule's for its GPU, dtype and
    model (the table's half ridge, or 128 for a GPU not in the table)."""
    from engine.spec_decode.policy import default_max_step_tokens, ridge_rows_for

    llm = LLM(str(tiny_llama_gqa), device="cuda", dtype="bfloat16", num_kv_blocks=16,
              speculative_method="ngram")  # fmt: skip
    engine = llm.engine
    ridge = ridge_rows_for(engine.cost_model, torch.cuda.get_device_name(), "bfloat16")
    assert engine.speculator.policy.max_step_tokens == default_max_step_tokens("cuda", 0, ridge)
    print(f"{torch.cuda.get_device_name()}: ridge {ridge}, cap "
          f"{engine.speculator.policy.max_step_tokens}")  # fmt: skip


def test_best_num_drafts_proposes_what_acceptance_pays_for():
    from engine.spec_decode.policy import best_num_drafts

    # gain(k) = (1 + a + ... + a^k) / (1 + k c)
    assert best_num_drafts(0.95, 4, 0.4) == 4  # copying: every draft pays
    assert best_num_drafts(0.95, 8, 0.4) == 6  # a 7th draft would cost more than it brings
    assert best_num_drafts(0.75, 8, 0.4) == 2  # 2.31 / 1.8 = 1.28 beats 1.25 (k=1), 1.24 (k=3)
    assert best_num_drafts(0.3, 8, 0.4) == 0  # 1.3 / 1.4 < 1: plain decoding is faster
    assert best_num_drafts(0.3, 8, 0.02) == 3  # on a GPU rows are nearly free
    assert best_num_drafts(1.0, 4, 0.0) == 4


def test_policy_ramps_up_on_kept_drafts_and_pauses_on_missed_ones():
    from engine.spec_decode.policy import MAX_PAUSE, MIN_PAUSE, SpeculationPolicy

    policy = SpeculationPolicy(num_speculative_tokens=4, max_step_tokens=16, row_cost=0.4)
    # A copying request: from 1 draft (the fresh probe) to the full 4 as its drafts are kept.
    ks = []
    for _ in range(5):
        policy.begin_step()
        k = policy.wanted("copy")
        ks.append(k)
        policy.observe("copy", k, k)
    assert ks[0] == 1 and ks[-1] == 4 and ks == sorted(ks), ks
    # A request whose drafts miss: one miss from fresh pauses it for MIN_PAUSE steps, then
    # it probes with one draft; each failed probe doubles the pause up to MAX_PAUSE.
    policy.begin_step()
    assert policy.wanted("free") == 1
    policy.observe("free", 1, 0)
    pauses = []
    for _ in range(5):
        policy.begin_step()
        assert policy.wanted("free") == 0  # pauses from here
        start = policy._step
        while not policy.may_propose("free"):
            policy.begin_step()
        pauses.append(policy._step - start)
        assert policy.wanted("free") == 1  # the probe
        policy.observe("free", 1, 0)
    assert pauses == [MIN_PAUSE, 2 * MIN_PAUSE, 4 * MIN_PAUSE, MAX_PAUSE, MAX_PAUSE]
    # A probe that hits counts as a kept draft and sets the pause back to MIN_PAUSE.
    policy.begin_step()
    policy.wanted("free")
    while not policy.may_propose("free"):
        policy.begin_step()
    assert policy.wanted("free") == 1
    before = policy.acceptance("free")
    policy.observe("free", 1, 1)
    assert policy.acceptance("free") > before
    policy.begin_step()
    assert policy.wanted("free") == 0  # still too poor: a pause, back at MIN_PAUSE
    start = policy._step
    while not policy.may_propose("free"):
        policy.begin_step()
    assert policy._step - start == MIN_PAUSE
    # A draft model's drafts cost its step too (c = 0.8 here): a draft pays only once the
    # request's acceptance is above 0.8, which its probes establish.
    drafted = SpeculationPolicy(4, 16, row_cost=0.4, proposal_cost=0.4)
    drafted.begin_step()
    assert drafted.wanted("r") == 1  # the fresh probe
    drafted.observe("r", 1, 1)  # a = 3/4: 1.75 / 1.8 < 1, so a pause and another probe
    drafted.begin_step()
    assert drafted.wanted("r") == 0
    while not drafted.may_propose("r"):
        drafted.begin_step()
    assert drafted.wanted("r") == 1
    drafted.observe("r", 1, 1)  # a = 0.83: 1 draft pays
    drafted.begin_step()
    assert drafted.wanted("r") == 1
    policy.forget("free")
    assert policy.may_propose("free")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_acceptance_aware_k_stays_exact_with_short_drafts_and_pauses(
    target, truncated_draft, prompts, references, method
):
    """With a row cost, each request's k follows its acceptance (shorter drafts, pauses,
    probes; the draft model drafting a different k per request in one pass) in real
    batches, and output is still exact."""
    extra = {"ngram_min": 1} if method == "ngram" else {"speculative_model": str(truncated_draft)}
    llm = LLM(str(target), num_kv_blocks=64, speculative_method=method,
              num_speculative_tokens=4, device="cpu", dtype="float32", **extra)  # fmt: skip
    policy = llm.engine.speculator.policy
    if method == "ngram":
        assert policy.draft_cost == 0.4  # the CPU's default
    else:
        # The row and the tiny draft's step (its embedding makes it most of the target's):
        # too dear for its drafts to ever pay, so cheapened here to let k vary.
        assert policy.draft_cost > 0.4
        policy.draft_cost = 0.05
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    sizes: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id[1:])].extend(out.new_token_ids)
        sizes |= set(engine.speculator._proposed.values())
        engine.check_integrity()
    check(tokens, references, f"{method}, acceptance-aware k")
    assert 1 in sizes and len(sizes) > 1, f"k did not vary: {sizes}"


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    from engine.config import UnsupportedModelError
    from tests.engine.conftest import make_tiny_llama

    other = make_tiny_llama(tmp_path / "vocab-300", num_kv_heads=2, vocab_size=300)
    with pytest.raises(UnsupportedModelError, match="share the target's tokenizer"):
        LLM(str(target), num_kv_blocks=16, speculative_method="draft",
            speculative_model=str(other), **CPU)  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        ("torch", "cpu"),
        pytest.param("triton", "cpu", marks=ON_INTERPRETED_CPU),
        pytest.param("triton", "cuda", marks=ON_COMPILED_CUDA),
    ],
)  # fmt: skip
def test_speculative_rows_on_every_attention_backend(tiny_llama_gqa, backend, device):
    """Speculative rows are multi-token queries: the prefill kernels of each backend run
    them. Greedy output with n-gram speculation equals the output without, on that backend."""
    rng = random.Random(3)
    prompts = [(span * 3)[:n] for n, span in
               [(20, [rng.randrange(3, 256) for _ in range(7)]), (9, [5, 6, 7])]]  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kwargs = dict(block_size=8, device=device, dtype="float32", num_kv_blocks=64,
                  attention_backend=backend)  # fmt: skip
    plain = LLM(str(tiny_llama_gqa), **kwargs).generate(prompts, params)
    spec = LLM(str(tiny_llama_gqa), speculative_method="ngram", ngram_min=1,
               num_speculative_tokens=3, speculative_row_cost=0.0, **kwargs)  # fmt: skip
    tokens, accepted, _ = generate(spec, prompts, params=params)
    assert [tokens[i] for i in range(len(prompts))] == [out.token_ids for out in plain]
    assert accepted > 0
