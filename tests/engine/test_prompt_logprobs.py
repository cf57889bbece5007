"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability
given the tokens before it, its rank and the top-N, against transformers' ``log_softmax`` over
the whole prompt, through chunked prompts, a step cap on scored tokens, preemption (the
prompt recomputed), prefix caching beside requests that use it, asynchronous steps, n-gram
speculation, the prefill graphs' stand-in and aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import scheduler.step_budget
from engine import LLM, SamplingParams
from engine.outputs import TokenLogprob
from tests.engine.graph_stand_ins import install_prefill_stand_in
from tests.triton_devices import TRITON_DEVICES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = {"device": "cpu", "dtype": "float32"}
TOP = 3
# Two log-probabilities this close are a tie for the rank and the top-N's order: float32
# sums over another batch shape may order them either way.
TIE = 1e-4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """A shared 20-token system prompt (cached by the requests that do not score), a
    one-token prompt (nothing to score) and prompts longer than a step's budget."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 256, (20,), generator=g).tolist()
    return [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 45, 3, 70)] + [
        [7]
    ]


@pytest.fixture(scope="module")
def references(tiny_llama_cpu_shapes: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log_softmax at every prompt position, one [len - 1, vocab] per prompt."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_cpu_shapes).eval()
    with torch.inference_mode():
        return [
            torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].float(), -1) for p in prompts
        ]


def assert_matches(
    got: list[TokenLogprob | None] | None,
    prompt: list[int],
    ref: torch.Tensor,
    tie: float = TIE,
    top: int = TOP,
) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:]):
        assert entry is not None and entry.rank is not None
        row = ref[i]
        assert entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(float(row[prompt[i + 1]]), abs=tie)
        # Ties aside, the rank counts the tokens more likely than the prompt's.
        above = int((row > entry.logprob + tie).sum())
        assert above + 1 <= entry.rank <= int((row > entry.logprob - tie).sum()) + 1
        values, ids = row.topk(top)
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=tie)
        for (token, value), ref_id in zip(entry.top, ids.tolist(), strict=True):
            assert token == ref_id or float(row[token]) == pytest.approx(value, abs=tie)


def _run(
    llm: LLM,
    prompts: list[list[int]],
    scored: set[int] | dict[int, int],
    *,
    abort: str | None = None,
):
    """Add every prompt at once (scored ones ask for prompt logprobs: TOP alternatives, or
    as many as ``scored`` maps them to), step to the end."""
    top = scored if isinstance(scored, dict) else dict.fromkeys(scored, TOP)
    engine = llm.engine
    results: dict[str, list[TokenLogprob | None] | None] = {}
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=top.get(i))  # fmt: skip
        engine.add_request(f"r{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                assert out.request_id not in results, "prompt logprobs handed out twice"
                assert out.num_output_tokens == len(out.new_token_ids), "not with the first token"
                results[out.request_id] = out.prompt_logprobs
        engine.check_integrity()
        steps += 1
        if abort is not None and steps == 2:
            engine.abort_request([abort])
        assert steps < 500
    assert not engine.prompt_logprobs, "a finished request's prompt logprobs are still held"
    assert engine.num_free_blocks == engine.num_total_blocks
    return results, tokens


VARIANTS = {
    "sync": {},
    "async": {"async_scheduling": True},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logprobs_match_transformers_through_chunks_preemption_and_caching(
    tiny_llama_cpu_shapes: Path,
    prompts: list[list[int]],
    references: list[torch.Tensor],
    variant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At most 8 scored tokens a step: the 90-token prompt takes 12 steps or more.
    monkeypatch.setattr(scheduler.step_budget, "MAX_SCORED_TOKENS", 8)
    common = {"block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 32, **DEVICE}
    plain, plain_tokens = _run(
        LLM(str(tiny_llama_cpu_shapes), num_kv_blocks=64, **common), prompts, set()
    )
    assert plain == {}
    scored = {1, 3, 4}  # 0 and 2 share the system prompt and read it from the cache
    llm = LLM(str(tiny_llama_cpu_shapes), num_kv_blocks=7, **common, **VARIANTS[variant])  # type: ignore[arg-type]
    got, tokens = _run(llm, prompts, scored)
    assert set(got) == {f"r{i}" for i in scored}
    for i in scored:
        assert_matches(got[f"r{i}"], prompts[i], references[i])
    assert tokens == plain_tokens, "asking for prompt logprobs changed the output"
    engine = llm.engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv_manager.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("beside", [None, TOP], ids=["alone", "beside-a-top-n"])
def test_no_alternatives(
    tiny_llama_cpu_shapes: Path,
    prompts: list[list[int]],
    references: list[torch.Tensor],
    beside: int | None,
) -> None:
    """``prompt_logprobs=0`` (each position's own token and rank, no alternatives), whether
    every scored row of a step asks for none or another in the same step asks for some."""
    llm = LLM(str(tiny_llama_cpu_shapes), num_kv_blocks=64, block_size=16, **DEVICE)
    scored = {1: 0, 3: 0} if beside is None else {1: 0, 3: beside}
    got, _ = _run(llm, prompts, scored)
    assert set(got) == {"r1", "r3"}
    for i, top in scored.items():
        assert_matches(got[f"r{i}"], prompts[i], references[i], top=top)
        assert all(len(entry.top) == top for entry in got[f"r{i}"][1:])


def test_the_step_cap_bounds_scored_tokens(
    tiny_llama_cpu_shapes: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler.step_budget, "MAX_SCORED_TOKENS", 8)
    llm = LLM(str(tiny_llama_cpu_shapes), block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=64, **DEVICE)  # fmt: skip
    schedule = llm.engine.scheduler.schedule
    steps = []

    def watching(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = schedule(*args, **kwargs)
        steps.append([(s.request_id, s.num_tokens, s.num_scored) for s in out.scheduled])
        return out

    llm.engine.scheduler.schedule = watching  # type: ignore[method-assign]
    _run(llm, prompts[3:4] + prompts[:1], {0})
    scored = [sum(n for rid, _, n in step if rid == "r0") for step in steps]
    assert max(scored) == 8 and sum(scored) == len(prompts[3]) - 1
    # The request that does not score is not held back by the cap: its prompt (32 tokens)
    # goes in the first step beside the scored chunk.
    assert ("r1", 32, 0) in steps[0]


def test_graph_stand_in_and_an_abort_mid_prompt(
    tiny_llama_cpu_shapes: Path, prompts: list[list[int]], references: list[torch.Tensor]
) -> None:
    """Steps with scored rows replaying the prefill graphs (their logits rows follow the
    step's own rows); a scored request aborted before its first token leaves nothing held."""
    llm = LLM(str(tiny_llama_cpu_shapes), block_size=16, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, attention_backend="torch", **DEVICE)  # fmt: skip
    graphs = install_prefill_stand_in(llm.engine, [16, 32])
    got, _ = _run(llm, prompts, {0, 1, 3, 4}, abort="r3")
    assert set(got) == {"r0", "r1", "r4"}
    for i in (0, 1, 4):
        assert_matches(got[f"r{i}"], prompts[i], references[i])
    assert got["r4"] == [None]  # one token: nothing comes before it
    assert graphs.replays["whole"] + graphs.replays["pieces"] > 0


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_the_triton_path_with_its_graphs(
    tiny_llama_cpu_shapes: Path,
    prompts: list[list[int]],
    references: list[torch.Tensor],
    device: str,
) -> None:
    """The GPU's path: Triton kernels, asynchronous steps and, on CUDA, the captured decode
    and prefill graphs (whose logits rows are the step's own, scored rows included)."""
    llm = LLM(str(tiny_llama_cpu_shapes), block_size=16, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, attention_backend="triton", async_scheduling=True,
              device=device, dtype="float32")  # fmt: skip
    got, _ = _run(llm, prompts[:2], {0, 1})
    # float32 matmuls on a GPU may round through TF32 in the kernels: a looser bound there.
    for i in (0, 1):
        tie = TIE if device == "cpu" else 3e-3
        assert_matches(got[f"r{i}"], prompts[i], references[i], tie=tie)


def test_prompt_logprobs_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
