"""Turn request prompts into token ids: completions prompts, chat messages, /tokenize.

Double-BOS guard (vLLM#2012, TGI#1594): chat prompts are rendered by the tokenizer's chat
template, which already writes every special token it wants, and are then encoded with
``add_special_tokens=False``. Plain completion prompts are encoded with the tokenizer's
default specials (a BOS where the model expects one), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.errors import invalid, unsupported
from server.protocol import ChatMessage

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as the client sent it (for echo); None for token prompts


def _check_text(text: str, param: str) -> None:
    # A JSON "\udc80" escape is valid JSON but not encodable text; tokenizers would raise.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            f"'{param}' is not valid Unicode: {exc.reason} at index {exc.start}", param
        ) from None


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    _check_text(text, param)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"'{param}' contains token id {token_id} at index {i}, outside the "
                f"vocabulary [0, {vocab_size})",
                param,
            )


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


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as text; only text parts are supported."""
    param = f"messages[{index}].content"
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise invalid(f"'{param}' is required for role '{message.role}'", param)
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise unsupported(
                [f"{param}[{j}].type={kind!r}"],
                "is not supported: pagedserve serves text-only models",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{param}[{j}].text' must be a string", f"{param}[{j}].text")
        texts.append(text)
    return "".join(texts)


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Validate chat messages and turn them into the dicts a chat template reads."""
    if not messages:
        raise invalid("'messages' must contain at least one message", "messages")
    rendered = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role  # OpenAI's new name
        if role not in CHAT_ROLES:
            if role in ("tool", "function"):
                raise unsupported(
                    [f"messages[{i}].role={role!r}"],
                    "is not supported: pagedserve has no tool calling",
                )
            raise invalid(
                f"'messages[{i}].role' must be one of system, developer, user, "
                f"assistant; got {message.role!r}",
                f"messages[{i}].role",
            )
        if message.tool_calls:
            raise unsupported([f"messages[{i}].tool_calls"], "is not supported: no tool calling")
        text = message_text(message, i)
        _check_text(text, f"messages[{i}].content")
        rendered.append({"role": role, "content": text})
    return rendered


def chat_prompt(
    messages: Sequence[ChatMessage], tokenizer: Any, add_generation_prompt: bool = True
) -> Prompt:
    """Render messages with the tokenizer's chat template and tokenize them."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(
            "this model has no chat template; use /v1/completions", "messages", "no_chat_template"
        )
    rendered = chat_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # templates raise on role orders they do not accept
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return Prompt(ids, text)
