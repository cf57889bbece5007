"""Sampling fields the data-parallel routers add to every request they forward."""

from __future__ import annotations

from typing import Any

# Fields vllm-router and sglang-router add to every /v1/completions and /v1/chat/completions
# body they forward (observed on vllm-router 0.1.17 and sglang-router 0.3.2), with the value
# they send when the client did not set them. Each value is what this server does anyway
# (stop strings are trimmed, special tokens skipped, no hidden states, no reasoning parser
# to separate anything), so a field at exactly this value changes nothing and is accepted;
# any other value is still an unknown field (400 under --unknown-fields reject). They also
# send ``skip_special_tokens``, and chat ``continue_final_message``, which are request
# fields of their own (server/protocol.py); the completions route has no
# ``continue_final_message``, so it is here.
ROUTER_NEUTRAL_FIELDS: dict[str, object] = {
    "no_stop_trim": False,
    "return_hidden_states": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
}


def neutral_router_fields(extra: dict[str, Any] | None) -> set[str]:
    """The names in a request's unknown fields that a router added at their neutral value.

    Booleans compare by identity so that ``1`` or ``"true"`` are not taken for ``True``.
    """
    return {
        name
        for name, value in (extra or {}).items()
        if name in ROUTER_NEUTRAL_FIELDS and value is ROUTER_NEUTRAL_FIELDS[name]
    }
