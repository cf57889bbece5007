"""SpeculativeDecoder: proposes before the step, verifies inside it, learns after it.

The engine's step with speculation (engine/llm_engine.py)::

    drafts = speculator.propose(scheduler)         # n-gram lookup or the draft model
    plan   = scheduler.schedule(draft_token_ids=drafts)
    result = runner.execute(plan)                  # speculative rows -> speculator.verify()
    update = scheduler.update_from_output(plan, result)   # accepted tokens, slots rolled back
    speculator.end_step(plan)                      # acceptance records, draft K/V kept, stats

Owns: the proposer (and through it the draft model's K/V pool), the policy's per-request
acceptance records and pauses, this step's proposals and verifications, and the random
generators of verification and drafting (per seeded request, or one shared generator): a
seeded request draws only from its own streams, so its output does not depend on its
neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.penalties import TokenCounts
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer, DraftProposal
from engine.spec_decode.ngram import TokenHistory, propose_ngram
from engine.spec_decode.policy import SpeculationPolicy
from engine.spec_decode.verify import Verification, verify_rows
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler


@dataclass(slots=True)
class SpecStepStats:
    """One step's speculation figures (engine/outputs.py ``StepStats`` carries them)."""

    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of those, kept
    num_verified_rows: int = 0  # speculative rows (each also emits one target token)
    draft_s: float = 0.0  # proposing
    accept_s: float = 0.0  # choosing the accepted drafts from the logits (verify())


class SpeculativeDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_step_tokens: int,
        *,
        seed: int,
        row_cost: float = 0.0,
        proposal_cost: float = 0.0,
        device: torch.device,
        argmax: Callable[[torch.Tensor], torch.Tensor],
        penalties: TokenCounts,
        draft: DraftModelProposer | None = None,
    ) -> None:
        """Args (among others):
        argmax: the sampler's greedy pick.
        penalties: the sampler's per-request token counts (its own; read here, forgotten
            by the sampler).
        draft: the draft model's proposer (the draft method only).
        """
        if (config.method == "draft") != (draft is not None):
            raise ValueError("the draft method needs a draft proposer, and only it")
        self.config = config
        self.policy = SpeculationPolicy(
            config.num_speculative_tokens, max_step_tokens, row_cost, proposal_cost
        )
        self.device = device
        self.argmax = argmax
        self.penalties = penalties
        self.draft = draft
        self._seed = seed
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._generators: dict[tuple[str, str], torch.Generator] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._proposed: dict[str, int] = {}  # request id -> drafts proposed this step
        self._verified: dict[str, Verification] = {}
        # n-gram proposals: each request's tokens as an array, extended step by step.
        self._histories = TokenHistory()
        self.last_stats = SpecStepStats()

    @property
    def draft_kv_bytes(self) -> int:
        """Bytes of the draft model's K/V pool (0 for n-gram proposals)."""
        return self.draft.storage.capacity.total_bytes if self.draft is not None else 0

    # ---- before the step ------------------------------------------------------------------

    def propose(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """Drafts for the running requests that decode this step (policy.py decides who
        and how many).

        Returns:
            Request id -> proposed tokens, for ``Scheduler.schedule(draft_token_ids=...)``.
        """
        start = time.perf_counter()
        self.policy.begin_step()
        self._draft_probs.clear()
        self._proposed.clear()
        self._verified.clear()
        self.last_stats = SpecStepStats()
        if scheduler.policy.runs_to_completion:
            return {}  # static/dynamic batches: plain decoding (their padding rows)
        candidates = [
            r
            for r in scheduler.running
            if r.num_tokens - r.num_computed_tokens == 1
            and _room(r, scheduler.max_model_len) >= 2
            and self.policy.may_propose(r.request_id)
        ]
        # The step's cap first (auto-disable: no request's record changes in a step too
        # full to speculate), then each request's own k by its acceptance.
        cap = self.policy.drafts_per_request(len(scheduler.running), len(candidates))
        wanted: dict[str, int] = {}
        if cap > 0:
            for request in candidates:
                k = min(cap, self.policy.wanted(request.request_id))
                if k > 0:
                    wanted[request.request_id] = k
        drafts: dict[str, list[int]] = {}
        if wanted and self.draft is None:
            cfg = self.config
            for request in candidates:
                k = wanted.get(request.request_id, 0)
                if k == 0:
                    continue
                tokens = propose_ngram(
                    self._histories.tokens(request), cfg.ngram_min, cfg.ngram_max, k
                )
                if tokens:
                    drafts[request.request_id] = tokens
        elif wanted and self.draft is not None:
            proposals: dict[str, DraftProposal] = self.draft.propose(
                [r for r in candidates if r.request_id in wanted],
                wanted,
                lambda r: self._generator(r, "draft"),
            )
            for request_id, proposal in proposals.items():
                drafts[request_id] = proposal.token_ids
                if proposal.probs is not None:
                    self._draft_probs[request_id] = proposal.probs
        self._proposed = {request_id: len(tokens) for request_id, tokens in drafts.items()}
        self.last_stats.draft_s = time.perf_counter() - start
        return drafts

    # ---- inside the step ------------------------------------------------------------------

    def verify(
        self,
        logits: torch.Tensor,  # [sum(k_i + 1), vocab] float32: each row's positions in order
        items: list[ScheduledRequest],
    ) -> list[Verification]:
        """Verify the step's speculative rows (engine/spec_decode/verify.py).

        Args:
            logits: the target's raw logits at every position of every speculative row.
            items: the speculative rows, in the order of ``logits``.
        """
        start = time.perf_counter()
        # All rows in one batched computation with one host read (verify.py).
        results = verify_rows(
            logits,
            items,
            argmax=self.argmax,
            penalties=self.penalties,
            generator=lambda request: self._generator(request, "verify"),
            draft_probs=[self._draft_probs.get(item.request_id) for item in items],
        )
        for item, result in zip(items, results, strict=True):
            self._verified[item.request_id] = result
        self.last_stats.accept_s += time.perf_counter() - start
        return results

    # ---- after the step -------------------------------------------------------------------

    def end_step(self, plan: SchedulerOutput) -> SpecStepStats:
        """Feed this step's verifications to the acceptance records and the draft pool.

        Args:
            plan: the step's plan (its speculative rows are the verified ones).
        Returns:
            The step's speculation figures.
        """
        stats = self.last_stats
        for request_id in self._proposed:
            result = self._verified.get(request_id)
            if result is not None:
                stats.num_draft_tokens += result.num_drafts
                stats.num_accepted_tokens += result.num_accepted
                stats.num_verified_rows += 1
                self.policy.observe(request_id, result.num_drafts, result.num_accepted)
            if self.draft is not None:
                self.draft.verified(request_id, None if result is None else result.num_accepted)
        return stats

    def check_integrity(self, live_request_ids: set[str]) -> None:
        """Every token history belongs to a request still in the engine."""
        stale = self._histories.request_ids() - live_request_ids
        assert not stale, f"token histories of finished requests: {sorted(stale)[:5]}"

    def forget(self, request_id: str) -> None:
        """Drop a finished (or aborted) request's state."""
        self.policy.forget(request_id)
        self._histories.forget(request_id)
        self._generators.pop((request_id, "verify"), None)
        self._generators.pop((request_id, "draft"), None)
        if self.draft is not None:
            self.draft.forget(request_id)

    def _generator(self, request: Request, purpose: str) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared
        key = (request.request_id, purpose)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=self.device)
            # Distinct streams for drafting and verifying, both fixed by the seed.
            gen.manual_seed((seed * 2 + (purpose == "draft")) % 2**63)
            self._generators[key] = gen
        return gen


def _room(request: Request, max_model_len: int) -> int:
    """Tokens the request may still emit."""
    return min(
        request.sampling_params.max_tokens - request.num_output_tokens,
        max_model_len - request.num_tokens,
    )
