"""stop_status: EOS, stop token ids, max_tokens and the model's context length, in that order."""

from __future__ import annotations

from scheduler.request import Request, RequestStatus
from scheduler.stopping import stop_status
from tests.scheduler.fake_runner import EOS, req


def _after(
    token_ids: list[int], prompt_len: int = 4, max_tokens: int = 8, **params: object
) -> Request:
    request = req("a", prompt_len, max_tokens, **params)
    request.output_token_ids.extend(token_ids)
    return request


def test_eos_and_stop_tokens_stop() -> None:
    assert stop_status(_after([EOS]), EOS, 100) == RequestStatus.FINISHED_STOPPED
    stop = _after([77], stop_token_ids=(77,))
    assert stop_status(stop, 77, 100) == RequestStatus.FINISHED_STOPPED
    assert stop_status(_after([77]), 77, 100) is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    request = _after([EOS], ignore_eos=True)
    assert stop_status(request, EOS, 100) is None
    request = _after([EOS, EOS], max_tokens=2, ignore_eos=True)
    assert stop_status(request, EOS, 100) == RequestStatus.FINISHED_LENGTH


def test_max_tokens_and_context_length() -> None:
    assert stop_status(_after([11, 12], max_tokens=2), 12, 100) == RequestStatus.FINISHED_LENGTH
    # 4 prompt + 2 output tokens reach a 6-token context before max_tokens.
    assert stop_status(_after([11, 12]), 12, 6) == RequestStatus.FINISHED_LENGTH
    assert stop_status(_after([11, 12]), 12, 7) is None
    # A stop token wins over length.
    assert stop_status(_after([EOS], max_tokens=1), EOS, 5) == RequestStatus.FINISHED_STOPPED
