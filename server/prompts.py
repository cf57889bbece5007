"""Turn request prompts into token ids: completions prompts, chat messages rendered with the
tokenizer's chat template, /tokenize. The checks on what comes in (text, token ids, messages)
are server/validation.py's.

Double-BOS guard (vLLM#2012, TGI#1594): chat prompts are rendered by the tokenizer's chat
template, which already writes every special token it wants, and are then encoded with
``add_special_tokens=False``. Plain completion prompts are encoded with the tokenizer's
default specials (a BOS where the model expects one), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.errors import invalid
from server.protocol import ChatMessage
from server.validation import check_chat_messages, check_text, check_token_ids


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as the client sent it (for echo); None for token prompts


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    check_text(text, param)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Any, vocab_size: int
) -> list[Prompt]:
    """The prompts of a completions request, tokenized; raises a 400 on empty ones."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]  # one prompt of token ids
    else:
        items = list(prompt)  # type: ignore[arg-type]  # a batch of strings or id lists
    if not items:
        raise invalid("'prompt' must not be an empty list", "prompt")
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = encode(tokenizer, item, add_special_tokens=True, param=param)
            prompts.append(Prompt(ids, item))
        else:
            check_token_ids(item, vocab_size, param)
            prompts.append(Prompt(list(item), None))
        if not prompts[-1].token_ids:
            raise invalid(f"'{param}' is empty: a prompt needs at least one token", param)
    return prompts


def chat_prompt(
    messages: Sequence[ChatMessage], tokenizer: Any, add_generation_prompt: bool = True
) -> Prompt:
    """Render messages with the tokenizer's chat template and tokenize them."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(
            "this model has no chat template; use /v1/completions", "messages", "no_chat_template"
        )
    rendered = check_chat_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # templates raise on role orders they do not accept
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return Prompt(ids, text)
