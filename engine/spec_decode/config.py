"""SpeculativeConfig: how speculative decoding proposes and how far it may go."""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_NGRAM_MIN = 2
DEFAULT_NGRAM_MAX = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Args:
    method: "ngram" (prompt lookup: the continuation of the most recent earlier match of
        the last n tokens in the prompt and the output so far) or "draft" (a smaller model
        with the same vocabulary proposes, run by the same engine code with its own KV pool).
    num_speculative_tokens: the most tokens proposed per request and step (k); a
        verification emits up to k + 1.
    ngram_min, ngram_max: the n-gram lengths searched, longest first (ngram only).
    model: the draft model: an HF directory, a .gguf file, or "default" (draft only).
    draft_load_format: "auto" reads the draft checkpoint; "dummy" gives it random weights
        (``model`` may then name a shape preset), to show the machinery without a trained
        draft.
    max_step_tokens: the auto-disable rule. A step speculates only while its decodes plus
        their drafts stay within this many tokens, each request's k shrinking to fit and
        no drafts when not even one each fits (so batches of more than half of it decode
        plainly). None takes the engine's default for the device
        (engine/spec_decode/policy.py: ``default_max_step_tokens``).
    row_cost: the acceptance-aware rule. What verifying one more row costs, relative to a
        one-row decode step: each request proposes the number of drafts its recent
        acceptance pays for, and none, pausing, when no number does (engine/spec_decode/
        policy.py). 0 turns the rule off (every request proposes k); None takes the
        device's default (``default_row_cost``).
    """

    method: str = "ngram"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    model: str | None = None
    draft_load_format: str = "auto"
    max_step_tokens: int | None = None
    row_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.method == "draft" and not self.model:
            raise ValueError("the draft method needs a speculative model (--speculative-model)")
        if self.method == "ngram" and self.model:
            raise ValueError("a speculative model is only used by the draft method")
        if self.draft_load_format not in ("auto", "dummy"):
            raise ValueError(
                f"draft_load_format must be auto or dummy, got {self.draft_load_format!r}"
            )
        if self.max_step_tokens is not None and self.max_step_tokens < 2:
            raise ValueError(f"max_step_tokens must be at least 2, got {self.max_step_tokens}")
        if self.row_cost is not None and not 0 <= self.row_cost <= 100:
            raise ValueError(f"row_cost must be in [0, 100], got {self.row_cost}")
