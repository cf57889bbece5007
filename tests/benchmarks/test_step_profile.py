"""The fused stack's step profile (kernels/cpu/csrc/decoder_layer.cpp) and the benchmark that
prints it (benchmarks/step_profile.py)."""

from __future__ import annotations

import pytest

from benchmarks.step_profile import format_round, read_bytes, run
from engine import LLM, SamplingParams
from kernels import cpu as cpu_kernels
from tests.engine.conftest import tiny_llama_cpu_shapes  # noqa: F401 - a fixture

# float32 on the CPU wherever the suite runs: the C++ kernels are a CPU float32 path, and a
# CUDA machine would otherwise build the engine on the GPU in bfloat16.
DEVICE = {"device": "cpu", "dtype": "float32"}
KERNELS = len(cpu_kernels.STEP_KERNELS)


@pytest.fixture
def tiny(tiny_llama_cpu_shapes):  # noqa: F811 - the imported fixture
    return tiny_llama_cpu_shapes


def _generate(llm: LLM) -> list:
    prompts = [[5, 9, 17, 33, 60], [7, 8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=2))
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def test_profile_times_every_kernel_of_every_layer_and_changes_nothing(ops, tiny):
    llm = LLM(str(tiny), attention_backend="cpu", **DEVICE)
    layers = len(llm.engine.model.layers)
    ops.step_profile(False)
    plain = _generate(llm)
    assert ops.step_profile_read().sum().item() == 0  # off: nothing is recorded

    ops.step_profile(True)
    try:
        profiled = _generate(llm)
        read = ops.step_profile_read().tolist()
        again = ops.step_profile_read().tolist()
    finally:
        ops.step_profile(False)
    assert profiled == plain  # bitwise: the profile only reads the clock
    kernel_s, stack_s, timed_layers = read[:KERNELS], read[KERNELS], read[KERNELS + 1]
    assert len(read) == KERNELS + 2
    assert all(s > 0 for s in kernel_s), dict(zip(cpu_kernels.STEP_KERNELS, kernel_s, strict=True))
    assert stack_s >= sum(kernel_s)
    # One stack call a step (a prefill step, then 5 decode steps of both requests).
    assert timed_layers == layers * 6
    assert again == [0.0] * (KERNELS + 2)  # a read resets


def test_stack_objects_are_made_once(ops, tiny):
    llm = LLM(str(tiny), attention_backend="cpu", **DEVICE)
    forward = llm.engine.runner.model
    first = forward.stack_weights
    assert first.size() == 18 * len(llm.engine.model.layers) + 6  # then embed, final norm, head
    _generate(llm)
    assert forward.stack_weights is first
    storage = llm.engine.storage
    caches = forward.stack_caches(storage.key_caches, storage.value_caches)
    assert forward.stack_caches(storage.key_caches, storage.value_caches) is caches


def test_benchmark_round_accounts_for_the_step(ops, tiny):
    (r,) = run(
        ["float32"],
        rounds=1,
        prompt_tokens=12,
        output_tokens=5,
        model=str(tiny),
        probe=lambda: 10e9,
    )
    assert r.matmul_weights == "float32" and r.steps == 4  # the prefill step is not counted
    names = [p.name for p in r.parts]
    assert names[:KERNELS] == list(cpu_kernels.STEP_KERNELS)
    assert names[KERNELS:] == [
        "stack between kernels",
        "rest of the forward",
        "outside the forward",
    ]
    # The parts are the step, split: they add up to its wall time.
    assert sum(p.seconds for p in r.parts) == pytest.approx(r.step_s, rel=1e-6)
    llm = LLM(str(tiny), attention_backend="cpu", **DEVICE, matmul_weights="float32")
    spec = llm.engine.runner.model.spec
    qkv = next(p for p in r.parts if p.name == "qkv_proj")
    assert qkv.bytes == sum(read_bytes(layer.qkv) for layer in spec.layers)
    # float32: the packed panels, which a one-row matmul reads
    assert qkv.bytes == sum(layer.qkv.packed.numel() * 4 for layer in spec.layers)
    head = next(p for p in r.parts if p.name == "head")
    assert head.bytes == read_bytes(spec.head.head) and head.seconds > 0
    assert r.floor_s == pytest.approx((sum(p.bytes for p in r.parts if p.bytes)) / 10e9)
    text = format_round(r)
    assert "float32 weights, probe 10.0 GB/s, 4 decode steps" in text
    assert "qkv_proj" in text and "outside the forward" in text
