"""engine: model loading, the Llama model, the runner, the sampler and the step loop.

Ownership: the engine owns the model weights, the sampler's shared generator, the speculator's
per-request generators and the structured-output grammars and matchers (engine/structured.py);
it turns the scheduler's output into tensors and never makes scheduling decisions.

Re-exports are resolved lazily, so ``from engine.config import ModelConfig`` (the capacity
planner, the server's flag parsing) does not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.llm import LLM, CompletionOutput
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput, StepStats, TokenLogprob
    from scheduler.request import SamplingParams

_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.llm",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "ModelConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "scheduler.request",
    "StepStats": "engine.outputs",
    "TokenLogprob": "engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
