"""ModelRunner: turns a step's plan into tensors, runs the model, samples.

``execute`` does the three parts of a step in turn: ``launch`` (inputs and the forward pass,
queued on the device), ``sample`` (the picks, queued) and ``LaunchedStep.result`` (the one
read of the picks). Asynchronous scheduling (engine/llm_engine.py) calls them apart.

Owns: the model weights on their device, the sampler, a reference to the KV storage
(whose tensors only the attention's ``store`` writes), and the decode graphs, if any
(``engine/cuda_graphs.py``): a decode-only step replays one instead of running the model,
and a short step with prefill tokens replays one whole, or pieces cut at attention
(``engine/prefill_graphs.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from engine.backends import ModelForward
from engine.cuda_graphs import DecodeGraphs
from engine.input_batch import HostStaging, InputBatch, build_input_batch
from engine.outputs import ModelRunnerOutput, TokenLogprob
from engine.prefill_graphs import PrefillGraphs
from engine.prompt_logprobs import ScoredRows, score
from engine.sampler import Picked, Sampler
from engine.spec_decode.speculator import SpeculativeDecoder
from engine.to_device import on_device
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
        # Steps with prefill tokens: whole, or in pieces cut at attention
        # (engine/prefill_graphs.py).
        self.prefill_graphs: PrefillGraphs | None = None
        # Verifies speculative rows (engine/spec_decode/); None without speculative decoding.
        self.speculator: SpeculativeDecoder | None = None

    def prepare(self, out: SchedulerOutput) -> InputBatch:
        return build_input_batch(out, self.storage.block_size, self.device, self.staging)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the scheduled tokens and sample for requests whose chunk ends their
        known tokens; wait for the picks."""
        step = self.launch(out)
        self.sample(step)
        return step.result()

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward pass on the device and return without waiting for it
        (on the CPU it is done on return); ``sample`` then picks the tokens.

        Args:
            out: the step's plan; its decode rows may hold ``PENDING_TOKEN`` inputs, the
                picks of ``previous`` (asynchronous scheduling).
            previous: the step launched before this one, whose picks feed those rows.
        """
        if out.blocks_to_copy:
            # Copy-on-write blocks of fully cached prompts: filled before anyone reads them.
            src_ids, dst_ids = zip(*out.blocks_to_copy, strict=True)
            self.storage.copy_blocks(src_ids, dst_ids)
        t0 = time.perf_counter()
        batch = self.prepare(out)
        if batch.pending:
            self._feed_pending(batch, previous)
        t1 = time.perf_counter()
        if self.graphs is not None and self.graphs.handles(batch):
            logits, replay = self.graphs.run(batch), "decode_graph"
        elif self.prefill_graphs is not None and self.prefill_graphs.handles(batch):
            logits, whole = self.prefill_graphs.run(batch)
            replay = "whole_graph" if whole else "graph_pieces"
        else:
            logits = self.model(batch, self.storage.key_caches, self.storage.value_caches)
            replay = "eager"
        # No synchronisation here: on CUDA the kernels run on while the sampler queues its
        # work, and the read of the chosen tokens (``LaunchedStep.result``) is the step's one
        # wait. So on CUDA "forward" is the time to launch the step and "sample" includes
        # the GPU's.
        t2 = time.perf_counter()
        touched = self.experts_touched() if self.experts_touched is not None else None
        return LaunchedStep(
            [s.request.request_id for s in batch.sampling + batch.verifying],
            {"prepare": t1 - t0, "forward": t2 - t1},
            touched,
            batch,
            logits if batch.sampling or batch.verifying or batch.scoring else None,
            replay=replay,
        )

    def sample(self, step: LaunchedStep, *, copy_out: bool = False) -> None:
        """Queue the picks of a launched step's sampling rows and verify its speculative
        rows. Sampling reads the requests' tokens on the host (penalties, a grammar's state),
        so with asynchronous scheduling it runs once the step before has been read.

        Args:
            copy_out: start copying the picks to the host now, behind the step's work, so
                that ``result()`` later waits for the copy only.
        """
        batch, logits = step.batch, step.logits
        step.logits = None  # the picks below are all that is kept of them
        if logits is None:
            return
        t0 = time.perf_counter()
        # Rows past the sampling and verifying ones are static-batch padding: discarded.
        num_sampling = len(batch.sampling)
        if batch.sampling:
            step.picked = self.sampler.pick(logits[:num_sampling], batch.sampling)
            if copy_out:
                step.picked.start_copy()
        num_verify_rows = 0
        if batch.verifying:
            if self.speculator is None:
                raise RuntimeError("a speculative row reached a runner without a speculator")
            num_verify_rows = sum(item.num_tokens for item in batch.verifying)
            for result in self.speculator.verify(
                logits[num_sampling : num_sampling + num_verify_rows], batch.verifying
            ):
                step.verified.append((result.token_ids, result.logprobs))
        if batch.scoring:
            first = num_sampling + num_verify_rows
            num_scored = sum(len(chunk.token_ids) for chunk in batch.scoring)
            step.scored = score(logits[first : first + num_scored], batch.scoring)
        step.phase_s["sample"] = time.perf_counter() - t0

    def _feed_pending(self, batch: InputBatch, previous: LaunchedStep | None) -> None:
        if previous is None or previous.picked is None:
            raise RuntimeError("a pending input token without the step that picks it")
        feed_pending(batch, previous.picked.tokens, previous.rows)


def feed_pending(batch: InputBatch, picks: torch.Tensor, rows: Mapping[str, int]) -> None:
    """Write a batch's pending input tokens from the step before's picks, on their device.

    Args:
        picks: [rows] int64, that step's chosen tokens, on the batch's device.
        rows: request id -> its row of ``picks``.
    """
    dst = on_device(picks.device, [position for position, _ in batch.pending])
    src = on_device(picks.device, [rows[request_id] for _, request_id in batch.pending])
    batch.input_ids.index_copy_(0, dst, picks.index_select(0, src))


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass is queued on the device; after ``ModelRunner.sample``
    its picks are too. Nothing of it has been read."""

    request_ids: list[str]  # the sampling rows', then the verifying rows'
    phase_s: dict[str, float]
    experts_touched: int | None
    batch: InputBatch
    logits: torch.Tensor | None  # until sampled; None when no row samples
    picked: Picked | None = None
    # Speculative rows, verified when sampled (verification reads its picks).
    verified: list[tuple[list[int], list[TokenLogprob] | None]] = field(default_factory=list)
    # Prompt logprobs of the scored rows, queued when sampled (engine/prompt_logprobs.py).
    scored: ScoredRows | None = None
    # Tensor parallelism with asynchronous scheduling: the picks go to the other ranks once
    # queued (engine/tp_group.py).
    shares_picks: bool = False
    replay: str = ""  # how the forward pass ran (engine.outputs.REPLAYS)

    @property
    def rows(self) -> dict[str, int]:
        """Request id -> its row of ``picked.tokens`` (the sampling rows lead the ids)."""
        sampling = self.request_ids[: len(self.batch.sampling)]
        return {request_id: row for row, request_id in enumerate(sampling)}

    def result(self) -> ModelRunnerOutput:
        """Wait for the picks and return them (the step's one synchronisation)."""
        if self.logits is not None:
            raise RuntimeError("a launched step is read before it is sampled")
        t0 = time.perf_counter()
        token_ids: list[int | list[int]] = []
        logprobs: list[TokenLogprob | list[TokenLogprob] | None] = []
        if self.picked is not None:
            sampled, sampled_lps = self.picked.read()
            token_ids.extend(sampled)
            logprobs.extend(sampled_lps)
        for verified_ids, verified_lps in self.verified:
            token_ids.append(verified_ids)
            logprobs.append(verified_lps)
        prompt_logprobs = self.scored.read() if self.scored is not None else {}
        phase_s = dict(self.phase_s)
        if self.request_ids:
            phase_s["sample"] = phase_s.get("sample", 0.0) + time.perf_counter() - t0
        return ModelRunnerOutput(
            self.request_ids,
            token_ids,
            logprobs,
            phase_s,
            experts_touched=self.experts_touched,
            replay=self.replay,
            prompt_logprobs=prompt_logprobs,
        )
