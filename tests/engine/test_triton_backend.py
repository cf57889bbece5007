"""The engine with the Triton kernels forced on gives the same greedy tokens as the torch
reference backend, through chunked prefill and mixed steps, in float32 on the same device:
on the CPU under the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without
CUDA), and on CUDA with the compiled kernels (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.parity import random_prompts
from tests.triton_devices import TRITON_DEVICES


def _greedy_tokens(model, backend, device, prompts, step_tokens, max_tokens, before=None):
    """Each prompt's greedy tokens from an engine on ``backend`` (float32, blocks of 8, at
    most ``step_tokens`` a step); ``before`` runs once the engine is built."""
    llm = LLM(str(model), attention_backend=backend, block_size=8,
              max_num_batched_tokens=step_tokens, device=device, dtype="float32",
              num_kv_blocks=64)  # fmt: skip
    assert llm.engine.attention_backend == backend
    if before is not None:
        before()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_backend_matches_torch_backend(tiny_llama_gqa, device):
    prompts = random_prompts(5, (1, 9, 17, 40))
    expected = _greedy_tokens(tiny_llama_gqa, "torch", device, prompts, 24, 6)
    assert _greedy_tokens(tiny_llama_gqa, "triton", device, prompts, 24, 6) == expected


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("mixed_attention", ["one_launch", "split"])
def test_mixed_steps_attend_in_one_launch_or_two(tiny_llama_gqa, device, mixed_attention,
                                                 monkeypatch):  # fmt: skip
    """A mixed step attends with the prefill kernel over every row where the decode kernel
    would not split its contexts, else with both kernels writing into one output
    (``AttentionPlan``): the same greedy tokens as the torch reference either way."""
    import kernels.paged_attention
    from engine.attention import AttentionPlan, PagedAttention

    if mixed_attention == "split":  # the decode rows' kernel would split: two launches
        monkeypatch.setattr(kernels.paged_attention, "choose_num_splits", lambda *a, **k: 4)
    plans: list[AttentionPlan] = []
    plan = PagedAttention.plan

    def spy(self, *args, **kwargs):
        plans.append(plan(self, *args, **kwargs))
        return plans[-1]

    prompts = random_prompts(9, (3, 30, 5, 44))
    expected = _greedy_tokens(tiny_llama_gqa, "torch", device, prompts, 16, 8)
    def watch():  # the triton engine's steps only, not its warm-up's
        monkeypatch.setattr(PagedAttention, "plan", spy)

    got = _greedy_tokens(tiny_llama_gqa, "triton", device, prompts, 16, 8, before=watch)
    assert got == expected
    mixed = [p for p in plans if 0 < p.meta.num_decodes < p.meta.seq_lens.shape[0]]
    assert mixed, "the workload must make mixed steps"
    assert all(p.one_launch == (mixed_attention == "one_launch") for p in mixed)


def test_triton_on_the_cpu_needs_the_interpreter(tiny_llama_gqa, monkeypatch):
    """Compiled Triton kernels take CUDA tensors only: on the CPU the backend is refused
    unless the kernels are interpreted, with the ways out named; ``auto`` never picks it
    there. ``triton_interprets`` answers as the tests' own switch does."""
    from engine import attention
    from engine.attention import UnsupportedBackendError, resolve_backend, triton_interprets
    from engine.config import ModelConfig, ModelError
    from engine.loader import read_hf_config
    from tests.triton_devices import INTERPRET

    assert triton_interprets() is INTERPRET
    mc = ModelConfig.from_hf(read_hf_config(tiny_llama_gqa))
    cpu = torch.device("cpu")
    monkeypatch.setattr(attention, "triton_interprets", lambda: False)
    with pytest.raises(UnsupportedBackendError, match="TRITON_INTERPRET=1") as refused:
        resolve_backend("triton", cpu, torch.float32, mc)
    assert isinstance(refused.value, ModelError)  # the CLI prints it as one line
    assert "--device cuda" in str(refused.value) and "\n" not in str(refused.value)
    assert resolve_backend("auto", cpu, torch.float32, mc) != "triton"
    # CUDA runs the compiled kernels: nothing to check there.
    assert resolve_backend("triton", torch.device("cuda"), torch.bfloat16, mc) == "triton"
    monkeypatch.setattr(attention, "triton_interprets", lambda: True)
    assert resolve_backend("triton", cpu, torch.float32, mc) == "triton"


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_an_attention_tuning_tables_launches_keep_the_tokens(
    tiny_llama_gqa, device, monkeypatch, tmp_path
):
    """With PAGEDSERVE_ATTENTION_TUNING (kernels/attention_tuning.py) every decode attention
    call takes the table's row (on CUDA: 2-4 splits merged by the last; tiles of 16,
    each tile's V loaded beside its K, the first ids beside the length): greedy tokens
    against transformers in float32, with the launches the table says, compiled by the
    warm-up before the first request."""
    import json
    from pathlib import Path

    import kernels.paged_attention as decode_module
    from engine.config import ModelConfig
    from engine.loader import read_hf_config
    from kernels.attention_tuning import ATTENTION_TUNING_ENV, DecodeTuning, row_fields
    from tests.engine.parity import assert_parity, random_prompts_and_references

    row = DecodeTuning(
        waves_below=1e9, max_context_len=2**31, target_waves=64, min_tokens_per_split=16,
        max_splits=4, one_launch=True, num_warps=2, num_stages=1, tile_n=16, early_v=True,
        prefetch_ids=True,
    )  # fmt: skip
    head_dim = ModelConfig.from_hf(read_hf_config(Path(tiny_llama_gqa))).head_dim
    # The row is for this model's caches (float32, its head dim): the launcher and the
    # step's plan say their cache's shape for it to apply.
    entry = {"row": row_fields(row), "head_dim": head_dim, "kv_dtype": "float32"}
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"format": 1, "device": "test", "entries": [entry]}))
    monkeypatch.setenv(ATTENTION_TUNING_ENV, str(path))
    prompts, refs = random_prompts_and_references(tiny_llama_gqa, device, 21, (5, 37, 12), 6)
    launches: list[decode_module.DecodeLaunch] = []
    choose = decode_module.choose_launch

    def spy(*args, **kwargs):
        launches.append(choose(*args, **kwargs))
        return launches[-1]

    def watch():  # the steps' calls, after the warm-up's
        tuned = decode_module.tuned_launches(head_dim=head_dim, kv_dtype=torch.float32)
        assert decode_module.DecodeLaunch(1, False, 2, 1, 16, True, True) in tuned
        monkeypatch.setattr(decode_module, "choose_launch", spy)

    llm = LLM(str(tiny_llama_gqa), attention_backend="triton", block_size=8,
              max_num_batched_tokens=16, device=device, dtype="float32", num_kv_blocks=64,
              enforce_eager=True)  # fmt: skip
    watch()
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_parity(out.token_ids, ref, f"tuned attention on {device}, prompt {i}")
    assert launches, "decode steps must reach the kernel's launcher"
    assert {(la.tile_n, la.num_warps, la.num_stages, la.early_v, la.prefetch_ids)
            for la in launches} == {(16, 2, 1, True, True)}  # fmt: skip
    if device == "cuda":  # off CUDA the launcher never splits
        assert max(la.num_splits for la in launches) > 1 and all(la.one_launch for la in launches)
