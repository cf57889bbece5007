"""LLMEngine: one step = schedule -> execute -> update.

Not thread-safe: exactly one thread calls it (the server's engine thread, or the offline
``LLM``). The engine returns token ids; detokenizing and stop strings belong to the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from engine.attention import PagedAttention, resolve_backend
from engine.config import EngineConfig, ModelConfig
from engine.cost import StepCostModel
from engine.faults import FaultInjectingRunner, describe, execute_isolating
from engine.gguf_blocks import attach_gguf_blocks
from engine.layer_ops import CpuLayerOps, TorchLayerOps
from engine.llama import Linear, LlamaForCausalLM
from engine.loader import load_state_dict, load_tokenizer, read_hf_config, resolve_model
from engine.model_runner import ModelRunner
from engine.outputs import ModelRunnerOutput, RequestOutput, StepStats
from engine.rope import RotaryEmbedding
from engine.sampler import Sampler
from kernels import cpu as cpu_kernels
from kvpool.config import KVPoolConfig
from kvpool.manager import KVCacheManager
from kvpool.storage import KVCacheStorage, plan_capacity
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerUpdate

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        kv_config: KVPoolConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        config = config or EngineConfig()
        kv_config = kv_config or KVPoolConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        self.config = config

        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = DTYPES[
            config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        ]
        resolved = resolve_model(config.model)
        self.model_id = resolved.model_id
        self.model_config = ModelConfig.from_hf(read_hf_config(resolved.path))
        mc = self.model_config
        self.max_model_len = min(
            mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings
        )
        self.tokenizer: Any = load_tokenizer(resolved.path)
        self.eos_token_id = mc.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_id = self.tokenizer.eos_token_id

        t0 = time.perf_counter()
        self.attention_backend = resolve_backend(
            config.attention_backend, self.device, self.dtype, mc
        )
        attention = PagedAttention(self.attention_backend, scale=mc.head_dim**-0.5)
        rope = RotaryEmbedding(mc, self.max_model_len, self.device)
        # The cpu backend brings the fused C++ layer ops and packed matmuls along; every
        # other one uses torch's.
        cpu_ops = cpu_kernels.load() if self.attention_backend == "cpu" else None
        ops = CpuLayerOps(cpu_ops) if cpu_ops is not None else TorchLayerOps()
        # Built on the meta device, then materialised once: no time spent on random init.
        with torch.device("meta"):
            model = LlamaForCausalLM(mc, attention, rope, ops)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load_hf_state_dict(load_state_dict(resolved.path))
        if cpu_ops is not None:
            for module in model.modules():
                if isinstance(module, Linear):
                    module.pack_for_cpu(cpu_ops)
        blocks = None
        if cpu_ops is not None and resolved.gguf is not None and config.matmul_weights == "gguf":
            blocks = attach_gguf_blocks(model, resolved.gguf, cpu_ops)
        uses_blocks = blocks is not None and bool(blocks.attached)
        if cpu_ops is not None:
            Linear.gather_cpu_copies(model.modules())
        self.model = model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # What a step reads of those and computes, from its plan (MBU/MFU; engine/cost.py).
        self.cost_model = StepCostModel.from_config(mc, self.dtype.itemsize)
        if uses_blocks:
            self.cost_model = self.cost_model.with_blocks(
                cpu_ops.max_quant_rows(),
                body_saved_bytes=blocks.body_saved_bytes,
                lm_head_block_bytes=blocks.lm_head_block_bytes,
            )
        self.matmul_weights = "gguf" if uses_blocks else str(self.dtype).removeprefix("torch.")
        logger.info(
            "loaded %s from %s: %.1fM parameters, %s on %s, %s attention, in %.1f s",
            self.model_id,
            resolved.path,
            mc.num_params / 1e6,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.attention_backend,
            time.perf_counter() - t0,
        )

        capacity = plan_capacity(
            kv_config,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_capacity = capacity
        self.storage = KVCacheStorage(
            capacity,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.enable_prefix_caching = kv_config.enable_prefix_caching
        self.kv_manager = KVCacheManager(
            capacity.num_blocks,
            capacity.block_size,
            enable_prefix_caching=kv_config.enable_prefix_caching,
        )
        logger.info(
            "prefix caching: %s",
            "on (full blocks, sha256 hash chain, LRU eviction)"
            if kv_config.enable_prefix_caching
            else "off",
        )
        # Cumulative prefix-cache counters at the last step, to report per-step deltas.
        self._prefix_totals = (0, 0)
        self.scheduler = Scheduler(scheduler_config, self.kv_manager, self.max_model_len)
        self.sampler = Sampler(
            config.seed, self.device, cpu_ops.argmax_rows if cpu_ops is not None else None
        )
        self.runner: ModelRunner | FaultInjectingRunner = ModelRunner(
            self.model, self.storage, self.sampler, self.device
        )
        if config.fault_token_id is not None:
            logger.warning(
                "TEST-ONLY fault injection is on: requests whose prompt contains token %d fail",
                config.fault_token_id,
            )
            self.runner = FaultInjectingRunner(self.runner, config.fault_token_id)
        self.last_step_stats: StepStats | None = None

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request.

        Raises:
            ValueError: with a message fit for the user, if the request is malformed or can
                never run (too long for the model or for the whole KV pool).
        """
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        aborted = self.scheduler.abort_requests(request_ids)
        for request in aborted:
            self.sampler.forget(request.request_id)
        return [_output(request, [], None) for request in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_manager.num_blocks

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output per request that got a token or finished.

        If the forward pass or the sampler raises, only the requests whose rows raise on
        their own fail (``finish_reason="error"``, blocks freed); the others get their token
        (engine/faults.py). An exception from the scheduler itself propagates.
        """
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        scheduled = time.perf_counter()
        try:
            result = self.runner.execute(plan)
            failed: dict[str, str] = {}
        except Exception as exc:
            logger.error(
                "a step of %d requests failed (%s); re-running it in parts to isolate the "
                "failing requests",
                len(plan.scheduled),
                describe(exc),
                exc_info=True,
            )
            result, failed = execute_isolating(self.runner, plan, exc)
        # Failed requests leave the scheduler before the update, which then skips them.
        error_outputs = self._fail_requests(failed)
        update = self.scheduler.update_from_output(
            plan, dict(zip(result.request_ids, result.token_ids, strict=True))
        )
        outputs = error_outputs + self._make_outputs(update, result)
        end = time.perf_counter()
        phase_s = dict(result.phase_s)
        phase_s["schedule"] = scheduled - start
        # What the runner did not time (a failed step's re-runs, the update) is "update".
        phase_s["update"] = max(0.0, (end - scheduled) - sum(result.phase_s.values()))
        self._record_stats(plan, end - start, phase_s)
        return outputs

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Finish requests whose rows raised: abort them (blocks freed) as ``"error"``."""
        if not errors:
            return []
        outputs = []
        for request in self.scheduler.abort_requests(errors):
            self.sampler.forget(request.request_id)
            output = _output(request, [], None)
            output.finish_reason = "error"
            output.error = errors[request.request_id]
            outputs.append(output)
        logger.error("failed %d request(s) whose computation raised: %s", len(outputs), errors)
        return outputs

    def _make_outputs(
        self, update: SchedulerUpdate, result: ModelRunnerOutput
    ) -> list[RequestOutput]:
        logprobs = dict(zip(result.request_ids, result.logprobs, strict=False))
        outputs = []
        for request, token_id in update.new_tokens:
            lp = logprobs.get(request.request_id)
            outputs.append(_output(request, [token_id], [lp] if lp is not None else None))
        for request in update.finished:
            self.sampler.forget(request.request_id)
        return outputs

    def _record_stats(self, plan: Any, step_time: float, phase_s: dict[str, float]) -> None:
        # Static-batch padding rows are computed and read KV, but are nobody's output and
        # write nothing: they count in the bytes read, not as decode tokens or writes.
        padding = plan.num_padding_tokens
        decode = sum(1 for s in plan.scheduled if s.num_tokens == 1 and not s.padding)
        kv_tokens_read = sum(s.seq_len for s in plan.scheduled)
        per_token = self.kv_capacity.bytes_per_token
        # Copy-on-write block copies read and write a whole block each.
        copied = len(plan.blocks_to_copy) * self.kv_capacity.block_size * per_token
        num_logit_rows = sum(1 for s in plan.scheduled if s.samples or s.padding)
        cost = self.cost_model.step(
            ((s.start, s.num_tokens) for s in plan.scheduled), num_logit_rows
        )
        kv = self.kv_manager.stats()
        last_queries, last_hits = self._prefix_totals
        self._prefix_totals = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        self.last_step_stats = StepStats(
            step_time_s=step_time,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=plan.num_scheduled_tokens - decode - padding,
            num_decode_tokens=decode,
            num_preemptions=self.scheduler.last_step_preemptions,
            num_kv_blocks_used=self.kv_manager.num_used_blocks,
            num_kv_blocks_total=self.kv_manager.num_blocks,
            weight_bytes=cost.weight_bytes,
            kv_bytes_read=kv_tokens_read * per_token + copied,
            kv_bytes_written=(plan.num_scheduled_tokens - padding) * per_token + copied,
            flops=cost.flops,
            num_padding_tokens=padding,
            prefix_cache_queries=kv.prefix_cache_queries - last_queries,
            prefix_cache_hits=kv.prefix_cache_hits - last_hits,
            num_kv_blocks_cached=kv.num_cached_blocks,
            num_kv_blocks_evictable=kv.num_evictable_blocks,
            num_kv_slots_allocated=kv.num_allocated_slots,
            num_kv_slots_live=kv.num_live_slots,
            phase_s=phase_s,
        )


def _output(request: Request, new_token_ids: list[int], logprobs: Any) -> RequestOutput:
    finished = request.status.finished
    stop_token = None
    if request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids:
        stop_token = request.output_token_ids[-1]
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs,
        finished=finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        stop_token_id=stop_token,
        first_scheduled_time=request.first_scheduled_time,
    )
