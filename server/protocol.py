"""Pydantic schemas of the HTTP API, the only pydantic in the repo: it stays at the HTTP
edge, and everything behind the server reads plain frozen dataclasses.

Requests are parsed in *strict* mode: a field of the wrong JSON type (``"max_tokens": "16"``,
``"temperature": true``) is a 422, as FastAPI reports schema errors. Types only live here;
*values* (ranges, context length, unsupported-but-known parameters) are checked in
``server/validation.py`` and answered with a 400 that names the parameter.

Unknown fields: requests keep them (``extra="allow"``) so the server can name them in a 400
("Unrecognized request argument supplied: foo", as OpenAI answers), or drop them with a warning
under ``--unknown-fields ignore`` (vLLM's behaviour). A few OpenAI fields that change nothing
for a self-hosted server are accepted and ignored on purpose: ``user``, ``store``,
``metadata``, ``service_tier``, and ``parallel_tool_calls`` on completions (chat reads it:
server/tools.py). The policy covers
top-level fields and ``stream_options``; extra fields inside ``messages`` are ignored, because
the openai SDK echoes assistant messages back with fields such as ``refusal``/``annotations``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "tool_calls"]


def finish_reason(reason: str | None) -> FinishReason | None:
    """The engine's / server's finish reason as clients see it. ``abort`` and ``error`` are
    never reported as a finish reason: an aborted request has no reader, and an error becomes
    an error response (or an in-band error event when streaming)."""
    if reason is None or reason == "stop":
        return "stop" if reason else None
    if reason == "length":
        return "length"
    raise ValueError(f"finish reason {reason!r} is not reported to clients")


# Field names OpenAI defines that pagedserve accepts and deliberately ignores (see docstring).
IGNORED_OPENAI_FIELDS = frozenset({"store", "metadata", "service_tier", "parallel_tool_calls"})


class _Request(BaseModel):
    """``null`` for a field that has a default and no null value of its own means the
    default, as OpenAI's schema makes every optional field nullable and the SDK sends
    ``None`` as ``null`` (``n=None``); a required field's ``null`` stays a type error."""

    model_config = ConfigDict(strict=True, extra="allow")
    _NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._NULL_MEANS_DEFAULT = frozenset(
            name
            for name, field in cls.model_fields.items()
            if not field.is_required() and type(None) not in get_args(field.annotation)
        )

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_with_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(
            data.get(name, 0) is None for name in cls._NULL_MEANS_DEFAULT
        ):
            return {
                k: v for k, v in data.items() if v is not None or k not in cls._NULL_MEANS_DEFAULT
            }
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Optional extension fields are left out of the JSON when unset rather than sent as null.
_OMIT_IF_NONE: Any = Field(default=None, exclude_if=lambda value: value is None)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage in every chunk


class _SamplingFields(_Request):
    """Fields completions and chat share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None  # None serves the one model; otherwise it must match its name
    n: int = 1
    temperature: float | None = None  # None -> 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None  # vLLM: no stop token or stop string before this many
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last k tokens (-1: context)
    include_stop_str_in_output: bool = False  # vLLM: keep the stop string / stop token's text
    skip_special_tokens: bool = True  # vLLM: false keeps special tokens' text
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    # vLLM extension: return prompt and completion token ids with each choice.
    return_token_ids: bool = False
    # vLLM extension: each prompt token's logprob, rank and this many alternatives
    # (completions: per choice; chat: beside the choices). Not with stream.
    prompt_logprobs: int | None = None
    # Structured output (server/structured.py): OpenAI's response_format, vLLM's guided_*
    # fields and its structured_outputs object. Shapes are checked there, with 400s.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # null: up to the context length
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # rejected unless null / empty
    best_of: int | None = None  # rejected unless equal to n


class ChatMessage(_Request):
    role: str
    # A list of parts is accepted for text parts; other part types are reported as unsupported.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # chat: null = up to the context, as OpenAI
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's chat-template controls (server/prompts.py): open the assistant's turn, or end
    # the prompt inside the last message so the model continues it; more template variables.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: the reply starts with the last message's text if it is the
    # assistant's (with continue_final_message: the whole message, prefill included)
    # Tool calling (server/tools.py); checked there.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (auto keeps the first)
    # Rejected when set to something that would need features pagedserve does not have.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only; chat templates carry their own specials
    add_generation_prompt: bool = True  # messages only, as the three below
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # each token's vocabulary string too (vLLM)
    # messages only: rendered by the chat template as the chat route renders them, so the
    # count is the one a chat request with these tools is charged
    tools: list[Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(_Response):
    """vLLM's ``prompt_logprobs`` entry: one token's logprob at a prompt position, its rank
    (1 = the most likely) and its text."""

    logprob: float
    rank: int | None
    decoded_token: str


# One entry per prompt token, None for the first; each maps token ids (JSON keys) to entries:
# the prompt's own token and the top alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions format: parallel lists, one entry per generated token
    (with ``echo``, per prompt token first: the first has no logprob)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id
    token_ids: list[int] | None = _OMIT_IF_NONE  # with return_token_ids
    prompt_token_ids: list[int] | None = _OMIT_IF_NONE  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = _OMIT_IF_NONE  # with prompt_logprobs


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(_Response):
    """A tool call in a stream: pagedserve sends each call whole, in one chunk."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = _OMIT_IF_NONE


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id
    token_ids: list[int] | None = _OMIT_IF_NONE
    prompt_token_ids: list[int] | None = _OMIT_IF_NONE


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = _OMIT_IF_NONE  # with prompt_logprobs


class ChatDelta(_Response):
    role: Literal["assistant"] | None = _OMIT_IF_NONE
    content: str | None = _OMIT_IF_NONE
    tool_calls: list[DeltaToolCall] | None = _OMIT_IF_NONE


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id
    token_ids: list[int] | None = _OMIT_IF_NONE


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = _OMIT_IF_NONE


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _OMIT_IF_NONE


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = _OMIT_IF_NONE  # with return_token_strs (vLLM)


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    error: ErrorInfo
