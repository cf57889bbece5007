"""ModelRunner: turns a step's plan into tensors, runs the model, samples.

Owns: the model weights on their device, the sampler, a reference to the KV storage
(whose tensors only the attention's ``store`` writes), and the decode graphs, if any
(``engine/cuda_graphs.py``): a decode-only step replays one instead of running the model,
and a short step with prefill tokens replays piecewise ones (``engine/piecewise_graphs.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.backends import ModelForward
from engine.cuda_graphs import DecodeGraphs
from engine.input_batch import HostStaging, InputBatch, build_input_batch
from engine.outputs import ModelRunnerOutput, TokenLogprob
from engine.piecewise_graphs import PiecewiseGraphs
from engine.sampler import Sampler
from engine.spec_decode.speculator import SpeculativeDecoder
from kvpool.storage import KVCacheStorage
from scheduler.output import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: ModelForward,
        storage: KVCacheStorage,
        sampler: Sampler,
        device: torch.device,
        experts_touched: Callable[[], int | None] | None = None,
    ) -> None:
        """``experts_touched``: after a forward, the experts a mixture of experts ran
        (``LlamaForCausalLM.experts_touched``); None for a dense model."""
        self.model = model
        self.experts_touched = experts_touched
        self.storage = storage
        self.sampler = sampler
        self.device = device
        # On CUDA a step's inputs leave the host in one copy from one pinned buffer.
        self.staging = HostStaging(device) if device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        # Steps with prefill tokens, in pieces cut at attention (engine/piecewise_graphs.py).
        self.piecewise: PiecewiseGraphs | None = None
        # Verifies speculative rows (engine/spec_decode/); None without speculative decoding.
        self.speculator: SpeculativeDecoder | None = None

    def prepare(self, out: SchedulerOutput) -> InputBatch:
        return build_input_batch(out, self.storage.block_size, self.device, self.staging)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the scheduled tokens and sample for requests whose chunk ends their
        known tokens."""
        if out.blocks_to_copy:
            # Copy-on-write blocks of fully cached prompts: filled before anyone reads them.
            src_ids, dst_ids = zip(*out.blocks_to_copy, strict=True)
            self.storage.copy_blocks(src_ids, dst_ids)
        t0 = time.perf_counter()
        batch = self.prepare(out)
        t1 = time.perf_counter()
        if self.graphs is not None and self.graphs.handles(batch):
            logits = self.graphs.run(batch)
        elif self.piecewise is not None and self.piecewise.handles(batch):
            logits = self.piecewise.run(batch)
        else:
            logits = self.model(batch, self.storage.key_caches, self.storage.value_caches)
        # No synchronisation here: on CUDA the kernels run on while the sampler queues its
        # work, and the sampler's read of the chosen tokens is the step's one wait. So on
        # CUDA "forward" is the time to launch the step and "sample" includes the GPU's.
        t2 = time.perf_counter()
        touched = self.experts_touched() if self.experts_touched is not None else None
        if not batch.sampling and not batch.verifying:
            phases = {"prepare": t1 - t0, "forward": t2 - t1}
            return ModelRunnerOutput([], [], [], phases, experts_touched=touched)
        # Rows past the sampling and verifying ones are static-batch padding: discarded.
        num_sampling = len(batch.sampling)
        token_ids: list[int | list[int]] = []
        logprobs: list[TokenLogprob | list[TokenLogprob] | None] = []
        if batch.sampling:
            sampled, sampled_lps = self.sampler(logits[:num_sampling], batch.sampling)
            token_ids.extend(sampled)
            logprobs.extend(sampled_lps)
        if batch.verifying:
            if self.speculator is None:
                raise RuntimeError("a speculative row reached a runner without a speculator")
            num_rows = sum(item.num_tokens for item in batch.verifying)
            for result in self.speculator.verify(
                logits[num_sampling : num_sampling + num_rows], batch.verifying
            ):
                token_ids.append(result.token_ids)
                logprobs.append(result.logprobs)
        phase_s = {"prepare": t1 - t0, "forward": t2 - t1, "sample": time.perf_counter() - t2}
        return ModelRunnerOutput(
            [s.request.request_id for s in batch.sampling + batch.verifying],
            token_ids,
            logprobs,
            phase_s,
            experts_touched=touched,
        )
