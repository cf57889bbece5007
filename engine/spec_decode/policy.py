"""When to speculate: the per-step auto-disable rule and the per-request backoff.

**Auto-disable (per step).** Verifying ``k`` drafts costs ``k`` more rows in the step's
forward pass. While a step is memory-bound (it reads every weight once whatever its rows)
those rows are nearly free; once the step has enough rows to be compute-bound, every row
costs its FLOPs and a rejected draft is pure loss. So a step speculates only while its
decodes plus their drafts stay within ``max_step_tokens``: each decoding request gets
``min(k, (max_step_tokens - num_running) // num_proposing)`` drafts, and none when that
is below 1. The default for the device (``default_max_step_tokens``):

* the CPU: 16 rows. Measured on the 2-core AMD EPYC machine this project is built on
  (default model, C++ kernels with GGUF blocks, benchmarks/RESULTS.md): a step of up to 16
  rows costs about one decode step, one of 24 rows over 20 times more (the matmuls leave
  their small-batch path there). A smaller GGUF block-row limit (``max_quant_rows()``: 12
  with AVX-512, 8 with AVX2), above which a matmul reads the float32 copy (4.8x the
  bytes), caps it further;
* CUDA: 128 rows, well below the ridge point of a bf16 GPU matmul (H100:
  ~990 TFLOP/s / 3.35 TB/s, about 300 rows).

**Backoff (per request).** A request whose drafts keep being rejected stops proposing for a
while: after each verification its acceptance score becomes ``(score + accepted / k) / 2``
(starting at 1); below ``POOR_ACCEPTANCE`` it pauses for ``pause`` steps, which starts at
``MIN_PAUSE`` and doubles up to ``MAX_PAUSE`` while acceptance stays poor (reset by a good
verification). After a pause the score restarts at ``RESUME_SCORE``, so one more poor
verification pauses it again.
"""

from __future__ import annotations

from dataclasses import dataclass

POOR_ACCEPTANCE = 0.3
RESUME_SCORE = 0.5
MIN_PAUSE = 8
MAX_PAUSE = 64
CPU_STEP_TOKENS = 16
CUDA_STEP_TOKENS = 128


def default_max_step_tokens(device_type: str, block_rows: int) -> int:
    """The auto-disable threshold for a device (module docstring).

    Args:
        device_type: "cpu" or "cuda".
        block_rows: the cost model's GGUF block-row limit (0 when no blocks are read).
    """
    if device_type == "cuda":
        return CUDA_STEP_TOKENS
    if block_rows > 0:
        return min(block_rows, CPU_STEP_TOKENS)
    return CPU_STEP_TOKENS


@dataclass(slots=True)
class _Backoff:
    score: float = RESUME_SCORE
    pause: int = MIN_PAUSE
    paused_until: int = 0  # step number at which it may propose again


class SpeculationPolicy:
    """Decides, per step, how many drafts each decoding request may propose.

    Owns: each request's acceptance score and pause (forgotten when it finishes).
    """

    def __init__(self, num_speculative_tokens: int, max_step_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.max_step_tokens = max_step_tokens
        self._backoff: dict[str, _Backoff] = {}
        self._step = 0

    def drafts_per_request(self, num_running: int, num_candidates: int) -> int:
        """Drafts each of ``num_candidates`` decoding requests may propose in a step with
        ``num_running`` running requests: 0 disables speculation for the step."""
        if num_candidates == 0:
            return 0
        room = self.max_step_tokens - num_running
        return max(0, min(self.k, room // num_candidates))

    def begin_step(self) -> None:
        self._step += 1

    def may_propose(self, request_id: str) -> bool:
        state = self._backoff.get(request_id)
        return state is None or self._step >= state.paused_until

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record a verification of ``num_drafts`` drafts of which ``num_accepted`` were kept."""
        if num_drafts == 0:
            return
        state = self._backoff.setdefault(request_id, _Backoff())
        if state.paused_until:  # the first verification after a pause
            state.score = RESUME_SCORE
            state.paused_until = 0
        state.score = (state.score + num_accepted / num_drafts) / 2
        if state.score < POOR_ACCEPTANCE:
            state.paused_until = self._step + state.pause
            state.pause = min(2 * state.pause, MAX_PAUSE)
        elif num_accepted > 0:
            state.pause = MIN_PAUSE

    def forget(self, request_id: str) -> None:
        self._backoff.pop(request_id, None)
