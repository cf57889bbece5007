"""LLM: the offline API, in the style of vLLM's.

    from engine import LLM, SamplingParams
    llm = LLM(model="default")
    for out in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0)):
        print(out.finish_reason, out.text)

All prompts are submitted at once and run through the same continuous-batching scheduler
the server uses.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import TokenLogprob
from engine.spec_decode.config import (
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    SpeculativeConfig,
)
from kvpool.config import KVPoolConfig
from scheduler.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MIN_PREFILL_CHUNK_TOKENS,
    SchedulerConfig,
)
from scheduler.request import SamplingParams

Prompt = str | list[int]


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # The id of SamplingParams.stop_token_ids that ended it (vLLM's); None for the model's
    # EOS and for every other finish.
    stop_reason: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(
        self,
        model: str = "default",
        *,
        dtype: str | None = None,
        device: str | None = None,
        attention_backend: str = "auto",
        matmul_weights: str = "gguf",
        quantization: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        kv_key_offsets: bool = False,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        prefill_chunk_tokens: int | None = None,
        batching: str = "continuous",
        block_allocation: str = "optimistic",
        batch_wait_ms: float = 50.0,
        static_finished: str = "compute",
        target_itl_ms: float | None = None,
        target_itl_ratio: float | None = None,
        target_tpot_ms: float | None = None,
        target_ttft_ms: float | None = None,
        min_prefill_chunk_tokens: int = DEFAULT_MIN_PREFILL_CHUNK_TOKENS,
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        tokenizer: str | None = None,
        enforce_eager: bool = False,
        cuda_graph_sizes: tuple[int, ...] | None = None,
        cuda_graph_max_prefill_tokens: int = 1024,
        cuda_graph_prefill_mode: str = "full",
        generation_config: str = "auto",
        tensor_parallel_size: int = 1,
        speculative_method: str | None = None,
        num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
        ngram_min: int = DEFAULT_NGRAM_MIN,
        ngram_max: int = DEFAULT_NGRAM_MAX,
        speculative_model: str | None = None,
        speculative_load_format: str = "auto",
        speculative_max_step_tokens: int | None = None,
        speculative_row_cost: float | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        """Arguments mirror the server's flags (server/README.md). Speculative decoding
        (engine/spec_decode/) is on when ``speculative_method`` is "ngram" or "draft"."""
        speculative = None
        if speculative_method is not None:
            speculative = SpeculativeConfig(
                method=speculative_method,
                num_speculative_tokens=num_speculative_tokens,
                ngram_min=ngram_min,
                ngram_max=ngram_max,
                model=speculative_model,
                draft_load_format=speculative_load_format,
                max_step_tokens=speculative_max_step_tokens,
                row_cost=speculative_row_cost,
            )
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                device=device,
                attention_backend=attention_backend,
                matmul_weights=matmul_weights,
                quantization=quantization,
                max_model_len=max_model_len,
                seed=seed,
                load_format=load_format,
                tokenizer=tokenizer,
                enforce_eager=enforce_eager,
                cuda_graph_sizes=cuda_graph_sizes,
                cuda_graph_max_prefill_tokens=cuda_graph_max_prefill_tokens,
                cuda_graph_prefill_mode=cuda_graph_prefill_mode,
                generation_config=generation_config,
                tensor_parallel_size=tensor_parallel_size,
                speculative=speculative,
                async_scheduling=async_scheduling,
            ),
            KVPoolConfig(
                block_size=block_size,
                memory_bytes=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
                num_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,
                key_offsets=kv_key_offsets,
            ),
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                prefill_chunk_tokens=prefill_chunk_tokens,
                batching=batching,
                block_allocation=block_allocation,
                batch_wait_ms=batch_wait_ms,
                static_finished=static_finished,
                target_itl_ms=target_itl_ms,
                target_itl_ratio=target_itl_ratio,
                target_tpot_ms=target_tpot_ms,
                target_ttft_ms=target_ttft_ms,
                min_prefill_chunk_tokens=min_prefill_chunk_tokens,
            ),
        )
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now, not at interpreter exit."""
        self.engine.shutdown()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer, or None
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation_config.json defaults
        (``generation_config="auto"``; engine/generation_config.py), as vLLM's."""
        return dataclasses.replace(SamplingParams(), **self.engine.sampling_defaults.as_dict())

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token id lists")
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt, together; return outputs in prompt order."""
        if params is None:
            params = self.get_default_sampling_params()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, CompletionOutput] = {}
        stop_ids: dict[str, tuple[int, ...]] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt, strict=False):
            request_id = f"offline-{next(self._ids)}"
            ids = self.encode(prompt)
            self.engine.add_request(request_id, ids, p)
            results[request_id] = CompletionOutput(prompt_token_ids=ids)
            stop_ids[request_id] = p.stop_token_ids
            order.append(request_id)
        scheduler = self.engine.scheduler
        while self.engine.has_unfinished_requests():
            # Dynamic batching may hold requests back for its window: sleep it out rather
            # than spinning on empty steps (no new request can arrive offline).
            admit_at = scheduler.next_admission_time()
            if admit_at is not None:
                time.sleep(max(0.0, admit_at - scheduler.clock()))
            for out in self.engine.step():
                result = results[out.request_id]
                result.token_ids.extend(out.new_token_ids)
                if out.new_logprobs:
                    result.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
                    if out.stop_token_id in stop_ids[out.request_id]:
                        result.stop_reason = out.stop_token_id
        if self.engine.tokenizer is not None:
            for result in results.values():
                result.text = self.engine.tokenizer.decode(
                    result.token_ids, skip_special_tokens=True
                )
        return [results[r] for r in order]
