"""engine/structured.py: the grammar cache, the logits hook and the matchers, on the tiny
byte-level tokenizer of tests/server/server_fakes.py (no model), then through a tiny random
Llama's offline engine."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler, _untied
from engine.structured import (
    GrammarCache,
    GrammarError,
    StructuredDecoder,
    choice_grammar,
    copy_rows,
)
from scheduler.output import ScheduledRequest
from scheduler.request import Request, StructuredOutputParams
from tests.engine.conftest import make_tiny_llama
from tests.server.server_fakes import tiny_tokenizer

PADDING = 8  # head rows past the tokenizer's tokens, as a padded output head has


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    tok = tiny_tokenizer()
    return GrammarCache(tok, len(tok) + PADDING, [tok.eos_token_id])


def _scheduled(request_id: str, params: SamplingParams | None = None) -> ScheduledRequest:
    request = Request(request_id, [1, 2, 3], params or SamplingParams())
    return ScheduledRequest(
        request, start=3, num_tokens=1, token_ids=[3], block_ids=(0,), samples=True
    )


def _decoder(
    cache: GrammarCache,
    grammars: dict[str, StructuredOutputParams],
    fill_threads: int = 2,
    check_first: bool = True,
) -> StructuredDecoder:
    decoder = StructuredDecoder(cache, fill_threads, check_first=check_first)
    for request_id, params in grammars.items():
        decoder.add(request_id, params)
        deadline = time.monotonic() + 10
        while not decoder.ready(request_id):
            assert time.monotonic() < deadline
            decoder.wait_any(0.1)
    return decoder


def test_cache_compiles_once_and_reports_who_compiled(cache: GrammarCache) -> None:
    params = StructuredOutputParams("regex", "(hello|world) [a-z]+")
    first, started = cache.compile(params)
    entry = first.result(timeout=10)
    assert started and entry.compile_s > 0
    again, started_again = cache.compile(params)
    assert again is first and not started_again


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("regex", "((", "parenthesis"),
        ("grammar", "root ::= missing", "missing"),
        ("json", '{"type": "nonsense"}', "nonsense"),
    ],
)
def test_bad_grammars_raise_with_the_compilers_reason(
    cache: GrammarCache, kind: str, spec: str, reason: str
) -> None:
    future, _ = cache.compile(StructuredOutputParams(kind, spec))
    with pytest.raises(GrammarError, match=reason) as info:
        future.result(timeout=10)
    assert not str(info.value).startswith("[")  # the C++ source location is stripped
    # Not cached: the next request compiles (and fails) on its own.
    assert cache.compile(StructuredOutputParams(kind, spec))[1]


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", '{"type": "nope"}'),
        ("json", '{"$ref": "#/$defs/missing"}'),
        ("json", '{"type": "integer", "minimum": 5, "maximum": 1}'),
        ("json", '{"type": "object", "properties": {"a": 3}}'),
        ("json", '{"type": "string", "pattern": "(("}'),
        ("json", '{"type": "object", "properties": {"s": {"type": "string", "maxLength": 9}}}'),
        ("regex", "[a-"),
        ("grammar", "root ::= missing"),
        ("choice", '["a", "b"]'),
    ],
)
def test_check_rejects_what_compile_rejects_with_the_same_reason(
    cache: GrammarCache, kind: str, spec: str
) -> None:
    params = StructuredOutputParams(kind, spec)

    def outcome(future) -> str | None:
        try:
            future.result(timeout=10)
        except GrammarError as exc:
            return str(exc)
        return None

    assert outcome(cache.check(params)) == outcome(cache.compile(params)[0])


def test_check_is_cached_and_does_not_wait_for_compilations(cache: GrammarCache) -> None:
    from concurrent.futures import Future

    params = StructuredOutputParams("json", '{"type": "object", "properties": {}}')
    first = cache.check(params)
    assert first.result(timeout=10) is None
    assert cache.check(params) is first
    # Every compile thread busy (a slow compilation each): a check still runs at once.
    blockers = [Future() for _ in range(4)]
    busy = [cache._executor.submit(b.result, 10) for b in blockers]
    try:
        fresh = StructuredOutputParams("json", '{"type": "array", "items": {"type": "integer"}}')
        assert cache.check(fresh).result(timeout=5) is None
    finally:
        for b in blockers:
            b.set_result(None)
        for f in busy:
            f.result(timeout=10)


def test_choice_grammar_escapes_quotes_and_backslashes() -> None:
    assert choice_grammar(['a "b"', "c\\d"]) == 'root ::= "a \\"b\\"" | "c\\\\d"'


def test_hook_without_constrained_rows_returns_the_logits_untouched(cache: GrammarCache) -> None:
    decoder = StructuredDecoder(cache, check_first=False)
    logits = torch.randn(3, cache.vocab_size)
    before = logits.clone()
    requests = [_scheduled(f"r{i}") for i in range(3)]
    assert decoder.mask_before_sampling(logits, requests) is logits
    assert torch.equal(logits, before)


def test_hook_masks_constrained_rows_only(cache: GrammarCache) -> None:
    tok = tiny_tokenizer()
    grammar = StructuredOutputParams("choice", '["hello", "world"]')
    decoder = _decoder(cache, {"c": grammar}, check_first=False)
    logits = torch.randn(3, cache.vocab_size)
    before = logits.clone()
    decoder.mask_before_sampling(logits, [_scheduled("a"), _scheduled("c"), _scheduled("b")])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed
    for token_id in allowed:
        piece = tok.decode([token_id])
        assert "hello".startswith(piece) or "world".startswith(piece), piece
    assert torch.equal(logits[1][allowed], before[1][allowed])
    assert all(t < len(tok) for t in allowed)  # padding rows of the head never


def test_rows_filled_in_parallel_equal_rows_filled_one_by_one(cache: GrammarCache) -> None:
    grammars = {
        "x": StructuredOutputParams("choice", '["hello", "world"]'),
        "y": StructuredOutputParams("regex", "(quick|lazy) [a-z]+"),
        "z": StructuredOutputParams("json", '{"type": "object"}'),
    }
    requests = [_scheduled(r) for r in ("a", "x", "y", "b", "z")]
    logits = torch.randn(5, cache.vocab_size)
    masked = []
    for fill_threads in (1, 3):
        decoder = _decoder(cache, grammars, fill_threads, check_first=False)
        masked.append(decoder.mask_before_sampling(logits.clone(), requests))
    assert torch.equal(masked[0], masked[1])
    assert torch.equal(masked[0][[0, 3]], logits[[0, 3]])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_checked_picks_equal_picks_from_masked_logits(cache: GrammarCache, device: str) -> None:
    """Picking on unmasked logits, checking, trying a refused row's next-best tokens and
    masking only rows left without a pick gives the tokens masking every constrained row
    first gives: greedy, seeded and unseeded sampling from the
    whole distribution (checked), top-p and top-k sampling (masked first in both modes),
    beside unconstrained rows, step after step with the matchers advanced."""
    tok = tiny_tokenizer()
    grammars = {
        "greedy": StructuredOutputParams("regex", "[a-z ]{0,80}x"),
        "seeded": StructuredOutputParams("json", '{"type": "object"}'),
        "shared": StructuredOutputParams("regex", "[a-z ]{0,80}x"),
        "top_p": StructuredOutputParams("choice", '["hello world", "lazy dog"]'),
        "top_k": StructuredOutputParams("regex", "(one|two|three) [a-z]{1,30}"),
    }
    params = {
        "greedy": SamplingParams(temperature=0),
        "seeded": SamplingParams(temperature=0.8, seed=7),
        "shared": SamplingParams(temperature=1.3),
        "top_p": SamplingParams(temperature=1.0, top_p=0.9),
        "top_k": SamplingParams(temperature=0.7, top_k=5),
        "plain": SamplingParams(temperature=0),
        "plain_random": SamplingParams(temperature=1.0),
    }
    requests = [_scheduled(r, p) for r, p in params.items()]
    checked = _decoder(cache, grammars, check_first=True)
    masked = _decoder(cache, grammars, check_first=False)
    samplers = []
    for decoder in (checked, masked):
        sampler = Sampler(seed=5, device=torch.device(device))
        sampler.constraint = decoder
        samplers.append(sampler)
    checks = {"picks": 0, "refused": 0, "next best": 0, "masked": 0}
    refused_rows, first_allowed, mask_rows = (
        checked.refused_rows,
        checked.first_allowed,
        checked.mask_rows,
    )

    def count_refused(token_ids: torch.Tensor, reqs: list[ScheduledRequest]) -> list[int]:
        refused = refused_rows(token_ids, reqs)
        rows = [r for r in reqs if checked.constrains(r.request_id)]
        checks["picks"] += sum(checked._checked(r) for r in rows)
        checks["refused"] += len(refused)
        return refused

    def count_next_best(
        candidates: list[list[int]], reqs: list[ScheduledRequest], rows: list[int]
    ) -> list[int | None]:
        firsts = first_allowed(candidates, reqs, rows)
        checks["next best"] += sum(first is not None for first in firsts)
        return firsts

    def count_masked(
        logits: torch.Tensor, reqs: list[ScheduledRequest], rows: list[int]
    ) -> torch.Tensor:
        checks["masked"] += sum(checked._checked(reqs[row]) for row in rows)
        return mask_rows(logits, reqs, rows)

    checked.refused_rows = count_refused  # type: ignore[method-assign]
    checked.first_allowed = count_next_best  # type: ignore[method-assign]
    checked.mask_rows = count_masked  # type: ignore[method-assign]
    # Letters and spaces get a lift, so picks inside the regexes are often allowed (checked
    # and kept) and often not (refused, then resolved by a next-best token or masked).
    lift = torch.zeros(cache.vocab_size)
    for token_id in range(len(tok)):
        if re.fullmatch("[a-wyz ]+", tok.decode([token_id])):
            lift[token_id] = 3.0
    generator = torch.Generator().manual_seed(1)
    for _ in range(40):
        logits = torch.randn(len(requests), cache.vocab_size, generator=generator) * 2 + lift
        picks = [sampler(logits.to(device, copy=True), requests)[0] for sampler in samplers]
        assert picks[0] == picks[1]
        for decoder in (checked, masked):
            decoder.accept([r.request_id for r in requests], picks[0])
            for request, token_id in zip(requests, picks[0], strict=True):
                if token_id == tok.eos_token_id:  # the engine would finish the request
                    decoder.remove(request.request_id)
    assert checks["picks"] - checks["refused"] >= 10, checks  # picks kept
    assert checks["next best"] >= 5 and checks["masked"] >= 5, checks  # refused: both ways


def test_a_refused_pick_whose_next_best_tokens_tie_is_left_to_the_mask(
    cache: GrammarCache,
) -> None:
    """Greedy: the refused best token, then two allowed tokens of equal logit. Masking
    picks the lower id of the two (argmax's rule), whatever order top-k lists them in."""
    tok = tiny_tokenizer()
    grammar = {"c": StructuredOutputParams("choice", '["hello", "world"]')}
    hello, world = tok.encode("hello")[0], tok.encode("world")[0]
    refused = tok.encode("one")[0]
    logits = torch.full((1, cache.vocab_size), -5.0)
    logits[0, refused], logits[0, hello], logits[0, world] = 10.0, 4.0, 4.0
    picks = []
    for check_first in (True, False):
        sampler = Sampler(seed=0, device=torch.device("cpu"))
        sampler.constraint = _decoder(cache, grammar, check_first=check_first)
        picks.append(sampler(logits.clone(), [_scheduled("c", SamplingParams(temperature=0))])[0])
    assert picks[0] == picks[1] == [min(hello, world)]
    assert _untied([5.0, 3.0, 2.0], 1) and not _untied([5.0, 3.0, 3.0], 1)
    assert not _untied([5.0, 3.0, 2.0], 2)  # the last entry: tokens past it may share it
    assert not _untied([5.0, float("-inf"), float("-inf")], 1)
    assert not _untied([float("nan"), 3.0], 0)


def test_top_p_rows_are_masked_first_and_greedy_rows_are_checked(cache: GrammarCache) -> None:
    decoder = _decoder(
        cache,
        {r: StructuredOutputParams("choice", '["hello", "world"]') for r in ("g", "p", "t")},
    )
    requests = [
        _scheduled("g", SamplingParams(temperature=0, top_p=0.5)),  # greedy: truncation moot
        _scheduled("p", SamplingParams(temperature=1.0, top_p=0.5)),
        _scheduled("t", SamplingParams(temperature=1.0)),
        _scheduled("u", SamplingParams(temperature=1.0, top_p=0.5)),  # unconstrained
    ]
    logits = torch.randn(4, cache.vocab_size)
    before = logits.clone()
    decoder.mask_before_sampling(logits, requests)
    changed = [not torch.equal(logits[i], before[i]) for i in range(4)]
    assert changed == [False, True, False, False]


def test_a_check_refuses_padding_ids_and_leaves_the_matcher_as_it_was(
    cache: GrammarCache,
) -> None:
    tok = tiny_tokenizer()
    grammar = StructuredOutputParams("choice", '["hello", "world"]')
    decoder, fresh = _decoder(cache, {"c": grammar}), _decoder(cache, {"c": grammar})
    requests = [_scheduled("c")]
    hello = tok.encode("hello")[0]
    padding = cache.vocab_size - 1  # a head row past the tokenizer's tokens
    assert decoder.refused_rows(torch.tensor([padding]), requests) == [0]
    assert decoder.refused_rows(torch.tensor([hello]), requests) == []
    a, b = torch.randn(1, cache.vocab_size), None
    b = a.clone()
    decoder.mask_rows(a, requests, [0])
    fresh.mask_rows(b, requests, [0])
    assert torch.equal(a, b)  # the accepted pick was rolled back


def test_copy_rows_writes_only_the_given_rows_at_their_own_indices() -> None:
    source = torch.arange(5 * 4, dtype=torch.int32).reshape(5, 4)
    target = torch.full((8, 4), -1, dtype=torch.int32)
    copy_rows(source, [3, 0], target)
    assert torch.equal(target[[0, 3]], source[[0, 3]])
    assert (target[[1, 2, 4, 5, 6, 7]] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_mask_on_cuda_logits_equals_the_cpu_mask(cache: GrammarCache) -> None:
    """Only the constrained rows' bitmasks are copied to the logits' device, and applied
    there (xgrammar's CUDA or Triton kernel): the same rows get the same -inf entries as on
    the CPU, with constrained rows apart, and after the rows move (the device buffer's
    stale rows are never read)."""
    grammars = {
        "c": StructuredOutputParams("regex", "(quick|lazy) [a-z]+"),
        "d": StructuredOutputParams("choice", '["hello", "dog"]'),
    }
    decoder = _decoder(cache, grammars, check_first=False)
    for order in (["a", "c", "b", "d", "e"], ["d", "a", "b", "c"], ["b", "c"]):
        requests = [_scheduled(r) for r in order]
        cpu = torch.randn(len(order), cache.vocab_size)
        cuda = cpu.to("cuda")
        decoder.mask_before_sampling(cpu, requests)
        decoder.mask_before_sampling(cuda, requests)
        assert torch.equal(cuda.cpu(), cpu), order


@pytest.mark.parametrize(
    ("params", "check"),
    [
        (StructuredOutputParams("regex", "[a-e]{3} (one|two)"), "regex"),
        (StructuredOutputParams("choice", '["quick", "lazy dog"]'), "choice"),
        (
            StructuredOutputParams(
                "json",
                json.dumps(
                    {
                        "type": "object",
                        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
                        "required": ["n"],
                    }
                ),
            ),
            "json",
        ),
    ],
)
def test_greedy_decoding_through_the_mask_ends_in_eos_inside_the_grammar(
    cache: GrammarCache, params: StructuredOutputParams, check: str
) -> None:
    """Random logits, argmax through the mask, matcher advanced: the text is in the
    language and the grammar's end allows EOS alone."""
    tok = tiny_tokenizer()
    decoder = _decoder(cache, {"r": params}, check_first=False)
    generator = torch.Generator().manual_seed(0)
    token_ids: list[int] = []
    for _ in range(64):
        logits = torch.randn(1, cache.vocab_size, generator=generator)
        decoder.mask_before_sampling(logits, [_scheduled("r")])
        token_id = int(logits.argmax())
        decoder.accept(["r"], [token_id])
        if token_id == tok.eos_token_id:
            break
        token_ids.append(token_id)
    else:
        pytest.fail("the grammar never ended")
    text = tok.decode(token_ids)
    if check == "regex":
        assert re.fullmatch(params.spec, text), text
    elif check == "choice":
        assert text in json.loads(params.spec)
    else:
        assert 3 <= json.loads(text)["n"] <= 9


# ---------------------------------------------------------------------------- offline engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    tok = tiny_tokenizer()
    path = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-structured"),
        num_kv_heads=2,
        vocab_size=len(tok) + PADDING,
        eos_token_id=tok.eos_token_id,
    )
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiny_llm(tiny_model: Path, request: pytest.FixtureRequest) -> LLM:
    """The offline engine, with synchronous steps and with asynchronous scheduling (where a
    step's masks are filled after the step before it is read)."""
    return LLM(
        str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=64,
        async_scheduling=request.param,
    )  # fmt: skip


def test_async_scheduling_gives_the_constrained_outputs_of_synchronous_steps(
    tiny_model: Path,
) -> None:
    """Greedy and seeded constrained requests beside plain ones: token for token what
    synchronous steps give (each step's masks follow every token before it)."""
    specs = [
        StructuredOutputParams("choice", '["one two", "lazy", "hello there"]'),
        StructuredOutputParams("regex", "(hello|stop) [a-z]{2,6}"),
        StructuredOutputParams("json", '{"type": "object", "properties": {"n": {"type": '
                               '"integer"}}, "required": ["n"]}'),
    ]  # fmt: skip
    prompts = ["the quick", "one two", "hello", "the quick", "lazy dog"]
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, structured=specs[0]),
        SamplingParams(max_tokens=12, temperature=0.9, seed=3, structured=specs[1]),
        SamplingParams(max_tokens=16, temperature=0.8, seed=5, structured=specs[2]),
        SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    ]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(
            str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=64,
            async_scheduling=async_scheduling,
        )  # fmt: skip
        outs.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)])
        assert llm.engine.structured.num_constrained == 0
    assert outs[1] == outs[0]


def test_engine_constrains_some_requests_and_leaves_the_others_alone(tiny_llm: LLM) -> None:
    tok = tiny_tokenizer()
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = tiny_llm.generate(["the quick"], plain)[0].token_ids
    choice = StructuredOutputParams("choice", '["one two", "lazy"]')
    regex = StructuredOutputParams("regex", "(hello|stop) [a-z]{2,4}")
    outs = tiny_llm.generate(
        ["the quick", "one two", "hello", "the quick"],
        [
            plain,
            SamplingParams(max_tokens=12, temperature=0, structured=choice),
            # ignore_eos cannot outlive the grammar: EOS still ends it once complete.
            SamplingParams(
                max_tokens=12, temperature=0.9, seed=3, structured=regex, ignore_eos=True
            ),
            plain,
        ],
    )
    assert outs[0].token_ids == alone == outs[3].token_ids
    assert tok.decode(outs[1].token_ids[:-1]) in ("one two", "lazy")
    assert outs[1].finish_reason == "stop" and outs[1].token_ids[-1] == tok.eos_token_id
    assert re.fullmatch(regex.spec, tok.decode(outs[2].token_ids[:-1]))
    assert outs[2].finish_reason == "stop"
    assert tiny_llm.engine.structured.num_constrained == 0  # matchers dropped at finish


def test_max_tokens_mid_structure_finishes_with_length(tiny_llm: LLM) -> None:
    schema = StructuredOutputParams("regex", "[a-z]{20}")
    out = tiny_llm.generate(["hello"], SamplingParams(max_tokens=3, structured=schema))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_a_request_waits_for_its_grammar_without_blocking_the_batch(tiny_llm: LLM) -> None:
    """A grammar still compiling parks its request; the others step on meanwhile."""
    engine = tiny_llm.engine
    cache = engine.grammars
    gate = cache._executor.submit(time.sleep, 0.5)  # both compile threads busy for a while
    gate2 = cache._executor.submit(time.sleep, 0.5)
    spec = StructuredOutputParams("regex", "(fresh|grammar) here")
    engine.add_request("plain", tok_ids("the quick"), SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("parked", tok_ids("hello"), SamplingParams(max_tokens=8, structured=spec))
    assert engine.num_unfinished_requests == 2
    with pytest.raises(ValueError, match="already in use"):  # parked, its id is taken
        engine.add_request("parked", tok_ids("hello"), SamplingParams(max_tokens=2))
    finished: dict[str, str | None] = {}
    steps_while_parked = 0
    while engine.has_unfinished_requests():
        if "parked" in engine._awaiting_grammar:
            steps_while_parked += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        engine.check_integrity()
    gate.result(), gate2.result()
    assert finished["plain"] == "length" and finished["parked"] in ("stop", "length")
    assert steps_while_parked >= 4  # "plain" ran to its end while "parked" waited


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(tiny_llm: LLM) -> None:
    """Offline nothing compiles first (the server does): the parked request ends with
    ``error`` and the compiler's reason; its neighbour is served."""
    engine = tiny_llm.engine
    bad = StructuredOutputParams("regex", "((")
    engine.add_request("bad", tok_ids("hello"), SamplingParams(max_tokens=3, structured=bad))
    engine.add_request("good", tok_ids("hello"), SamplingParams(max_tokens=3, temperature=0))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == "error"
    assert "parenthesis" in (finished["bad"].error or "")
    assert finished["good"].finish_reason == "length"


def test_constrained_requests_get_no_drafts_beside_speculating_ones(tmp_path_factory) -> None:
    """With ngram speculation on, a repetitive unconstrained prompt speculates while the
    constrained request decodes one token a step and still follows its grammar."""
    tok = tiny_tokenizer()
    path = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-structured-spec"),
        num_kv_heads=2,
        vocab_size=len(tok) + PADDING,
        eos_token_id=tok.eos_token_id,
    )
    tok.save_pretrained(path)
    llm = LLM(
        str(path), device="cpu", dtype="float32", num_kv_blocks=64, speculative_method="ngram"
    )
    regex = StructuredOutputParams("regex", "(hello|stop) [a-z]{2,4}")
    outs = llm.generate(
        ["one two three one two three one two three one two", "hello"],
        [
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0, structured=regex),
        ],
    )
    assert len(outs[0].token_ids) == 16
    assert re.fullmatch(regex.spec, tok.decode(outs[1].token_ids[:-1]))
    assert llm.engine.structured.num_constrained == 0


def tok_ids(text: str) -> list[int]:
    return list(tiny_tokenizer().encode(text))


def test_an_id_reused_after_an_abort_starts_its_grammar_afresh(tiny_model: Path) -> None:
    """Asynchronous scheduling: a constrained request aborted while its token is on the
    device, then its id reused at once for the same request. The aborted row's token is
    read in the next step, and must not advance the new request's grammar: the new request
    gets what the same request gets on a fresh engine."""
    spec = StructuredOutputParams("regex", "[a-z]{4,9}")  # the old token fits anywhere
    params = SamplingParams(max_tokens=16, temperature=0, structured=spec)
    prompt = tok_ids("hello")
    llm = LLM(
        str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=64,
        async_scheduling=True,
    )  # fmt: skip
    expected = llm.generate([prompt], params)[0].token_ids
    engine = llm.engine
    engine.add_request("r", prompt, params)
    seen = 0
    while seen < 3:  # a few tokens out, and one more on the device
        seen += sum(len(o.new_token_ids) for o in engine.step())
    assert engine._in_flight is not None
    (aborted,) = engine.abort_request(["r"])
    assert aborted.finish_reason == "abort"
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        engine.check_integrity()
    assert tokens == expected


def test_constrained_requests_score_their_prompt_and_a_failed_grammar_holds_nothing(
    tiny_model: Path,
) -> None:
    """A grammar's request parks until its grammar compiles, then scores its prompt
    (``prompt_logprobs``) as an unconstrained one does; one whose grammar fails ends with an
    error and leaves nothing held."""
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    prompt = list(range(5, 40))
    requests = {
        "plain": None,
        "good": StructuredOutputParams("regex", "[ab]+"),
        "bad": StructuredOutputParams("regex", "["),
    }
    for rid, structured in requests.items():
        params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1,
                                structured=structured)  # fmt: skip
        engine.add_request(rid, prompt, params)
    got, reasons = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons["bad"] == "error" and set(got) == {"plain", "good"}
    assert len(got["good"]) == len(prompt) and got["good"][0] is None
    for mine, plain in zip(got["good"][1:], got["plain"][1:], strict=True):
        assert mine is not None and plain is not None
        assert (mine.token_id, mine.rank, mine.top[0][0]) == (plain.token_id, plain.rank,
                                                             plain.top[0][0])  # fmt: skip
        assert mine.logprob == pytest.approx(plain.logprob, abs=1e-5)
    assert not engine.prompt_logprobs
