"""What a checkpoint says about stopping and sampling, read once at start-up.

- **EOS ids.** An instruct checkpoint may end a turn with several ids: Llama 3's
  ``generation_config.json`` lists 128001, 128008 and 128009; config.json may list more; the
  tokenizer names one; the chat template closes each assistant turn with its own token
  (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``). A request stops at any of them
  (``eos_token_ids``), unless it sets ``ignore_eos``.
- **Sampling defaults.** ``generation_config.json`` may set ``temperature``, ``top_p``,
  ``top_k``, ``min_p`` and ``repetition_penalty``: the values the model's authors tuned it
  for. With ``--generation-config auto`` (the default, as vLLM's) they replace pagedserve's
  own defaults for every request that does not set the field; ``none`` ignores them. The
  EOS ids are read either way: stopping at the model's end of turn is correctness, not a
  preference.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_MODES = ("auto", "none")
# generation_config.json field -> SamplingParams field, for the ones applied as defaults.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# Any marker the chat templates in use pass through as plain text.
_CONTENT_MARKER = "PAGEDSERVE_END_OF_TURN_PROBE"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Defaults for the sampling fields a request leaves unset; None: pagedserve's own
    (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The fields the checkpoint sets, for ``dataclasses.replace(SamplingParams(), ...)``."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


def read_generation_config(path: Path | None) -> dict[str, Any]:
    """``generation_config.json`` of a checkpoint directory, or {} if it has none."""
    if path is None or not (path / "generation_config.json").is_file():
        return {}
    try:
        with open(path / "generation_config.json") as f:
            config = json.load(f)
    except json.JSONDecodeError as exc:
        logger.warning("ignoring %s: not valid JSON (%s)", path / "generation_config.json", exc)
        return {}
    return config if isinstance(config, dict) else {}


def sampling_defaults(generation_config: dict[str, Any], mode: str) -> SamplingDefaults:
    """The checkpoint's sampling defaults under ``--generation-config mode``."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be auto or none, got {mode!r}")
    if mode == "none":
        return SamplingDefaults()
    values: dict[str, Any] = {}
    for source, dest in SAMPLING_FIELDS.items():
        value = generation_config.get(source)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[dest] = int(value) if dest == "top_k" else float(value)
    return SamplingDefaults(**values)


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def end_of_turn_token(tokenizer: Any) -> int | None:
    """The special token the chat template closes an assistant turn with, or None.

    Renders a one-exchange chat whose assistant content is a marker, and reads the token
    right after the marker: when the template closes turns with a special token (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``), that is it."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": _CONTENT_MARKER},
    ]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # a template with its own rules (roles, system prompts): no probe
        return None
    if not isinstance(text, str) or _CONTENT_MARKER not in text:
        return None
    after = text.split(_CONTENT_MARKER, 1)[1]
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    if not ids:
        return None
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(
        getattr(tokenizer, "added_tokens_decoder", {}) or {}
    )
    return ids[0] if ids[0] in special else None


def eos_token_ids(
    hf_config: dict[str, Any], generation_config: dict[str, Any], tokenizer: Any
) -> tuple[int, ...]:
    """Every id a request stops at, first-seen order: config.json's ``eos_token_id`` (an id
    or a list), generation_config.json's, the tokenizer's, and the chat template's end of
    turn (``end_of_turn_token``)."""
    ids = _ids(hf_config.get("eos_token_id")) + _ids(generation_config.get("eos_token_id"))
    if tokenizer is not None:
        ids += _ids(getattr(tokenizer, "eos_token_id", None))
        end = end_of_turn_token(tokenizer)
        if end is not None:
            ids.append(end)
    return tuple(dict.fromkeys(ids))
