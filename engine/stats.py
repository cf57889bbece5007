"""StepStatsRecorder: one ``StepStats`` per engine step, from the step's plan.

Owns nothing between steps. A step's own counts (its rows, preemptions and prefix-cache
lookups) come from its plan, which with asynchronous scheduling is recorded after the next
step was scheduled; the occupancy gauges are the scheduler's and kvpool's counts when it is
recorded. Prices the step with the engine's ``StepCostModel`` (``engine/cost.py``); writes
nothing back.
"""

from __future__ import annotations

from engine.cost import StepCostModel
from engine.outputs import StepStats
from kvpool.manager import KVCacheManager
from kvpool.storage import KVCapacity
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler


class StepStatsRecorder:
    def __init__(self, cost_model: StepCostModel, kv_capacity: KVCapacity) -> None:
        self.cost_model = cost_model
        self.kv_capacity = kv_capacity

    def record(
        self,
        plan: SchedulerOutput,
        scheduler: Scheduler,
        kv_manager: KVCacheManager,
        step_time_s: float,
        phase_s: dict[str, float],
        experts_touched: int | None = None,
        replay: str = "",
    ) -> StepStats:
        """The stats of the step that ran ``plan``, taken after the scheduler's update;
        ``replay``: how its forward pass ran (``ModelRunnerOutput.replay``)."""
        # Static-batch padding rows are computed and read KV, but are nobody's output and
        # write nothing: they count in the bytes read, not as decode tokens or writes.
        # A speculative row is a decode plus its drafts: all of them decode tokens. One pass
        # over the rows (a step may hold hundreds).
        padding = decode = kv_tokens_read = num_logit_rows = num_tokens = 0
        chunks = []
        for s in plan.scheduled:
            n = s.num_tokens
            num_tokens += n
            kv_tokens_read += s.start + n
            chunks.append((s.start, n))
            if s.padding:
                padding += 1
                num_logit_rows += 1
                continue
            if n == 1 or s.draft_token_ids:
                decode += n
            if s.samples:
                num_logit_rows += n if s.draft_token_ids else 1
        per_token = self.kv_capacity.bytes_per_token
        # Copy-on-write block copies read and write a whole block each.
        copied = len(plan.blocks_to_copy) * self.kv_capacity.block_size * per_token
        cost = self.cost_model.step(chunks, num_logit_rows, experts_touched)
        kv = kv_manager.stats()
        return StepStats(
            step_time_s=step_time_s,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_prefill_tokens=num_tokens - decode - padding,
            num_decode_tokens=decode,
            num_preemptions=len(plan.preempted_ids),
            num_kv_blocks_used=kv_manager.num_used_blocks,
            num_kv_blocks_total=kv_manager.num_blocks,
            weight_bytes=cost.weight_bytes,
            kv_bytes_read=kv_tokens_read * per_token + copied,
            kv_bytes_written=(num_tokens - padding) * per_token + copied,
            flops=cost.flops,
            num_padding_tokens=padding,
            prefix_cache_queries=plan.num_prefix_cache_queries,
            prefix_cache_hits=plan.num_prefix_cache_hits,
            num_kv_blocks_cached=kv.num_cached_blocks,
            num_kv_blocks_evictable=kv.num_evictable_blocks,
            num_kv_slots_allocated=kv.num_allocated_slots,
            num_kv_slots_live=kv.num_live_slots,
            phase_s=phase_s,
            replay=replay,
        )
