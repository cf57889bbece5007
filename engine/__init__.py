"""engine: model loading, the Llama model, the runner, the sampler and the step loop.

Ownership: the engine owns the model weights and the sampler's generators; it turns the
scheduler's plan into tensors and never makes scheduling decisions.
"""

from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM, CompletionOutput
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, StepStats, TokenLogprob
from scheduler.request import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
    "TokenLogprob",
]
