"""When to speculate and how far: the per-step auto-disable rule and the per-request,
acceptance-aware number of drafts.

**Auto-disable (per step).** Verifying ``k`` drafts costs ``k`` more rows in the step's
forward pass. While a step is memory-bound (it reads every weight once whatever its rows)
those rows are nearly free; once the step has enough rows to be compute-bound, every row
costs its FLOPs and a rejected draft is pure loss. So a step speculates only while its
decodes plus their drafts stay within ``max_step_tokens``: each proposing request gets at
most ``(max_step_tokens - num_running) // num_proposing`` drafts, and none when that is
below 1. The default for the device (``default_max_step_tokens``):

* the CPU: 16 rows. Measured on the 2-core AMD EPYC machine this project is built on
  (default model, C++ kernels with GGUF blocks, benchmarks/RESULTS.md): a step of up to 16
  rows costs about one decode step, one of 24 rows over 20 times more (the matmuls leave
  their small-batch path there). A smaller GGUF block-row limit (``max_quant_rows()``: 12
  with AVX-512, 8 with AVX2), above which a matmul reads the float32 copy (4.8x the
  bytes), caps it further;
* CUDA: half the step's ridge, the rows at which a step of verification rows (each with
  logits) spends as long on its matmul FLOPs as on reading its weights
  (``StepCostModel.ridge_rows`` of engine/cost.py, for the model, dtype and weight format
  served), at the device table's peaks (planner/devices.py; ``ridge_rows_for``). For a
  dense model in bfloat16 that is about peak FLOP/s over peak bandwidth: an H100 SXM's
  989 TFLOP/s and 3.35 TB/s give 296 rows, so a cap of 148; an H200 (4.8 TB/s) 103; an
  A100 80GB 77; int8 weights (half the bytes) half as many. Half, not the ridge itself,
  because a matmul of a few hundred rows reaches less than the peak FLOP/s, which moves
  the real ridge below the roofline's. A GPU not in the table, a dtype without a peak
  there, or a mixture of experts (whose rows are not free below the ridge: each may read
  experts no other row did) takes ``CUDA_STEP_TOKENS`` (128, the rule's value for an
  H100 before it was derived). Both are datasheet estimates, owed a measurement on the
  GPU: the step time of n rows against one row's, as the CPU's 16 was measured.

**Acceptance-aware k (per request).** A verification of ``k`` drafts makes a batch-1 step
cost ``1 + k c`` decode steps, where ``c`` (``row_cost``) is what one more row costs,
relative to a one-row decode step, plus what proposing one draft costs (0 for n-gram
lookups; about the draft model's size over the target's for a draft model). Greedy
verification keeps drafts up to the first miss, so with ``a`` the chance that a draft is
right when the ones before it were, the step emits ``1 + a + a^2 + ... + a^k`` tokens on
average. Speculating pays when that rate beats plain decoding's one token a step::

    gain(k) = (1 + a + ... + a^k) / (1 + k c)        propose argmax_k gain(k), k in 1..K,
                                                      or nothing if no gain(k) exceeds 1

``a`` is estimated per request from its own drafts, recent ones weighing more: each draft
checked is a trial (kept, or the miss that ends the verification), and before each trial
the counts decay, ``A <- DECAY A + kept``, ``R <- DECAY R + missed``, so about the last
``1 / (1 - DECAY)`` = 10 trials count; ``a = (A + 1/2) / (A + R + 1)``. A request copying
its prompt reaches ``a`` ~ 0.9 within three verifications and proposes the full ``K``; one
whose drafts keep missing shrinks to 1 draft, then to none.

A fresh request first probes with one draft, the cheapest test, whatever its estimate says
(its ``a`` of 1/2 alone would not pay for a draft model's drafts). A request for which
nothing pays pauses for ``pause`` steps, which starts at ``MIN_PAUSE`` and doubles up to
``MAX_PAUSE`` while it stays so, and then probes again; a verification that keeps a draft
sets ``pause`` back to ``MIN_PAUSE``. In free generation, where n-gram drafts are rarely
right, this bounds the waste to one 2-row step per ``MAX_PAUSE`` steps once the pause has
grown.

``row_cost`` per device (``default_row_cost``):

* the CPU: 0.4. Measured on the 2-core AMD EPYC machine (default model, GGUF blocks,
  AVX-512 VNNI; benchmarks/RESULTS.md): a 5-row verification step costs about 2.6 one-row
  decode steps. A one-row step is bound by reading the weights; each further row adds its
  integer dot products (three per weight and row, for exactness: kernels/cpu/csrc/
  gemm_q.cpp), about 0.4 of a decode step's time;
* CUDA: 0.02, an estimate owed a GPU measurement (a verification step of k + 1 rows
  against a decode step). A GPU step of a few rows is bound by reading the weights alone:
  the roofline's own figure for one more row, one over the ridge rows (0.003 on an H100),
  counts only the matmul FLOPs; 0.02 leaves room for what grows with the rows besides them
  (attention, the LM head's logits at every position, sampling), none of which is measured.

``row_cost=0`` disables the rule (every request proposes ``K``, never pauses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.devices import device_for_cuda_name

if TYPE_CHECKING:
    from engine.cost import StepCostModel

DECAY = 0.9
MIN_PAUSE = 8
MAX_PAUSE = 64
CPU_STEP_TOKENS = 16
CUDA_STEP_TOKENS = 128
CPU_ROW_COST = 0.4
CUDA_ROW_COST = 0.02


# The device table's key for each torch dtype's matmuls (float32 runs without TF32).
_PEAK_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def ridge_rows_for(cost_model: StepCostModel, cuda_name: str, dtype: str) -> int | None:
    """The step's ridge rows (``StepCostModel.ridge_rows``) at the peaks of the GPU named
    ``cuda_name`` (``torch.cuda.get_device_name()``) in ``dtype`` ("bfloat16", ...), from
    the device table; None when the GPU or its peak for the dtype is not in it, or for a
    mixture of experts, whose rows below the ridge are not free (each may read experts no
    other row did)."""
    if cost_model.num_moe_layers:
        return None
    device = device_for_cuda_name(cuda_name)
    key = _PEAK_KEYS.get(dtype)
    if device is None or key is None or key not in device.peak_flops:
        return None
    return cost_model.ridge_rows(device.memory_bandwidth, device.peak_flops[key])


def default_max_step_tokens(
    device_type: str, block_rows: int, ridge_rows: int | None = None
) -> int:
    """The auto-disable threshold for a device (module docstring).

    Args:
        device_type: "cpu" or "cuda".
        block_rows: the cost model's GGUF block-row limit (0 when no blocks are read).
        ridge_rows: on CUDA, the step's ridge rows at the device's peaks (``ridge_rows_for``;
            None: not known, ``CUDA_STEP_TOKENS``).
    """
    if device_type == "cuda":
        return max(2, ridge_rows // 2) if ridge_rows else CUDA_STEP_TOKENS
    if block_rows > 0:
        return min(block_rows, CPU_STEP_TOKENS)
    return CPU_STEP_TOKENS


def default_row_cost(device_type: str) -> float:
    """What verifying one more row costs, relative to a one-row decode step (module
    docstring)."""
    return CUDA_ROW_COST if device_type == "cuda" else CPU_ROW_COST


def best_num_drafts(acceptance: float, max_drafts: int, draft_cost: float) -> int:
    """The ``k`` in ``0..max_drafts`` with the most tokens per unit of step time, where a
    draft is right with probability ``acceptance`` given the ones before it were and each
    draft costs ``draft_cost`` of a decode step (module docstring); 0 when none beats plain
    decoding."""
    best_k, best_gain = 0, 1.0
    tokens, term = 1.0, 1.0
    for k in range(1, max_drafts + 1):
        term *= acceptance
        tokens += term
        gain = tokens / (1.0 + k * draft_cost)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


@dataclass(slots=True)
class _Record:
    kept: float = 0.0  # discounted drafts kept
    missed: float = 0.0  # discounted drafts rejected (at most one a verification)
    pause: int = MIN_PAUSE
    paused_until: int = 0  # step number at which it may propose again
    probing: bool = True  # its next proposal is a one-draft probe (fresh, or after a pause)

    @property
    def acceptance(self) -> float:
        return (self.kept + 0.5) / (self.kept + self.missed + 1.0)

    def trial(self, kept: bool) -> None:
        self.kept = DECAY * self.kept + kept
        self.missed = DECAY * self.missed + (not kept)


class SpeculationPolicy:
    """Decides, per step, how many drafts each decoding request proposes.

    Owns: each request's acceptance record and pause (forgotten when it finishes).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_step_tokens: int,
        row_cost: float = 0.0,
        proposal_cost: float = 0.0,
    ) -> None:
        """Args:
        num_speculative_tokens: K, the most drafts a request proposes in a step.
        max_step_tokens: the auto-disable rule's budget.
        row_cost: one more verified row, relative to a one-row decode step (0: every
            request proposes K).
        proposal_cost: proposing one draft, in the same unit (a draft model's step).
        """
        self.k = num_speculative_tokens
        self.max_step_tokens = max_step_tokens
        self.row_cost = row_cost
        self.draft_cost = row_cost + proposal_cost if row_cost > 0 else 0.0
        self._records: dict[str, _Record] = {}
        self._step = 0

    def drafts_per_request(self, num_running: int, num_candidates: int) -> int:
        """The auto-disable cap: drafts each of ``num_candidates`` proposing requests may
        have in a step with ``num_running`` running requests; 0 disables speculation."""
        if num_candidates == 0:
            return 0
        room = self.max_step_tokens - num_running
        return max(0, min(self.k, room // num_candidates))

    def begin_step(self) -> None:
        self._step += 1

    def may_propose(self, request_id: str) -> bool:
        record = self._records.get(request_id)
        return record is None or self._step >= record.paused_until

    def wanted(self, request_id: str) -> int:
        """Drafts the request should propose this step by its acceptance (module
        docstring), before the step's cap; 0 pauses it. Call once per step, for a request
        that ``may_propose``."""
        if self.draft_cost <= 0:
            return self.k
        record = self._records.setdefault(request_id, _Record())
        if self._step < record.paused_until:
            return 0
        if record.probing:
            return 1
        k = best_num_drafts(record.acceptance, self.k, self.draft_cost)
        if k == 0:
            record.paused_until = self._step + record.pause
            record.pause = min(2 * record.pause, MAX_PAUSE)
            record.probing = True
        return k

    def acceptance(self, request_id: str) -> float:
        """The request's estimated per-draft acceptance (1/2 before any verification)."""
        record = self._records.get(request_id)
        return record.acceptance if record is not None else _Record().acceptance

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record a verification of ``num_drafts`` drafts of which ``num_accepted`` were kept."""
        if num_drafts == 0:
            return
        record = self._records.setdefault(request_id, _Record())
        record.probing = False
        for _ in range(num_accepted):
            record.trial(True)
        if num_accepted < num_drafts:
            record.trial(False)
        if num_accepted > 0:
            record.pause = MIN_PAUSE

    def forget(self, request_id: str) -> None:
        self._records.pop(request_id, None)
