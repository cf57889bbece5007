"""ServingEngine: the part of ``LLMEngine`` a server may use, as a typed Protocol.

The server drives the engine from one thread (requests in, one ``step()`` at a time, token
ids out) and reads what it reports about itself for logs, health and metrics. Anything else
on ``LLMEngine`` (the model, the runner, the scheduler, the KV pool) is the engine's own:
a server that needs more asks for a field here instead of reaching in. Tests substitute a
fake that implements these members.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from engine.config import ModelConfig
from engine.generation_config import SamplingDefaults
from engine.outputs import EngineOccupancy, RequestOutput, StepStats
from kvpool.storage import KVCapacity
from scheduler.config import SchedulerConfig
from scheduler.request import SamplingParams


class ServingEngine(Protocol):
    # ---- what is loaded, for the API, logs and metrics labels
    @property
    def model_id(self) -> str: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def tokenizer(self) -> Any: ...  # a transformers tokenizer, or None
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def sampling_defaults(self) -> SamplingDefaults: ...  # generation_config.json's
    @property
    def max_model_len(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def attention_backend(self) -> str: ...
    @property
    def matmul_weights(self) -> str: ...
    @property
    def decode_step_weight_bytes(self) -> int: ...
    # The scheduler's config as the engine resolved it (the device's defaults filled in,
    # e.g. the prefill chunk), which is what the server reports.
    @property
    def scheduler_config(self) -> SchedulerConfig: ...
    # Whether steps are scheduled asynchronously (EngineConfig.async_scheduling_for).
    async_scheduling: bool
    # The structured-output grammar cache (engine/structured.py's GrammarCache), thread-safe:
    # the server compiles a request's grammar before queueing it. None: no tokenizer.
    @property
    def grammars(self) -> Any: ...

    # ---- the KV pool's size and the last step, for health and metrics
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def kv_capacity(self) -> KVCapacity: ...  # the pool's size and bytes per token
    @property
    def last_step_stats(self) -> StepStats | None: ...

    # ---- requests and the step loop (one thread)
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None: ...
    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def check_integrity(self) -> None: ...  # every invariant (walks the whole KV pool)
    def check_idle(self) -> None: ...  # nothing left once no request is; constant time
    def occupancy(self) -> EngineOccupancy: ...  # the load gauges now
    @property
    def fatal_error(self) -> str | None: ...  # why the engine can never step again, or None
    def shutdown(self) -> None: ...  # stop what the engine started (TP workers, the trace)
