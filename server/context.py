"""ServingContext: what every route handler needs, built once by ``create_app``."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from server.backpressure import Backpressure
from server.config import ServingConfig
from server.engine_client import AsyncEngineClient
from server.generation import TokenTexts
from server.metrics import ServerMetrics
from server.validation import RequestLimits


@dataclass(frozen=True, slots=True)
class ServingContext:
    config: ServingConfig
    client: AsyncEngineClient
    metrics: ServerMetrics
    limits: RequestLimits
    token_texts: TokenTexts
    started_at: int  # unix time, reported as the model's `created`
    backpressure: Backpressure
    chat_template: str | None = None  # --chat-template's text; None: the tokenizer's

    @property
    def model_name(self) -> str:
        return self.limits.served_model_name

    @classmethod
    def build(
        cls, config: ServingConfig, client: AsyncEngineClient, metrics: ServerMetrics
    ) -> ServingContext:
        server = config.server
        limits = RequestLimits(
            served_model_name=server.served_model_name or client.model_id,
            max_model_len=client.max_model_len,
            vocab_size=client.vocab_size,
            max_n=server.max_n,
            max_logprobs=server.max_logprobs,
            reject_unknown_fields=server.unknown_fields == "reject",
            max_prompt_tokens=server.max_prompt_tokens,
            max_output_tokens=server.max_output_tokens,
            sampling_defaults=client.sampling_defaults,
        )
        backpressure = Backpressure(
            client,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_waiting_requests=server.max_waiting_requests,
            max_queue_time_s=server.max_queue_time_s,
        )
        chat_template = None
        if server.chat_template is not None:
            with open(server.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        return cls(
            config,
            client,
            metrics,
            limits,
            TokenTexts(client.tokenizer),
            int(time.time()),
            backpressure,
            chat_template,
        )


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
