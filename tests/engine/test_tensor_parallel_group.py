"""The tensor-parallel code path in this process, with a group of one rank: gloo on the CPU
(always) and NCCL on CUDA (``gpu``). Sharding to one rank changes no weight, so the tokens
must equal transformers'; what runs is the TP path itself: the sharded modules and their
collectives, the step plan broadcast and the TP runner."""

from __future__ import annotations

import pytest
import torch

from engine.builder import build_engine_parts
from engine.config import EngineConfig
from engine.tensor_parallel import RowParallelLinear, VocabParallelHead
from engine.tp_group import Rendezvous, TensorParallelGroup, TensorParallelRunner
from kvpool.config import KVPoolConfig
from loadtest.launcher import free_port
from scheduler.config import SchedulerConfig
from scheduler.request import Request, SamplingParams
from tests.engine.parity import assert_parity, hf_greedy

PROMPTS = [[1, 17, 42, 99, 7], [1, 200, 3, 3, 150, 11, 64, 90, 21]]
MAX_TOKENS = 10


def _generate(parts, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's step loop, by hand: schedule, execute on the TP runner, update."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for r in requests:
        parts.scheduler.add_request(r)
    while parts.scheduler.has_unfinished():
        plan = parts.scheduler.schedule()
        result = parts.runner.execute(plan)
        parts.scheduler.update_from_output(
            plan, dict(zip(result.request_ids, result.token_ids, strict=True))
        )
    return [list(r.output_token_ids) for r in requests]


def _run_single_rank(model_path, device: str, backend: str) -> None:
    from transformers import LlamaForCausalLM

    group = TensorParallelGroup(Rendezvous(0, 0, 1, f"tcp://127.0.0.1:{free_port()}"), backend)
    group.join()
    try:
        parts = build_engine_parts(
            EngineConfig(model=str(model_path), device=device, dtype="float32"),
            KVPoolConfig(num_blocks=64),
            SchedulerConfig(max_num_seqs=4),
            tp=group,
        )
        assert isinstance(parts.runner, TensorParallelRunner)
        assert isinstance(parts.model.layers[0].o_proj, RowParallelLinear)
        assert isinstance(parts.model.lm_head, VocabParallelHead)
        got = _generate(parts, PROMPTS)
    finally:
        group.shutdown()
    hf = LlamaForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).to(device)
    for i, prompt in enumerate(PROMPTS):
        ref = hf_greedy(hf.eval(), prompt, MAX_TOKENS, eos_token_id=None)
        assert_parity(got[i], ref, f"{backend} single-rank prompt {i}")


def test_single_rank_gloo_group_runs_the_tp_path(tiny_llama_cpu_shapes):
    _run_single_rank(tiny_llama_cpu_shapes, "cpu", "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_single_rank_nccl_group_runs_the_tp_path(tiny_llama_gqa):
    _run_single_rank(tiny_llama_gqa, "cuda", "nccl")
