"""The three batching modes x both block-allocation modes give the same greedy tokens, end to end.

Only the policy differs between modes (same model, pool and kernels), so every request must
get exactly the tokens transformers' generate() gives it alone; a divergence is accepted only
at a reference near-tie (tests/engine/parity.py). The pool is small enough that optimistic
block allocation preempts; mixed max_tokens and a few stop tokens make members of a static batch
finish early, so static and dynamic batches carry padding.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kvpool.config import KVPoolConfig
from scheduler import SchedulerConfig, SchedulerOutput
from scheduler.request import PENDING_TOKEN
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import Reference, assert_parity, hf_greedy, random_prompts

EOS = 2
PROMPT_LENS = [1, 3, 8, 15, 16, 17, 30, 45, 60, 75, 90, 5]
MAX_TOKENS = [12, 30, 5, 20, 1, 25, 16, 9, 28, 14, 22, 18]
# 4 sequences, 64 tokens a step, 10 blocks of 16 tokens (160 tokens, the largest request
# needs 112): optimistic allocation must preempt, reserve allocation must hold requests back.
POOL = {"block_size": 16, "num_kv_blocks": 10, "max_num_seqs": 4, "max_num_batched_tokens": 64}
# float32 on CPU: the parity reference is transformers in float32, even where a GPU is lent.
DEVICE = {"device": "cpu", "dtype": "float32"}
MODES = [(b, a) for b in ("continuous", "static", "dynamic") for a in ("optimistic", "reserve")]
STOP_AT = {1: 10, 5: 7, 8: 15}  # request -> the output index whose token becomes its stop token


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256, fixed seed, no tokenizer.
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-batching"), num_kv_heads=2, seed=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(11, tuple(PROMPT_LENS))


@pytest.fixture(scope="module")
def full_references(model_path: Path, prompts: list[list[int]]) -> list[Reference]:
    """transformers' greedy output of each request alone, without stop tokens."""
    hf = LlamaForCausalLM.from_pretrained(model_path).eval()
    return [hf_greedy(hf, p, m, eos_token_id=EOS) for p, m in zip(prompts, MAX_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def stop_token_ids(full_references: list[Reference]) -> dict[int, int]:
    return {i: full_references[i].token_ids[k] for i, k in STOP_AT.items()}


@pytest.fixture(scope="module")
def references(full_references: list[Reference], stop_token_ids: dict[int, int]) -> list[Reference]:
    """The expected outputs: greedy is deterministic, so with a stop token a request's output
    is the full output cut after the stop token's first occurrence."""
    refs = []
    for i, ref in enumerate(full_references):
        n = len(ref.token_ids)
        if i in stop_token_ids:
            n = ref.token_ids.index(stop_token_ids[i]) + 1
        refs.append(Reference(ref.token_ids[:n], ref.margins[:n]))
    return refs


@pytest.fixture(scope="module")
def params(stop_token_ids: dict[int, int]) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=m,
            temperature=0.0,
            stop_token_ids=(stop_token_ids[i],) if i in stop_token_ids else (),
        )
        for i, m in enumerate(MAX_TOKENS)
    ]


def _finish_reason(ref: Reference, max_tokens: int) -> str:
    return "length" if len(ref.token_ids) == max_tokens and ref.token_ids[-1] != EOS else "stop"


class PlanRecorder:
    """Wraps a scheduler's ``schedule()`` to count padding rows and check integrity."""

    def __init__(self, engine: LLMEngine) -> None:
        self.scheduler = engine.scheduler
        self._schedule = engine.scheduler.schedule
        self.num_padding_tokens = 0
        self.num_steps = 0
        engine.scheduler.schedule = self  # type: ignore[method-assign]

    def __call__(self) -> SchedulerOutput:
        self.scheduler.check_integrity()
        out = self._schedule()
        self.scheduler.check_integrity()
        self.num_padding_tokens += out.num_padding_tokens
        self.num_steps += 1
        return out


def _check(outputs: list[list[int]], references: list[Reference], label: str) -> list[str]:
    notes = []
    for i, (ours, ref) in enumerate(zip(outputs, references, strict=True)):
        note = assert_parity(ours, ref, label=f"{label} request {i}")
        if note:
            notes.append(note)
    return notes


@pytest.mark.parametrize(("batching", "block_allocation"), MODES)
def test_modes_return_identical_greedy_tokens(
    model_path: Path,
    prompts: list[list[int]],
    references: list[Reference],
    params: list[SamplingParams],
    batching: str,
    block_allocation: str,
) -> None:
    llm = LLM(
        str(model_path), batching=batching, block_allocation=block_allocation, **POOL, **DEVICE  # type: ignore[arg-type]
    )
    recorder = PlanRecorder(llm.engine)
    outs = llm.generate(prompts, params)
    tokens = [o.token_ids for o in outs]
    # Identical to transformers alone (so identical across modes), but for reported near-ties.
    notes = _check(tokens, references, f"{batching}/{block_allocation}")
    if not notes:
        for out, ref, m in zip(outs, references, MAX_TOKENS, strict=True):
            assert out.finish_reason == _finish_reason(ref, m)
        assert [o.finish_reason for o in outs].count("stop") >= len(STOP_AT)

    scheduler = llm.engine.scheduler
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks
    if block_allocation == "reserve":
        assert scheduler.num_preemptions_total == 0
    else:
        assert scheduler.num_preemptions_total > 0
    # Static/dynamic default to static_finished="compute": early finishers are padding.
    assert (recorder.num_padding_tokens > 0) == (batching != "continuous")


@pytest.mark.parametrize("block_allocation", ["optimistic", "reserve"])
def test_async_scheduling_returns_identical_greedy_tokens(
    model_path: Path,
    prompts: list[list[int]],
    references: list[Reference],
    params: list[SamplingParams],
    block_allocation: str,
) -> None:
    """Each step scheduled and launched before the one in flight is read (its decodes fed
    the pending tokens on the device): transformers' tokens and finish reasons still, with
    preemption of requests whose last token is pending, chunked prompts, stop tokens met
    while the next step is already scheduled, and the pool consistent at every step."""
    llm = LLM(
        str(model_path), batching="continuous", block_allocation=block_allocation,
        async_scheduling=True, **POOL, **DEVICE,  # type: ignore[arg-type]
    )  # fmt: skip
    recorder = PlanRecorder(llm.engine)
    pending_inputs = 0
    real_schedule = recorder._schedule

    def schedule() -> SchedulerOutput:
        nonlocal pending_inputs
        out = real_schedule()
        pending_inputs += sum(1 for s in out.scheduled if s.token_ids[0] == PENDING_TOKEN)
        return out

    recorder._schedule = schedule  # type: ignore[method-assign]
    outs = llm.generate(prompts, params)
    notes = _check([o.token_ids for o in outs], references, f"async/{block_allocation}")
    if not notes:
        for out, ref, m in zip(outs, references, MAX_TOKENS, strict=True):
            assert out.finish_reason == _finish_reason(ref, m)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.check_integrity()
    # The steps did overlap: most decodes took their input from the step before.
    assert pending_inputs > sum(MAX_TOKENS) // 2
    if block_allocation == "optimistic":
        assert engine.scheduler.num_preemptions_total > 0


def test_static_skip_and_a_dynamic_window_return_the_same_tokens(
    model_path: Path,
    prompts: list[list[int]],
    references: list[Reference],
    params: list[SamplingParams],
) -> None:
    """Through LLMEngine for the knobs LLM() does not expose: static_finished="skip", and a
    dynamic window that holds the first requests back. The loop idles on
    ``next_admission_time()`` as the server's engine thread does, instead of spinning."""
    for config in (
        SchedulerConfig(batching="static", static_finished="skip", max_num_seqs=4,
                        max_num_batched_tokens=64),
        SchedulerConfig(batching="dynamic", batch_wait_ms=30.0, max_num_seqs=5,
                        max_num_batched_tokens=64),
    ):  # fmt: skip
        engine = LLMEngine(
            EngineConfig(model=str(model_path), **DEVICE),
            KVPoolConfig(num_blocks=POOL["num_kv_blocks"]),
            config,
        )
        recorder = PlanRecorder(engine)
        tokens: dict[str, list[int]] = {}
        num_sleeps = 0
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params[i])
            if i == 2:
                # 3 requests < max_num_seqs: dynamic holds them for the window (an empty
                # step); static takes them as its first batch at once.
                first = engine.step()
                assert (first == []) == (config.batching == "dynamic")
                wake = engine.scheduler.next_admission_time()
                assert (wake is not None) == (config.batching == "dynamic")
                for out in first:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_unfinished_requests():
            wake = engine.scheduler.next_admission_time()
            if wake is not None:
                num_sleeps += 1
                time.sleep(max(0.0, wake - time.monotonic()))
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs = [tokens[f"r{i}"] for i in range(len(prompts))]
        _check(outputs, references, f"{config.batching}/{config.static_finished}")
        assert engine.num_free_blocks == engine.num_total_blocks
        if config.batching == "static":
            assert recorder.num_padding_tokens == 0 and num_sleeps == 0
        else:
            assert recorder.num_padding_tokens > 0
