"""Stop conditions: whether a request is finished once a token has been appended.

Checked by ``Scheduler.update_from_output`` after every sampled token (and, for a token that
was pending then, by ``Scheduler.resolve_token`` once it is known); stop *strings* are
text and live in ``server/`` (the scheduler sees token ids only).
"""

from __future__ import annotations

from scheduler.request import PENDING_TOKEN, Request, RequestStatus


def stops_on(request: Request, token_id: int) -> bool:
    """Whether ``token_id`` ends the request: EOS (unless ignored) or one of its stop token
    ids. A pending token (``PENDING_TOKEN``) ends nothing until it is known."""
    if token_id == PENDING_TOKEN:
        return False
    params = request.sampling_params
    if not params.ignore_eos and (
        token_id == request.eos_token_id or token_id in request.eos_token_ids
    ):
        return True
    return token_id in params.stop_token_ids


def stop_status(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """Args:
        request: a running request, ``token_id`` already appended to its output.
        token_id: the token just sampled for it.
        max_model_len: most tokens (prompt + output) a request may reach.
    Returns:
        The finished status the request takes now (EOS or a stop token: stopped; its
        ``max_tokens`` or the model's context reached: length), or None to keep running.
    """
    params = request.sampling_params
    if stops_on(request, token_id):
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
