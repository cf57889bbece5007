"""Per-request timestamps, arrival to last token: every latency metric derives from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestTimings:
    """Timestamps of one engine request (one choice), all ``time.monotonic()``.

    ``arrival_time`` is when the HTTP request arrived, so TTFT includes tokenization and
    queueing, as clients measure it; ``scheduled_time`` is the engine's first step for it.
    Token times are when the server's front end received the tokens.
    """

    arrival_time: float
    num_prompt_tokens: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    last_inter_token_latency_s: float | None = None

    def on_tokens(self, num_tokens: int, now: float) -> None:
        """Record ``num_tokens`` tokens that arrived together at ``now``."""
        if num_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.last_inter_token_latency_s = now - self.last_token_time
        self.last_token_time = now
        self.num_output_tokens += num_tokens

    def on_finish(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        self.finish_time = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queue_s(self) -> float | None:
        """Arrival to the first engine step (includes tokenization, as vLLM's does not)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def prefill_s(self) -> float | None:
        """First engine step to the first token: every prefill chunk, and any preemption."""
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.scheduled_time

    @property
    def decode_s(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM bench's TPOT definition)."""
        if self.first_token_time is None or self.finish_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)
