"""Incremental detokenization and stop-string matching, per request (the server owns text).

Two independent pieces, both fed token by token:

* ``IncrementalDetokenizer`` turns token ids into text deltas whose concatenation equals
  ``tokenizer.decode(all_output_ids)``. It uses vLLM's *prefix offset / read offset* window::

      ids:  ... | prefix_offset ........ read_offset ........ len(ids)
                  |<- already emitted ->|<- not yet emitted ->|
      prefix_text = decode(ids[prefix_offset:read_offset])
      full_text   = decode(ids[prefix_offset:])
      delta       = full_text[len(prefix_text):]

  Decoding a small window (instead of each token alone) keeps the context a tokenizer needs
  for leading spaces (SentencePiece's "▁") and costs O(window), not O(text). When
  ``full_text`` ends in U+FFFD the last token stopped inside a multi-byte UTF-8 character:
  nothing is emitted and the offsets stay put until a later token completes it, so the stream
  never contains a replacement character the full text does not.

* ``TokenBytes`` gives a single token's raw bytes (chat logprobs' ``bytes``), also where
  they are part of a character and its text alone is U+FFFD.

* ``StopStringMatcher`` finds stop strings in the text stream, even when one spans several
  tokens or deltas. It holds back only the longest tail of the text that is a *prefix* of some
  stop string (not a fixed ``max(len(stop)) - 1`` characters, which delays ordinary text:
  vLLM#13087), and never returns the stop string itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context of the first output token (vLLM uses 5 as well).
INITIAL_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2, Llama 3, Qwen, SmolLM) printable stand-in for each byte:
    printable Latin-1 bytes stand for themselves, the others for 256 + their rank."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    rest = [b for b in range(256) if b not in kept]
    return {
        **{chr(b): b for b in kept},
        **{chr(256 + rank): b for rank, b in enumerate(rest)},
    }


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenBytes:
    """``token id -> its raw UTF-8 bytes``, which may be part of a character (OpenAI's
    ``bytes`` in chat logprobs: a client joins them to rebuild characters that several
    tokens split). A token's own text where it decodes to whole characters; otherwise its
    bytes from the vocabulary, as byte-level BPE (each character one byte of the alphabet
    above) or a SentencePiece byte token (``<0xE3>``) spells them; where neither applies,
    the text's encoding (U+FFFD's bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)

    def __call__(self, token_id: int, text: str) -> bytes:
        """The bytes of ``token_id``, whose decoded text alone is ``text``."""
        if REPLACEMENT_CHAR in text:
            raw = self._vocabulary_bytes(token_id)
            if raw is not None:
                return raw
        return text.encode("utf-8", errors="replace")

    def _vocabulary_bytes(self, token_id: int) -> bytes | None:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one request.

    Args:
        tokenizer: the engine's tokenizer.
        prompt_token_ids: the prompt; its last few ids give the first output token context.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text, as
            OpenAI-compatible servers do.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A fast tokenizer's Rust backend, called directly: with clean-up off, transformers'
        # decode() returns exactly backend.decode(ids, skip_special_tokens), after Python
        # argument handling that costs more than the decode itself. That ran twice a token on
        # the event loop, which at batch 1 shares the cores with the matmul threads.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)
        # NOTE: invariant ids[:read_offset] has been emitted as text (the prompt context counts
        # as emitted); ids[prefix_offset:read_offset] is the left context of the next decode.
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            text: str = self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
            return text
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that became final (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: return held-back text even if it ends mid-character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # an incomplete UTF-8 sequence: wait for the token that completes it
        if full_text.startswith(prefix_text):
            delta = full_text[len(prefix_text) :]
        else:
            # The context itself ended mid-character (only possible in the prompt's last
            # tokens): its U+FFFD became a real character once the output completed it. Emit
            # from where the two decodes agree; the completed character goes to the output.
            delta = full_text[len(os.path.commonprefix([prefix_text, full_text])) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    ``feed`` returns the text that is safe to emit and whether a stop string was found; after a
    stop, everything from the stop string on is dropped. ``flush`` returns the held-back tail
    once the request ends for another reason (the tail was never a whole stop string).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(dict.fromkeys(stop))  # dedupe, keep order
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._pending = ""  # text received but held back: a possible start of a stop string
        # The head of _pending fed with can_stop False: no stop string may end inside it.
        self._num_frozen = 0
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str, can_stop: bool = True) -> tuple[str, bool]:
        """``can_stop`` False: no stop string may end inside ``text`` (its request has not
        reached ``min_tokens``), now or later; one may still start there and end in text fed
        later, so its tail is held back as usual."""
        if self.stopped:
            return "", True
        if not self._stop:
            return text, False
        buffer = self._pending + text
        frozen = self._num_frozen + (0 if can_stop else len(text))
        # NOTE: no stop string can start inside already-emitted text, because we always hold
        # back the longest tail that is a prefix of one; so searching `buffer` is enough.
        hit = -1
        for s in self._stop:
            # The first occurrence that ends past the frozen head.
            i = buffer.find(s, max(0, frozen - len(s) + 1))
            if i != -1 and (hit == -1 or i < hit):
                hit, self.matched = i, s
        if hit != -1:
            self.stopped = True
            self._pending = ""
            return buffer[:hit], True
        keep = self._held_back_len(buffer)
        self._pending = buffer[len(buffer) - keep :]
        self._num_frozen = max(0, frozen - (len(buffer) - keep))
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _held_back_len(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        for k in range(min(len(buffer), self._max_len - 1), 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
