"""Schema behaviour the API relies on: strict types, omitted extension fields, finish reasons."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    finish_reason,
)


def test_requests_are_strictly_typed_but_keep_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"prompt": "x", "max_tokens": "16"}')
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"prompt": "x", "echo": 1}')
    req = CompletionRequest.model_validate_json('{"prompt": [1, 2], "temperature": 1, "z": 0}')
    assert req.prompt == [1, 2] and req.temperature == 1.0 and req.model_extra == {"z": 0}
    assert req.max_tokens == 16 and req.n == 1


def test_null_means_the_default_where_the_field_has_no_null_of_its_own() -> None:
    """OpenAI's optional fields are nullable and the SDK sends None as null."""
    req = CompletionRequest.model_validate_json(
        '{"prompt": "x", "n": null, "echo": null, "stream": null, "ignore_eos": null,'
        ' "stream_options": {"include_usage": null}, "max_tokens": null}'
    )
    assert (req.n, req.echo, req.stream, req.ignore_eos) == (1, False, False, False)
    assert req.stream_options is not None and req.stream_options.include_usage is False
    assert req.max_tokens is None  # a field whose null means something keeps it
    assert "n" not in req.model_fields_set and req.model_extra == {}
    chat = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "x"}], "logprobs": null, "n": null}'
    )
    assert (chat.logprobs, chat.n) == (False, 1)
    with pytest.raises(ValidationError):  # a required field's null is still a type error
        CompletionRequest.model_validate_json('{"prompt": null}')
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json('{"messages": [{"role": null}]}')


def test_extension_fields_are_left_out_unless_set() -> None:
    """The fields a request opts into (return_token_ids, prompt_logprobs) are left out unless
    set; vLLM's stop_reason, which its clients read on every choice, is always there."""
    choice = CompletionChoice(index=0, text="a")
    assert choice.model_dump() == {"index": 0, "text": "a", "logprobs": None,
                                   "finish_reason": None, "stop_reason": None}  # fmt: skip
    assert CompletionChoice(index=0, text="a", token_ids=[1]).model_dump()["token_ids"] == [1]
    chunk = ChatCompletionChunk(id="c", created=0, model="m",
                                choices=[ChatChunkChoice(index=0, delta=ChatDelta())])  # fmt: skip
    dumped = chunk.model_dump()
    assert "usage" not in dumped and dumped["choices"][0]["delta"] == {}


def test_finish_reasons_reported_to_clients() -> None:
    assert finish_reason("stop") == "stop"
    assert finish_reason("length") == "length"
    assert finish_reason(None) is None
    for internal in ("abort", "error"):
        with pytest.raises(ValueError):
            finish_reason(internal)
