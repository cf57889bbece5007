"""engine/protocol.py: LLMEngine is a ServingEngine, member for member."""

from __future__ import annotations

import inspect

from engine import LLM
from engine.llm_engine import LLMEngine
from engine.protocol import ServingEngine
from scheduler.config import SchedulerConfig

# Pinned: on a machine with CUDA the engine's default is CUDA in bfloat16, whose resolved
# prefill chunk differs from the CPU's this file compares with.
ENGINE = dict(attention_backend="torch", num_kv_blocks=16, device="cpu", dtype="float32")


def _members(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_every_protocol_member_exists_on_the_engine(tiny_llama_gqa):
    engine = LLM(str(tiny_llama_gqa), **ENGINE).engine
    for name in _members(ServingEngine):
        assert hasattr(engine, name), name
        if inspect.isfunction(getattr(ServingEngine, name)):
            want = inspect.signature(getattr(ServingEngine, name))
            got = inspect.signature(getattr(LLMEngine, name))
            assert list(got.parameters) == list(want.parameters), name
    weights = engine.cost_model.step([(0, 1)], 1).weight_bytes
    assert engine.decode_step_weight_bytes == weights > 0


def test_the_server_reads_the_resolved_scheduler_config_and_the_pool_size(tiny_llama_gqa):
    """What `pagedserve serve` logs at start: the scheduler config with the device's defaults
    filled in (not the one it passed), and the pool the engine allocated."""
    engine = LLM(str(tiny_llama_gqa), **ENGINE).engine
    assert engine.scheduler_config is engine.scheduler.config
    assert (
        engine.scheduler_config.prefill_chunk_tokens
        == SchedulerConfig().for_device("cpu").prefill_chunk_tokens
    )
    assert engine.kv_capacity.num_blocks == engine.num_total_blocks == 16
    assert engine.kv_capacity.bytes_per_token > 0
