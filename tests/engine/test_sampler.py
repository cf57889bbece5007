"""The batched sampler against a per-row reference of the same rules.

The reference below is the one-row-at-a-time formulation (HF's repetition rule, OpenAI's
subtractive frequency/presence rule, then temperature, top-k, top-p, min-p): the batched
sampler must compute the same penalised logits and the same truncated distribution for every
row of a batch that mixes parameters, and draw from exactly that distribution.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM
from engine.sampler import Sampler, seeded_exponential, truncated_probs
from engine.token_bias import apply_token_bias, row_bias
from scheduler.output import ScheduledRequest
from scheduler.request import Request, SamplingParams, StructuredOutputParams

VOCAB = 50


def _item(
    request_id: str, params: SamplingParams, prompt=(1, 2, 3), output=(), recompute: bool = False
) -> ScheduledRequest:
    """A row that samples the request's next output token: a decode of its last token, or
    (``recompute``) a prefill of all its tokens, as after a preemption."""
    request = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params)
    request.output_token_ids.extend(output)
    tokens = [*request.prompt_token_ids, *request.output_token_ids]
    start = 0 if recompute else len(tokens) - 1
    return ScheduledRequest(
        request,
        start=start,
        num_tokens=len(tokens) - start,
        token_ids=tokens[start:],
        block_ids=(0,),
        samples=True,
    )


def _ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = row / p.temperature
    if 0 < p.top_k < logits.shape[0]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[1:][before[1:] >= p.top_p] = 0.0  # the most likely token stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=-1),
]


def test_truncation_matches_the_per_row_rule() -> None:
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    batched = truncated_probs(logits, MIXED)
    for row, p in enumerate(MIXED):
        ref = _ref_probs(logits[row], p)
        assert torch.equal(batched[row] > 0, ref > 0), f"row {row}: different support"
        torch.testing.assert_close(batched[row], ref, rtol=1e-6, atol=1e-7)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1),
    ]
    items = [_item(str(i), p) for i, p in enumerate(params)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = Sampler(0, torch.device("cpu"))(logits, items)
    argmax = logits.argmax(dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert logprobs == [None, None, None]


def test_vanishing_temperature_and_top_p_give_the_argmax() -> None:
    """A temperature that would overflow the logits samples greedily, and a top_p that rounds
    to 0 in float32 keeps the most likely token: never a NaN draw (token 0)."""
    params = [
        SamplingParams(temperature=1e-39),
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=9.9e-6, seed=3),
        SamplingParams(top_p=1e-300),
        SamplingParams(top_p=1e-300, seed=5, logprobs=2),
    ]
    assert all(p.greedy for p in params[:3]) and not params[3].greedy
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    logits[:, 0] -= 100  # a NaN distribution draws index 0
    items = [_item(str(i), p) for i, p in enumerate(params)]
    tokens, _ = Sampler(0, torch.device("cpu"))(logits, items)
    assert tokens == logits.argmax(dim=-1).tolist()
    probs = truncated_probs(logits[3:], params[3:])
    assert torch.equal(probs > 0, logits[3:] == logits[3:].amax(dim=-1, keepdim=True))


def test_draws_follow_the_truncated_distribution() -> None:
    """Many rows of the same logits: the empirical frequencies match the reference
    probabilities (a chi-square-sized bound), and no truncated token is ever drawn."""
    base = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    rows = 20000
    items = [_item(str(i), p) for i in range(rows)]
    tokens, _ = Sampler(7, torch.device("cpu"))(base.expand(rows, VOCAB).contiguous(), items)
    ref = _ref_probs(base, p)
    ref = ref / ref.sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / rows
    assert (counts[ref == 0] == 0).all(), "a truncated token was drawn"
    assert (counts - ref.double()).abs().max() < 0.02


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    """A seeded row picks the same token alone and at any row of any batch: beside other
    seeded rows, unseeded, greedy, penalised and logprob rows, in any order, and whatever
    the sampler's own seed."""
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    seeded = [
        _item("s0", SamplingParams(temperature=1.0, seed=123)),
        _item("s1", SamplingParams(temperature=0.8, top_k=10, seed=124), output=(5, 6)),
        _item("s2", SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05, seed=2**63 - 1)),
        _item(
            "s3",
            SamplingParams(temperature=0.9, seed=0, frequency_penalty=0.5, logprobs=2),
            output=(7, 7, 1),
        ),
    ]
    others = [
        _item("u", SamplingParams(temperature=1.0)),
        _item("g", SamplingParams(temperature=0)),
        _item("p", SamplingParams(temperature=0.7, repetition_penalty=1.3), output=(4,)),
        _item("l", SamplingParams(temperature=0, logprobs=3)),
    ]
    alone = [
        Sampler(0, torch.device("cpu"))(logits[i : i + 1], [seeded[i]])[0][0] for i in range(4)
    ]
    items = seeded + others
    for order_seed in range(6):
        order = torch.randperm(8, generator=torch.Generator().manual_seed(order_seed)).tolist()
        batch = [items[j] for j in order]
        tokens, _ = Sampler(order_seed, torch.device("cpu"))(logits[order], batch)
        for row, j in enumerate(order):
            if j < 4:
                assert tokens[row] == alone[j], f"order {order}: seeded request {j} at row {row}"


def test_seeded_rows_survive_recompute() -> None:
    """The noise depends on the output position sampled, not on how often the request drew:
    the token a decode samples is the one a recompute of all its tokens samples (after a
    preemption), however often either ran; the next position draws new noise."""
    params = SamplingParams(temperature=1.0, seed=9)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6))
    sampler = Sampler(0, torch.device("cpu"))
    decode = _item("r", params, output=(4, 8, 15))
    recompute = _item("r", params, output=(4, 8, 15), recompute=True)
    picks = {sampler(logits, [item])[0][0] for item in (decode, recompute, decode, recompute)}
    assert len(picks) == 1
    seeds = torch.tensor([9, 9, 9])
    noise = seeded_exponential(seeds, torch.tensor([3, 3, 4]), VOCAB)
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])


_M64 = (1 << 64) - 1


def _ref_mix(z: int) -> int:
    """splitmix64's output function, on Python ints (the published algorithm)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _ref_noise(seed: int, position: int, token: int) -> float:
    draw = lambda key, i: _ref_mix((key + (i + 1) * 0x9E3779B97F4A7C15) & _M64)  # noqa: E731
    z = draw(draw(draw(seed & _M64, 0), position & _M64), token)
    return -math.log(((z >> 40) | 1) / 2**24)


def test_seeded_noise_is_splitmix64_over_int64_tensors() -> None:
    """The int64 tensor ops (wrapping products, masked arithmetic shifts) compute the
    published splitmix64 on 64-bit words: seeds and positions near and past the int64
    limits included."""
    seeds = [0, 1, 123, 2**62 + 5, 2**63 - 1, -1, -(2**63)]
    positions = [0, 1, 7, 1000, 2**31, 2**40 + 3, -1]
    noise = seeded_exponential(torch.tensor(seeds), torch.tensor(positions), 300)
    want = torch.tensor(
        [[_ref_noise(s, p, t) for t in range(300)] for s, p in zip(seeds, positions, strict=True)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(noise.double(), want, rtol=1e-6, atol=0)


def test_uniforms_give_finite_positive_exponentials() -> None:
    """Every 24-bit uniform the noise can use, (2m + 1) / 2**24, maps to a finite Exp(1) draw
    above 0 in float32 (so p / noise is never 0 / 0 = NaN, which argmax would pick), and a
    block of noise has the moments of Exp(1)."""
    u = torch.arange(1, 2**24, 2, dtype=torch.long).to(torch.float32).mul_(2.0**-24)
    e = u.log_().neg_()
    assert torch.isfinite(e).all() and (e > 0).all()
    noise = seeded_exponential(torch.arange(64), torch.arange(64) * 3, 4096).double()
    assert abs(noise.mean().item() - 1) < 0.01
    assert abs(noise.var().item() - 1) < 0.03
    assert abs((noise > 1).double().mean().item() - math.exp(-1)) < 0.005


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_seeded_draws_follow_the_distribution() -> None:
    """A small known distribution, sampled by one seed at many output positions, by many
    seeds at one position, and as pairs of consecutive positions (independence): the
    frequencies pass a chi-square test (deterministic seeds: the statistics are fixed; the
    bounds are the 1e-5 upper quantiles)."""
    probs = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    n = 20000
    logits = probs.log().expand(n, len(probs)).contiguous()
    sampler = Sampler(0, torch.device("cpu"))

    def sample(seeds: list[int], positions: list[int]) -> torch.Tensor:
        # A one-token prompt; the row ending at position k samples output position k (the
        # output tokens themselves are not needed: no penalties).
        items = [
            ScheduledRequest(
                Request("r", [1], SamplingParams(temperature=1.0, seed=seed)),
                start=k,
                num_tokens=1,
                token_ids=[0],
                block_ids=(0,),
                samples=True,
            )
            for seed, k in zip(seeds, positions, strict=True)
        ]
        return torch.tensor(sampler(logits[: len(items)], items)[0])

    by_position = sample([5] * n, list(range(n)))
    by_seed = sample(list(range(n)), [0] * n)
    for tokens in (by_position, by_seed):
        counts = torch.bincount(tokens, minlength=len(probs))
        assert _chi_square(counts, n * probs.double()) < 28.5  # 5 degrees of freedom
    pairs = by_position[0::2] * len(probs) + by_position[1::2]
    joint = torch.bincount(pairs, minlength=len(probs) ** 2)
    expected = (n // 2) * torch.outer(probs, probs).flatten().double()
    assert _chi_square(joint, expected) < 75.0  # 35 degrees of freedom


def _mixed_batch(copies: int) -> tuple[torch.Tensor, list[ScheduledRequest]]:
    """Every kind of row: greedy, top-k, top-p, min-p, penalties, seeded, unseeded, logprobs."""
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.7, seed=3),
        SamplingParams(temperature=1.1, min_p=0.1, seed=4, logprobs=2),
        SamplingParams(
            temperature=0.9,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            seed=5,
        ),
        SamplingParams(temperature=0, logprobs=0, repetition_penalty=0.9),
        SamplingParams(temperature=1.0, top_k=12, top_p=0.9, min_p=0.02, seed=6),
    ]
    items = [
        _item(f"r{c}-{i}", p, output=tuple(range(i + c)))
        for c in range(copies)
        for i, p in enumerate(kinds)
    ]
    logits = torch.randn(len(items), VOCAB, generator=torch.Generator().manual_seed(8))
    return logits, items


def test_pick_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: no host-device synchronisation inside ``pick`` (the picks are read later,
    once). On the CPU every tensor is a host tensor, so the guard is stricter than needed: no
    tensor at all is read into Python inside ``pick`` (its per-row parameters come from
    Python lists, never from tensors). Constrained rows read mid-way by design: none here."""
    logits, items = _mixed_batch(2)
    expected = Sampler(0, torch.device("cpu"))(logits, items)
    sampler = Sampler(0, torch.device("cpu"))  # the same shared draws for unseeded rows

    def forbidden(name: str):  # type: ignore[no-untyped-def]
        def read(*args: object, **kwargs: object) -> object:
            raise AssertionError(f"Tensor.{name} inside Sampler.pick")

        return read

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, forbidden(name))
        with pytest.raises(AssertionError, match="Tensor.item"):
            torch.ones(1).item()  # the guard is live
        picked = sampler.pick(logits, items)
    assert picked.read() == expected


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_pick_runs_the_same_operations_for_any_number_of_rows() -> None:
    """No Python loop over requests on the device path: a batch of every kind of row, and
    the same batch three times over, launch the same tensor operations, in the same order."""
    traces = []
    for copies in (1, 3):
        logits, items = _mixed_batch(copies)
        with _CountOps() as counted:
            Sampler(0, torch.device("cpu")).pick(logits, items)
        traces.append(counted.ops)
    assert traces[0] == traces[1]
    assert any("bitwise_xor" in op for op in traces[0])  # the seeded rows' noise ran


@pytest.mark.usefixtures("one_torch_thread")
def test_same_seed_same_output_across_engines_and_preemption(tiny_llama_gqa: Path) -> None:
    """End to end: the same seeded requests give the same tokens in two engines, one with a
    pool small enough to preempt and recompute them, the other with room for all; other
    seeds give other tokens."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 17, 30, 41)]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=12, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True
        )

    seeded = [params(100 + i) for i in range(len(prompts))]
    device = {"device": "cpu", "dtype": "float32", "enable_prefix_caching": False}
    roomy = LLM(str(tiny_llama_gqa), block_size=4, num_kv_blocks=96, **device)
    tight = LLM(
        str(tiny_llama_gqa), block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, **device
    )
    want = [o.token_ids for o in roomy.generate(prompts, seeded)]
    assert [o.token_ids for o in tight.generate(prompts, seeded)] == want
    assert tight.engine.scheduler.num_preemptions_total > 0
    alone = [roomy.generate([p], [s])[0].token_ids for p, s in zip(prompts, seeded, strict=True)]
    assert alone == want
    other = [o.token_ids for o in roomy.generate(prompts, [params(200 + i) for i in range(4)])]
    assert all(a != b for a, b in zip(other, want, strict=True))


@pytest.mark.parametrize("num", [0, 3])
def test_logprobs_are_the_raw_log_softmax(num: int) -> None:
    params = [SamplingParams(temperature=0, logprobs=num), SamplingParams(temperature=0)]
    items = [_item(str(i), p) for i, p in enumerate(params)]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    tokens, logprobs = Sampler(0, torch.device("cpu"))(logits, items)
    lp = torch.log_softmax(logits[0], dim=-1)
    assert logprobs[1] is None
    assert logprobs[0].token_id == tokens[0]
    assert logprobs[0].logprob == pytest.approx(float(lp[tokens[0]]))
    top = lp.topk(num) if num else None
    assert [t for t, _ in logprobs[0].top] == (top.indices.tolist() if top else [])


def test_logit_bias_moves_the_pick_and_leaves_the_logprobs_raw() -> None:
    """OpenAI's logit_bias, added before everything else: -100 bans the argmax, +100 forces
    a token, a sampled row draws from the biased logits' distribution, and the logprobs are
    the raw logits' (the sampler's rule)."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    best = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={best[0]: -100.0}),
        SamplingParams(temperature=0, logit_bias=((7, 100.0),), logprobs=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, logit_bias={3: 4.0, best[3]: -2.5}),
    ]
    assert params[0].logit_bias == ((best[0], -100.0),)  # a mapping is stored as its pairs
    items = [_item(str(i), p) for i, p in enumerate(params)]
    tokens, logprobs = Sampler(0, torch.device("cpu"))(logits, items)
    assert tokens[0] == logits[0].clone().index_fill_(0, torch.tensor(best[0]), -1e9).argmax()
    assert tokens[1] == 7 and tokens[2] == best[2]
    lp = logprobs[1]
    assert lp is not None
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[7]))
    assert lp.top[0][0] == best[1]  # the raw logits' best, not the forced token
    biased = logits[3].clone()
    biased[3] += 4.0
    biased[best[3]] -= 2.5
    torch.testing.assert_close(
        truncated_probs(apply_token_bias(logits[3:], [params[3].logit_bias]), params[3:])[0],
        _ref_probs(biased, params[3]),
    )


def test_logit_bias_is_checked() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="twice"):
        SamplingParams(logit_bias=((1, 1.0), (1, 2.0)))


@pytest.mark.usefixtures("one_torch_thread")
def test_the_engine_refuses_bias_and_stop_ids_past_the_vocabulary(tiny_llama_gqa: Path) -> None:
    """They index the logits on the device, where a bad index ends the CUDA context: the
    offline path checks them as the server does (a ValueError, nothing queued)."""
    engine = LLM(str(tiny_llama_gqa), device="cpu", dtype="float32", block_size=4).engine
    for params in (
        SamplingParams(logit_bias={256: 1.0}),
        SamplingParams(min_tokens=2, stop_token_ids=(300,)),
    ):
        with pytest.raises(ValueError, match=r"in \[0, 256\)"):
            engine.add_request("r", [5, 6], params)
    assert not engine.has_unfinished_requests()
    # Without min_tokens a stop id is only compared on the host: any id is harmless.
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=2, stop_token_ids=(300,)))
    assert engine.has_unfinished_requests()


@pytest.mark.usefixtures("one_torch_thread")
def test_logit_bias_greedy_matches_transformers_sequence_bias(tiny_llama_gqa: Path) -> None:
    """Greedy with a logit bias, token for token against transformers' generate() with the
    same biases (``sequence_bias`` over one-token sequences), in float32, alone and batched
    with unbiased requests, under the near-tie rule."""
    import transformers

    from tests.engine.parity import Reference, assert_parity, random_prompts

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_gqa), torch_dtype=torch.float32
    )
    prompts = random_prompts(21, (7, 19))
    llm = LLM(str(tiny_llama_gqa), device="cpu", dtype="float32", block_size=4)
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    unbiased = [o.token_ids for o in llm.generate(prompts, plain)]
    for prompt, tokens in zip(prompts, unbiased, strict=True):
        # Ban the first two tokens it would say, push two others up.
        bias = {tokens[0]: -100.0, tokens[1]: -100.0, 11: 3.5, 200: 1.25}
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                sequence_bias=[[[t], b] for t, b in bias.items()], pad_token_id=0,
                eos_token_id=None, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        want = out.sequences[0, len(prompt) :].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        ref = Reference(want, margins)
        biased = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias=bias)
        assert want != tokens
        alone = llm.generate([prompt], biased)[0].token_ids
        assert_parity(alone, ref, "alone")
        batched = llm.generate([prompt, *prompts], [biased, plain, plain])
        assert batched[0].token_ids == alone
        assert [o.token_ids for o in batched[1:]] == unbiased


def test_min_tokens_bans_the_stop_tokens_before_the_minimum() -> None:
    """Until a row samples output token ``min_tokens`` its stop tokens (EOS unless ignored,
    stop_token_ids) are -inf; a constrained row's are not (its grammar's end wins)."""
    params = SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=(7,), logit_bias={5: 1.0})
    request = Request("r", [1, 2], params, eos_token_id=4, eos_token_ids=(4, 9))
    inf = float("-inf")
    assert row_bias(request, 2) == ((5, 1.0), (4, inf), (7, inf), (9, inf))
    assert row_bias(request, 3) == ((5, 1.0),)
    ignoring = Request("r", [1], replace(params, ignore_eos=True), eos_token_id=4)
    assert row_bias(ignoring, 0) == ((5, 1.0), (7, inf))
    grammar = StructuredOutputParams("regex", "a+")
    assert row_bias(Request("r", [1], replace(params, structured=grammar), 4), 0) == ((5, 1.0),)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_a_greedy_min_tokens_row_past_its_minimum_takes_the_argmax_path(monkeypatch) -> None:
    """Only min_tokens kept such a row off the one-argmax path: past the minimum its batch
    takes that path again (no bias rows built), and picks what the general path picks."""
    import engine.sampler as sampler_module

    params = SamplingParams(temperature=0, max_tokens=9, min_tokens=2)
    assert not params.argmax_only and params.argmax_past_min_tokens
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    calls = []
    real = sampler_module.row_bias
    monkeypatch.setattr(sampler_module, "row_bias", lambda *a: calls.append(a) or real(*a))
    sampler = Sampler(0, torch.device("cpu"))
    before = [_item("a", params, output=(5,)), _item("b", SamplingParams(temperature=0))]
    sampler(logits, before)  # output position 1 < 2: the bias rows are built
    assert len(calls) == 2
    calls.clear()
    past = [_item("a", params, output=(5, 6)), _item("b", SamplingParams(temperature=0))]
    tokens, _ = sampler(logits, past)
    assert not calls
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.usefixtures("one_torch_thread")
def test_min_tokens_matches_transformers_min_new_tokens(tiny_llama_gqa: Path) -> None:
    """A stop token the model would say early, banned until min_tokens: the tokens of
    transformers' generate() with min_new_tokens and that token as its EOS, in float32."""
    import transformers

    from tests.engine.parity import Reference, assert_parity, random_prompts

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_gqa), torch_dtype=torch.float32
    )
    llm = LLM(str(tiny_llama_gqa), device="cpu", dtype="float32", block_size=4)
    for prompt in random_prompts(23, (6, 15)):
        plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True))[0].token_ids  # fmt: skip
        stop = plain[1]
        params = SamplingParams(max_tokens=12, min_tokens=6, temperature=0, ignore_eos=True,
                                stop_token_ids=(stop,))  # fmt: skip
        out = llm.generate([prompt], params)[0]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=6,
                do_sample=False, eos_token_id=[stop], pad_token_id=0, output_scores=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        want = ref.sequences[0, len(prompt) :].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in ref.scores]
        assert stop not in out.token_ids[:6] and len(out.token_ids) >= 6
        assert_parity(out.token_ids, Reference(want, margins), "min_tokens")
