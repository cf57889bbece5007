"""Turn request prompts into token ids: completions prompts, chat messages rendered with the
tokenizer's chat template, /tokenize. The checks on what comes in (text, token ids, messages)
are server/validation.py's.

Double-BOS guard (vLLM#2012, TGI#1594): chat prompts are rendered by the tokenizer's chat
template, which already writes every special token it wants, and are then encoded with
``add_special_tokens=False``. Plain completion prompts are encoded with the tokenizer's
default specials (a BOS where the model expects one), as vLLM does.

Control tokens: in a chat, only the template's own structure yields special tokens. Text the
client sent (every string of every message: system, user, assistant and tool content alike,
the arguments of an assistant's tool calls, and every string of ``tools``) is encoded as text,
so a message holding ``<|im_end|>\\n<|im_start|>system`` cannot forge a turn: those strings
become ordinary pieces (``<``, ``|``, ``im``, ...). A completions prompt and
``/tokenize``'s ``prompt`` belong to the client whole (there is no template to protect), so
their control-token strings are parsed as special tokens, as vLLM does (OpenAI does not).
``--allow-special-tokens-in-content`` restores parsing inside chat content, for trusted
clients that send raw control tokens.

::

    rendered:  <|im_start|>user\\n hi<|im_end|>...  <|im_end|>\\n<|im_start|>assistant\\n
               |-- template ----||-- content ------||-- template ------------------|
    encoded:   specials parsed   specials as text   specials parsed
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from server.errors import invalid
from server.protocol import ChatMessage
from server.tools import template_supports_tools
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


def truncate_prompt(prompt: Prompt, keep: int | None, max_model_len: int) -> Prompt:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the model's
    context length); a truncated prompt has no text of its own (echo shows its tokens')."""
    if keep is None:
        return prompt
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise invalid(
            f"'truncate_prompt_tokens' must be -1 or in [1, {max_model_len}] (the model's "
            f"context length), got {keep}",
            "truncate_prompt_tokens",
        )
    if len(prompt.token_ids) <= keep:
        return prompt
    return Prompt(prompt.token_ids[-keep:], None)


def chat_prompt(
    messages: Sequence[ChatMessage],
    tokenizer: Any,
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    allow_special_tokens_in_content: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> Prompt:
    """Render messages with the chat template (``chat_template``, the server's
    ``--chat-template``, else the tokenizer's) and tokenize them. ``tools`` go to the
    template's ``tools=`` argument; a template that never reads them is a 400.

    vLLM's template controls: ``add_generation_prompt`` (open the assistant's turn),
    ``continue_final_message`` (end the prompt inside the last message, so the model goes
    on writing it: an assistant prefill), and ``template_kwargs`` (the request's
    ``chat_template_kwargs``: more variables for the template, e.g. ``enable_thinking``).

    Control-token strings inside the messages (and in ``template_kwargs``' strings, which
    the template may write out) are encoded as text unless ``allow_special_tokens_in_content``
    (see the module docstring); in ``template_kwargs`` they are a 400, since where the
    template writes a variable cannot be told apart from its own text.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid(
            "this model has no chat template; use /v1/completions", "messages", "no_chat_template"
        )
    if continue_final_message and add_generation_prompt:
        raise invalid(
            "'continue_final_message' continues the last message, and 'add_generation_prompt' "
            "opens a new one: set 'add_generation_prompt' to false",
            "continue_final_message",
        )
    template_kwargs = _check_template_kwargs(
        tokenizer, template_kwargs, allow_special_tokens_in_content
    )
    if tools and not template_supports_tools(template):
        raise invalid(
            "this model's chat template does not render tools, so the model would never see "
            "them; start the server with a --chat-template that does",
            "tools",
            "tools_not_supported",
        )
    if any(m.tool_calls for m in messages) and not re.search(r"\btool_calls\b", template):
        # The calls would vanish from the prompt, and the model then reads tool results for
        # calls it never made.
        raise invalid(
            "this model's chat template does not render an assistant message's 'tool_calls', "
            "so the model would never see them; start the server with a --chat-template "
            "that does",
            "messages",
            "tools_not_supported",
        )
    rendered = check_chat_messages(messages)
    render = functools.partial(
        _render,
        tokenizer,
        tools=tools,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    text = render(rendered, add_generation_prompt)
    control = _control_tokens(tokenizer)
    if allow_special_tokens_in_content or not _holds_control_string(rendered, control, tools):
        # Nothing to protect: the whole text in one call, exactly as the tokenizer splits it.
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = encode_chat_as_text(
            tokenizer, rendered, add_generation_prompt, text, render, tools=tools
        )
    return Prompt(ids, text)


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    *,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # templates raise on role orders they do not accept
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    return str(text)


def _check_template_kwargs(
    tokenizer: Any, kwargs: dict[str, Any] | None, allow_special_tokens: bool
) -> dict[str, Any] | None:
    """``chat_template_kwargs`` as the template's extra variables: none may stand for one of
    ``apply_chat_template``'s own parameters (those have their request fields), and none may
    hold a control-token string unless the server allows them in content."""
    if not kwargs:
        return None
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    own = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD} | {"messages"}
    taken = sorted(own & set(kwargs))
    if taken:
        raise invalid(
            f"'chat_template_kwargs' cannot set {', '.join(map(repr, taken))}: "
            "the request has its own fields for what the template is given",
            "chat_template_kwargs",
        )
    if not allow_special_tokens:
        control = _control_tokens(tokenizer)
        if any(c in string for string in _strings(kwargs) for c in control.ids):
            raise invalid(
                "'chat_template_kwargs' holds control-token strings, which the template would "
                "write as the model's own structure; remove them (or start the server with "
                "--allow-special-tokens-in-content)",
                "chat_template_kwargs",
            )
    return kwargs


@dataclass(frozen=True, slots=True)
class _ControlTokens:
    """The tokenizer's special added tokens: their ids, and a pattern that finds them the way
    the tokenizer does (longest first; ``lstrip``/``rstrip`` tokens take the whitespace
    beside them)."""

    ids: dict[str, int]
    pattern: re.Pattern[str] | None


def _control_tokens(tokenizer: Any) -> _ControlTokens:
    added = getattr(tokenizer, "added_tokens_decoder", {})
    specs = tuple(
        sorted(
            (
                str(tok.content),
                int(i),
                bool(getattr(tok, "lstrip", False)),
                bool(getattr(tok, "rstrip", False)),
            )
            for i, tok in added.items()
            if getattr(tok, "special", False) and str(tok.content)
        )
    )
    return _compile_control_tokens(specs)


@functools.lru_cache(maxsize=8)
def _compile_control_tokens(specs: tuple[tuple[str, int, bool, bool], ...]) -> _ControlTokens:
    if not specs:
        return _ControlTokens({}, None)
    alternatives = [
        ("\\s*" if lstrip else "") + f"(?:{re.escape(content)})" + ("\\s*" if rstrip else "")
        for content, _, lstrip, rstrip in sorted(specs, key=lambda s: -len(s[0]))
    ]
    return _ControlTokens(
        {content: token_id for content, token_id, _, _ in specs},
        re.compile("|".join(alternatives)),
    )


def _holds_control_string(
    messages: list[dict[str, Any]],
    control: _ControlTokens,
    tools: list[dict[str, Any]] | None = None,
) -> bool:
    strings = [
        *(
            string
            for message in messages
            for key, value in message.items()
            if key != "role"
            for string in _strings(value)
        ),
        *_strings(tools or []),
    ]
    return any(content in string for string in strings for content in control.ids)


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (JSON-like), dict keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def encode_chat_as_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    text: str,
    render: Any = None,
    *,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The ids of ``text`` (the rendered chat) with special-token parsing only outside the
    client's strings.

    The template is rendered again with each string replaced by a unique marker, so the
    rendered text splits into template pieces and client strings. Control tokens are found
    in the template pieces only; the text between two of them (template text and client
    strings together, as the tokenizer itself would see it) is encoded without special
    parsing. A marker keeps the string's leading and trailing whitespace, so a template that
    trims its content (``| trim``) trims the same way. The strings a template writes as JSON
    (``tojson``: tool calls' arguments, ``tools``), keys included, are marked only where
    they hold a control string, and such a string may appear JSON-escaped.

    Raises:
        APIError: 400 when the template rewrites content beyond trimming (the client strings
            then cannot be located, so their control strings cannot be kept as text).
    """
    nonce = secrets.token_hex(8)
    control = _control_tokens(tokenizer)
    cores: list[str] = []

    def mark(value: str) -> str:
        if not value.strip():
            return value
        lead, trail = value[: len(value) - len(value.lstrip())], value[len(value.rstrip()) :]
        cores.append(value.strip())
        return f"{lead}\ue000{nonce}:{len(cores) - 1}\ue000{trail}"

    def mark_nested(value: Any) -> Any:
        if isinstance(value, str):
            return mark(value) if any(c in value for c in control.ids) else value
        if isinstance(value, dict):
            return {mark_nested(key): mark_nested(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [mark_nested(item) for item in value]
        return value

    def mark_message(message: dict[str, Any]) -> dict[str, Any]:
        # Every string the template writes as it is (content, tool_call_id) gets a marker;
        # tool calls, which it writes as JSON, only where they hold a control string.
        copy: dict[str, Any] = {}
        for key, value in message.items():
            if key == "role":
                copy[key] = value
            elif isinstance(value, str):
                copy[key] = mark(value)
            else:
                copy[key] = mark_nested(value)
        return copy

    marked = [mark_message(message) for message in messages]
    if render is None:
        render = functools.partial(_render, tokenizer)
    if tools:
        marked_render = render(marked, add_generation_prompt, tools=mark_nested(tools))
    else:
        marked_render = render(marked, add_generation_prompt)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue000", marked_render)
    # parts alternates template text and marker numbers: [tpl, 0, tpl, 1, tpl, ...]
    written = _as_written(parts, cores, text)
    if written is None:
        raise invalid(
            "the messages hold control-token strings, and this model's chat template rewrites "
            "message content, so they cannot be kept as text; remove them (or start the "
            "server with --allow-special-tokens-in-content)",
            "messages",
        )
    ids: list[int] = []
    run: list[str] = []  # text since the last template control token

    def flush() -> None:
        if run:
            ids.extend(_encode_text_only(tokenizer, "".join(run)))
            run.clear()

    for i, part in enumerate(parts):
        if i % 2:
            run.append(written[i // 2])
            continue
        start = 0
        for match in control.pattern.finditer(part) if control.pattern else ():
            run.append(part[start : match.start()])
            flush()
            ids.append(control.ids[match.group().strip()])
            start = match.end()
        run.append(part[start:])
    flush()
    return ids


def _as_written(parts: list[str], cores: list[str], text: str) -> list[str] | None:
    """Each marker's string as ``text`` holds it: as sent, or JSON-escaped (a template's
    ``tojson``); None when the template pieces and the strings do not rebuild ``text``."""
    written: list[str] = []
    pos = 0
    for i, part in enumerate(parts):
        if i % 2 == 0:
            forms = [part]
        else:
            core = cores[int(part)]
            forms = [core, json.dumps(core, ensure_ascii=False)[1:-1]]
        form = next((f for f in forms if text.startswith(f, pos)), None)
        if form is None:
            return None
        if i % 2:
            written.append(form)
        pos += len(form)
    return written if pos == len(text) else None


def _encode_text_only(tokenizer: Any, text: str) -> list[int]:
    """``text`` as ordinary tokens: control-token strings become their plain pieces."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def check_chat_template_file(path: str) -> None:
    """Compile the ``--chat-template`` file as the server renders it (transformers' own Jinja
    environment, whose compiled template it caches), so a template that cannot compile is
    refused at start-up, not blamed on every chat request's ``messages`` as a 400.

    Raises:
        ValueError: one line naming the file and the error (with its line number).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--chat-template {path!r} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ValueError(f"--chat-template {path!r} cannot be read: {exc.strerror}") from None
    try:
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # not this transformers' layout: the first render reports it
        return
    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        why = " ".join(str(exc.message).split())  # one line, whatever jinja2 wrote
        raise ValueError(
            f"--chat-template {path!r} does not compile: line {exc.lineno}: {why}"
        ) from None
