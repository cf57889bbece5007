"""Prompt logprobs in the response shapes clients read: vLLM's ``prompt_logprobs`` field (both
endpoints) and completions' ``echo`` with ``logprobs`` (OpenAI's legacy format over the prompt
tokens, then the generated ones), which evaluation harnesses use to score text
(lm-evaluation-harness sends ``echo``, ``logprobs: 1`` and ``max_tokens`` 0 or 1).

The engine computes them (engine/prompt_logprobs.py): raw ``log_softmax``, as the generated
tokens' logprobs. A value JSON cannot carry (``-inf``) is sent as -9999.0, as vLLM sends it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.outputs import TokenLogprob
from server.generation import TokenTexts
from server.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs

LOWEST_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if value >= LOWEST_LOGPROB else LOWEST_LOGPROB  # NaN too


def prompt_logprobs_json(
    entries: Sequence[TokenLogprob | None], texts: TokenTexts
) -> PromptLogprobs:
    """vLLM's format: per prompt token, token id -> logprob, rank and text, for the prompt's
    own token and the top alternatives (rank = place in the top list); None for the first."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {
            str(token_id): PromptLogprob(
                logprob=_finite(value), rank=rank, decoded_token=texts(token_id)
            )
            for rank, (token_id, value) in enumerate(entry.top, start=1)
        }
        position[str(entry.token_id)] = PromptLogprob(
            logprob=_finite(entry.logprob), rank=entry.rank, decoded_token=texts(entry.token_id)
        )
        out.append(position)
    return out


def echo_logprobs(
    prompt_token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    texts: TokenTexts,
    top_n: int,
) -> CompletionLogprobs:
    """OpenAI's completions logprobs over the prompt's tokens (``echo``): the first token has
    none (null), each later one its logprob and top-``top_n`` plus itself, keyed by text.
    ``text_offset`` adds up the tokens' texts from 0."""
    logprobs = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        text = texts(token_id)
        logprobs.tokens.append(text)
        logprobs.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
            continue
        top = {texts(t): _finite(value) for t, value in entry.top[:top_n]}
        top.setdefault(text, _finite(entry.logprob))
        logprobs.token_logprobs.append(_finite(entry.logprob))
        logprobs.top_logprobs.append(top)
    return logprobs


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """The two logprobs' lists one after the other."""
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )
