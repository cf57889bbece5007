"""EOS ids and sampling defaults read from the checkpoint (engine/generation_config.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine import LLM, SamplingParams
from engine.generation_config import (
    SamplingDefaults,
    end_of_turn_token,
    eos_token_ids,
    sampling_defaults,
)
from server.protocol import ChatCompletionRequest
from server.validation import choice_params
from tests.engine.conftest import make_tiny_llama
from tests.server.server_fakes import tiny_tokenizer

ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 8}


def _write(path, name: str, **updates) -> None:
    file = path / name
    data = json.loads(file.read_text()) if file.is_file() else {}
    data.update(updates)
    file.write_text(json.dumps(data))


def test_eos_ids_come_from_every_source_in_order():
    tok = tiny_tokenizer()  # eos <|im_end|>; its template closes turns with <|im_end|>
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = eos_token_ids({"eos_token_id": [7, 9]}, {"eos_token_id": [9, 11, 12]}, tok)
    assert ids == (7, 9, 11, 12, im_end)
    assert eos_token_ids({"eos_token_id": 5}, {}, None) == (5,)
    assert eos_token_ids({}, {"eos_token_id": None}, None) == ()


def test_end_of_turn_is_the_special_token_after_the_assistant_content():
    tok = tiny_tokenizer()
    # The tokenizer's own EOS differs from the template's end of turn, as in Llama 3
    # (<|end_of_text|> against <|eot_id|>): the template's token is found by rendering it.
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>")
    tok.chat_template = tiny_tokenizer().chat_template
    assert end_of_turn_token(tok) == tok.convert_tokens_to_ids("<|im_end|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token(tok) is None  # a plain newline is no end-of-turn token
    tok.chat_template = None
    assert end_of_turn_token(tok) is None


def test_sampling_defaults_apply_only_to_fields_a_request_leaves_unset():
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 3}
    defaults = sampling_defaults(gen, "auto")
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    assert sampling_defaults(gen, "none") == SamplingDefaults()
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = choice_params(req, max_tokens=4, logprobs=None, choice=0, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)
    own = choice_params(req, max_tokens=4, logprobs=None, choice=0)
    assert (own.temperature, own.top_p, own.top_k) == (1.0, 0.5, 0)


def _unique_stops(tokens: list[int], eos: int, count: int) -> list[int]:
    """``count`` indices (past the first two) of tokens that occur once in ``tokens`` and are
    not the model's own EOS, spread out: each is the first stop id its stretch reaches."""
    once = [i for i, t in enumerate(tokens) if i >= 2 and tokens.count(t) == 1 and t != eos]
    assert len(once) >= count, f"too few distinct tokens in {tokens}"
    step = len(once) // count
    return [once[k * step] for k in range(count)]


def test_a_checkpoint_with_several_eos_ids_stops_at_each(tmp_path):
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=5)
    prompt = [5, 17, 33, 8, 90, 41, 7]
    free = LLM(str(path), **ENGINE).generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    tokens = free.token_ids
    stops = _unique_stops(tokens, eos=2, count=3)
    ids = [tokens[i] for i in stops]
    # One id in config.json beside the model's own, two in generation_config.json.
    _write(path, "config.json", eos_token_id=[2, ids[0]])
    _write(path, "generation_config.json", eos_token_id=ids[1:], temperature=0.0)
    llm = LLM(str(path), **ENGINE)
    assert set(ids) <= set(llm.engine.eos_token_ids)
    # generation_config.json's temperature 0 is the default: greedy without asking for it.
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=24)
    assert params.temperature == 0.0
    # Each stretch resumes right after the previous stop and ends at the next id.
    start = 0
    for stop in stops:
        out = llm.generate([prompt + tokens[:start]], params)[0]
        assert out.token_ids == tokens[start : stop + 1], (stop, out.token_ids)
        assert (out.finish_reason, out.stop_reason) == ("stop", None)  # the model's EOS
        start = stop + 1
    # A request's own stop id is its stop_reason (vLLM's), with the checkpoint's EOS ids beside.
    own = dataclasses.replace(params, stop_token_ids=(tokens[stops[0] - 1],))
    out = llm.generate([prompt], own)[0]
    assert out.token_ids == tokens[: stops[0]]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[stops[0] - 1])
    none = LLM(str(path), generation_config="none", **ENGINE)
    assert none.get_default_sampling_params().temperature == 1.0


def test_generation_config_flag_is_checked():
    with pytest.raises(ValueError, match="generation_config must be auto or none"):
        from engine.config import EngineConfig

        EngineConfig(generation_config="vllm")


def test_a_completed_grammar_ends_at_every_eos_id(tmp_path):
    """Structured output (engine/structured.py): once the grammar is complete, the mask
    allows each of the checkpoint's EOS ids, and nothing else."""
    import time

    import torch

    from engine.structured import StructuredDecoder
    from scheduler.output import ScheduledRequest
    from scheduler.request import Request, StructuredOutputParams

    tok = tiny_tokenizer()
    path = make_tiny_llama(
        tmp_path, num_kv_heads=2, vocab_size=len(tok) + 8, eos_token_id=tok.eos_token_id
    )
    tok.save_pretrained(path)
    other = tok.convert_tokens_to_ids("x")  # a second EOS id, as Llama 3's <|eot_id|>
    _write(path, "generation_config.json", eos_token_id=[tok.eos_token_id, other])
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.grammars is not None
    assert {tok.eos_token_id, other} <= set(llm.engine.eos_token_ids)
    decoder = StructuredDecoder(llm.engine.grammars, check_first=False)
    decoder.add("r", StructuredOutputParams("choice", '["hello"]'))
    deadline = time.monotonic() + 10
    while not decoder.ready("r"):
        assert time.monotonic() < deadline
        decoder.wait_any(0.1)
    for token_id in tok.encode("hello", add_special_tokens=False):
        decoder.accept(["r"], [token_id])
    request = Request("r", [1, 2, 3], SamplingParams())
    row = ScheduledRequest(request, start=3, num_tokens=1, token_ids=[3], block_ids=(0,),
                           samples=True)  # fmt: skip
    logits = torch.zeros(1, llm.engine.model_config.vocab_size)
    decoder.mask_before_sampling(logits, [row])
    allowed = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    assert allowed == set(llm.engine.eos_token_ids)
    # ignore_eos cannot outlive the grammar: every EOS id becomes a stop id.
    choice = StructuredOutputParams("choice", '["hello"]')
    params = llm.engine._constrain("s", SamplingParams(structured=choice, ignore_eos=True))
    assert set(llm.engine.eos_token_ids) <= set(params.stop_token_ids)
