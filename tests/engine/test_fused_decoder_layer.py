"""The fused C++ decoder stack (cpu backend: every layer of a step in one call) against the
same C++ kernels called one at a time from Python, in the stack's order, on the same
``StackSpec``: tokens and logprobs must be bitwise equal."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends.cpu import CpuForward, Matmul
from kernels import cpu as cpu_kernels
from tests.engine.conftest import make_tiny_llama

# float32 on the CPU wherever the suite runs: the C++ kernels are a CPU float32 path, and a
# CUDA machine would otherwise build the engine on the GPU in bfloat16.
DEVICE = {"device": "cpu", "dtype": "float32"}
ONE_PASS = 1 << 30  # CpuForward.rows_per_pass for a step in one call of the fused stack


def _linear(ops, x, m: Matmul):
    return ops.linear(x, m.w, m.packed, m.quant, m.bias)


def one_op_at_a_time(
    self: CpuForward,
    input_ids,
    positions,
    slot_mapping,
    block_tables,
    seq_lens,
    key_caches,
    value_caches,
    *,
    logits: bool,
):
    """``CpuForward.stack`` as its kernels called from Python, in decoder_layer.cpp's order."""
    spec, ops = self.spec, self.ops
    x = spec.head.embed.index_select(0, input_ids)
    cos, sin = spec.rope_cos.index_select(0, positions), spec.rope_sin.index_select(0, positions)
    t, nh = x.shape[0], spec.num_heads
    residual, out = x, x
    for i, (layer, kc, vc) in enumerate(zip(spec.layers, key_caches, value_caches, strict=True)):
        if i == 0:
            h = ops.rms_norm(x, layer.input_norm, spec.eps)
        else:
            h = ops.add_rms_norm_(out, residual, layer.input_norm, spec.eps)
        qkv = _linear(ops, h, layer.qkv)
        ops.rope_and_store_(qkv, cos, sin, kc, vc, slot_mapping, nh, spec.num_kv_heads)
        d = kc.shape[-1]
        q = qkv[:, : nh * d].view(t, nh, d)
        attn = ops.paged_attention_decode(q, kc, vc, block_tables, seq_lens, spec.scale)
        h = ops.add_rms_norm_(
            _linear(ops, attn.reshape(t, nh * d), layer.o), residual, layer.post_norm, spec.eps
        )
        out = _linear(ops, ops.silu_mul(_linear(ops, h, layer.gate_up)), layer.down)
    if logits:
        h = ops.add_rms_norm_(out, residual, spec.head.final_norm, spec.eps)
        out = _linear(ops, h, spec.head.head)
    return out, residual


def _run(path, prompts, *, fused: bool, monkeypatch, budget: int) -> tuple[list, int, int]:
    """(outputs, fused stack calls, most rows in one call)"""
    calls = rows = 0
    original = CpuForward.stack

    def counting(self, input_ids, *args, **kwargs):
        nonlocal calls, rows
        calls += 1
        rows = max(rows, input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(CpuForward, "stack", counting if fused else one_op_at_a_time)
        # One pass a step (passes: test_step_in_passes_...).
        m.setattr(CpuForward, "rows_per_pass", ONE_PASS)
        llm = LLM(
            str(path),
            attention_backend="cpu",
            **DEVICE,
            block_size=8,
            max_num_seqs=80,
            max_num_batched_tokens=budget,
        )
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, logprobs=3))
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs], calls, rows


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        # No matmul width a multiple of the 64-column panels: the stack's buffers are then
        # filled through the allocating matmul and a copy.
        {
            "hidden_size": 96,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "intermediate_size": 80,
        },
    ],
    ids=["plain", "tied-bias", "widths-off-the-panels"],
)
@pytest.mark.parametrize(
    "num_prompts,budget",
    # 1 row (vector product); 5 and 70 prompts under a 64-token budget: steps of up to 64
    # rows (packed matmul), chunked prefills and mixed prefill/decode steps; 70 prompts under
    # a 2048-token budget: a first step of ~1,400 rows (the library's matmul, past the
    # packed range of 256 rows).
    [(1, 64), (5, 64), (70, 64), (70, 2048)],
    ids=["1-seq", "5-seqs", "70-seqs", "70-seqs-one-step"],
)
def test_fused_decoder_layer_is_bitwise_the_python_layer(
    tmp_path, monkeypatch, overrides, num_prompts, budget
):
    """With and without biases; prompts cross block boundaries."""
    sizes = {"hidden_size": 128, "intermediate_size": 256, **overrides}
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=5, **sizes)
    g = torch.Generator().manual_seed(num_prompts)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (num_prompts,), generator=g)
    ]
    fused, fused_calls, rows = _run(
        path, prompts, fused=True, monkeypatch=monkeypatch, budget=budget
    )
    python, python_calls, _ = _run(
        path, prompts, fused=False, monkeypatch=monkeypatch, budget=budget
    )
    assert python_calls == 0
    assert rows > 256 if budget > 256 else rows <= 64
    # One call a step: at least the 10 steps of the longest request.
    assert fused_calls >= 10
    assert fused == python


def test_cpu_backend_picks_greedy_tokens_with_the_kernels_argmax(tmp_path):
    """The sampler's greedy pick is the C++ argmax on the cpu backend; every call agrees
    with torch.argmax on the same logits."""
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=2, hidden_size=128, intermediate_size=256)
    llm = LLM(str(path), attention_backend="cpu", **DEVICE)
    sampler = llm.engine.sampler
    kernel = sampler._argmax
    calls = 0

    def checked(logits: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        got = kernel(logits)
        assert torch.equal(got, logits.argmax(dim=-1))
        return got

    sampler._argmax = checked
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert calls >= 8
    assert kernel.__name__ != "_torch_argmax"


class _CountingOps:
    """``torch.ops.pagedserve_cpu`` with the fused stack's calls counted by rows."""

    def __init__(self, ops) -> None:
        self._ops = ops
        self.stack_rows: list[int] = []

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def decoder_layers(self, input_ids, *args):
        self.stack_rows.append(input_ids.shape[0])
        return self._ops.decoder_layers(input_ids, *args)


def test_step_in_passes_matches_the_step_in_one_pass(tmp_path, monkeypatch):
    """A step of more rows than a pass takes (70 prompts prefilled in one step under a
    2,048-token budget) runs the stack in passes of consecutive rows: a pass's rows read
    the K/V that earlier passes wrote, so the outputs are those of one pass up to matmul
    rounding (the passes' matmuls run on the packed panels, one pass's on the library):
    the same greedy tokens and logprobs within 1e-4. Passes of 1 row (every row on its own)
    and of 16 (prompts cut mid-sequence, a decode beside a prefill's tail) both."""
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=7, hidden_size=128, intermediate_size=256)
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (70,), generator=g)
    ]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)

    def run(rows_per_pass):
        with monkeypatch.context() as m:
            m.setattr(CpuForward, "rows_per_pass", rows_per_pass)
            llm = LLM(str(path), attention_backend="cpu", **DEVICE, block_size=8, max_num_seqs=80)
            forward = llm.engine.runner.model
            counting = forward.ops = _CountingOps(forward.ops)
            outs = llm.generate(prompts, params)
        return outs, counting.stack_rows

    whole, whole_rows = run(ONE_PASS)
    assert max(whole_rows) > 1000  # the first step: every prompt in one pass
    for rows_per_pass in (16, 1):
        parts, part_rows = run(rows_per_pass)
        assert max(part_rows) == rows_per_pass
        assert len(part_rows) > len(whole_rows)
        for a, b in zip(whole, parts, strict=True):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def test_passes_default_to_the_rows_the_panels_serve(tmp_path):
    """Without an override, a pass is as many rows as the packed panels serve (256), so no
    pass falls to the library."""
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=1, hidden_size=128, intermediate_size=256)
    llm = LLM(str(path), attention_backend="cpu", **DEVICE, block_size=8, max_num_seqs=80)
    forward = llm.engine.runner.model
    counting = forward.ops = _CountingOps(forward.ops)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (30,), generator=g).tolist() for _ in range(40)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
    limit = counting.max_packed_rows()
    assert max(counting.stack_rows) == limit  # the first step: 1,200 rows


@pytest.mark.parametrize("threads", [2, 3])
def test_stack_in_a_team_is_bitwise_the_stack_without(tmp_path, monkeypatch, threads):
    """decoder_layers runs small steps in one team of threads (kernels/cpu/csrc/team.h),
    splitting each kernel's work exactly as at::parallel_for does: outputs must be bitwise
    those of one parallel region a kernel. 3 threads on this 2-core machine: more threads
    than cores (the team's waits must give the cores up) and ranges that split unevenly.
    Steps of 1 to 64 rows, all in a team (whole, narrowed or solo) on one side, none on the
    other."""
    sizes = {"hidden_size": 128, "intermediate_size": 256}
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=11, **sizes)
    g = torch.Generator().manual_seed(threads)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (9,), generator=g)
    ]
    ops = cpu_kernels.load()
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {}
        # (team rows, active threads): every step in the whole team, in a team narrowed to
        # fewer threads than its split (as beside a busy neighbour; contention.h), in a solo
        # team (narrowed to thread 0, which runs the team's chunks alone); with team rows 0,
        # steps larger than a team's (all of them) narrowed to 2 threads or solo, as a
        # prefill beside a neighbour; or in none (last: the others are compared with it).
        # Active threads are forced: the machine's other load must not choose the path
        # under test. Solo, the kernels called between steps (the head, the final norm) run
        # on the caller alone.
        whole, none = (1 << 30, threads), (0, threads)
        tried = (whole, (1 << 30, 2), (1 << 30, 1), (0, 2), (0, 1))
        variants = (*(v for v in dict.fromkeys(tried) if v != none), none)
        for team_rows, active in variants:
            before = ops.set_stack_team_rows(team_rows)
            before_active = ops.set_stack_active_threads(active)
            try:
                results[team_rows, active], _, rows = _run(
                    path, prompts, fused=True, monkeypatch=monkeypatch, budget=64
                )
            finally:
                ops.set_stack_team_rows(before)
                ops.set_stack_active_threads(before_active)
            assert 1 < rows <= 64
    finally:
        torch.set_num_threads(before_threads)
    for variant in variants[:-1]:
        assert results[variant] == results[0, threads], variant


@pytest.mark.parametrize("prefill_only", [False, True])
def test_team_narrows_beside_busy_processes(tmp_path, prefill_only):
    """With a busy process on each of the team's 2 CPUs, other processes take at least one
    CPU's worth of them; after a few of contention.h's 200 ms periods of steps, the team runs
    solo. Decode steps, or only prefill steps of more rows than a team's (each request one
    fresh 40-token prompt and one token), which are asked too. (Widening again needs a quiet
    machine, which a shared test host is not.)"""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs and sched_setaffinity")
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=3, hidden_size=128, intermediate_size=256)
    ops = cpu_kernels.load()
    llm = LLM(str(path), attention_backend="cpu", **DEVICE, block_size=8)
    mask = os.sched_getaffinity(0)
    cpus = sorted(mask)[:2]
    before_threads = torch.get_num_threads()
    busy = []
    before_adapt = ops.set_stack_adapt_threads(True)  # also resets what it had seen
    try:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(2)
        for cpu in cpus:
            busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(busy[-1].pid, {cpu})
        # The counts are the process's since it loaded the kernels: this test reads deltas.
        _, _, samples_before, narrowed_before = ops.stack_contention_read().tolist()
        deadline = time.monotonic() + 20
        for i in itertools.count():
            if prefill_only:
                # Its first block differs from every earlier prompt's: no prefix-cache
                # hit, which would leave a step of a team's size.
                prompt = [3 + i % 250, 3 + i // 250 % 250] + [3 + j for j in range(38)]
                llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
            else:
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0))
            active, foreign, samples, narrowed = ops.stack_contention_read().tolist()
            if narrowed > narrowed_before or time.monotonic() >= deadline:
                break
        seen = (active, foreign, samples - samples_before, narrowed - narrowed_before)
        assert active == 1 and narrowed > narrowed_before, seen
        assert foreign >= 0.5
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        os.sched_setaffinity(0, mask)
        torch.set_num_threads(before_threads)
        ops.set_stack_adapt_threads(before_adapt)


def test_stack_team_rows_default_and_restore():
    """The limit is 16 rows unless set; setting it returns the previous one."""
    ops = cpu_kernels.load()
    before = ops.set_stack_team_rows(0)
    try:
        assert before == 16
        assert ops.set_stack_team_rows(16) == 0
    finally:
        ops.set_stack_team_rows(before)
