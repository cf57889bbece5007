"""IncrementalDetokenizer and StopStringMatcher, on a byte-level BPE that splits multi-byte
characters across tokens (as the default model's tokenizer does)."""

from __future__ import annotations

import random

import pytest

from server.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    TokenBytes,
)
from tests.server.server_fakes import tiny_tokenizer

TEXTS = [
    "hello world",
    "héllo wörld, naïve café",
    "日本語のテキスト and English",
    "emoji 🎉🎉 party 👩‍👩‍👧 family",
    "mixed: ünïcödé → arrows ∑ math 𝔘𝔫𝔦",
    " leading space and trailing space ",
]


def stream_deltas(tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_full_decode_without_replacement_chars(text: str) -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(text)
    if not text.isascii():  # the case under test: characters split across byte tokens
        assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in ids)
    deltas = stream_deltas(tok, tok.encode("prompt:"), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_text(text: str) -> None:
    """Each token's raw bytes, joined, are the text's UTF-8, also where a token is part of a
    character (its text alone U+FFFD): what a client rebuilds characters from."""
    tok = tiny_tokenizer()
    token_bytes = TokenBytes(tok)
    ids = tok.encode(text)
    parts = [token_bytes(t, tok.decode([t])) for t in ids]
    assert b"".join(parts) == text.encode()
    assert all(part == tok.decode([t]).encode() for t, part in zip(ids, parts, strict=True)
               if REPLACEMENT_CHAR not in tok.decode([t]))  # fmt: skip


def test_sentencepiece_byte_tokens_give_their_byte() -> None:
    class ByteFallback:  # a SentencePiece vocabulary's byte token, e.g. Llama 2's
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return {7: "<0xE3>", 8: "▁hello"}[token_id]

    token_bytes = TokenBytes(ByteFallback())
    assert token_bytes(7, REPLACEMENT_CHAR) == b"\xe3"
    assert token_bytes(8, "hello") == b"hello"  # whole characters: the text's own


def test_multibyte_character_is_held_until_complete() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("🎉")
    assert len(ids) == 4  # four UTF-8 bytes, four byte tokens
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([t]) for t in ids] == ["", "", "", "🎉"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_chunked_feeding_matches(chunk: int) -> None:
    tok = tiny_tokenizer()
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("context"))
    out = "".join(detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    assert out + detok.flush() == text


def test_flush_emits_an_incomplete_character_at_the_end() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("ab🎉")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.add([t]) for t in ids)
    assert text == "ab"
    assert (text + detok.flush()) == tok.decode(ids)  # the full text has U+FFFD; so do we


def test_prompt_ending_mid_character() -> None:
    """The character completed by the output is attributed to the output, exactly once."""
    tok = tiny_tokenizer()
    ids = tok.encode("x日本")
    split = 2  # "x" + first byte of 日 in the prompt, the rest is output
    deltas = stream_deltas(tok, ids[:split], ids[split:])
    out = "".join(deltas)
    assert out == "日本"
    assert REPLACEMENT_CHAR not in out


def test_special_tokens_are_skipped() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode("hello") + [tok.eos_token_id] + tok.encode(" world")
    assert "".join(stream_deltas(tok, [], ids)) == "hello world"


def test_random_mixtures_roundtrip() -> None:
    tok = tiny_tokenizer()
    rng = random.Random(0)
    alphabet = list("abc xyz") + ["é", "日", "🎉", "∑", "ß"]
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        deltas = stream_deltas(tok, tok.encode(rng.choice(["", "p", "日本"])), ids)
        assert "".join(deltas) == text
        assert all(REPLACEMENT_CHAR not in d for d in deltas)


# ---------------------------------------------------------------------------- stop strings


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        emitted.append(out)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_stop_string_spanning_pieces_is_cut_and_not_returned() -> None:
    emitted, stopped = feed_all(StopStringMatcher(["STOP"]), ["abc S", "T", "OP after"])
    assert stopped
    assert "".join(emitted) == "abc "


def test_hold_back_is_only_a_possible_stop_prefix() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.feed("hello <") == ("hello ", False)  # "<" could start "</end>"
    assert m.feed("b>") == ("<b>", False)  # it did not
    assert m.feed("plain") == ("plain", False)  # nothing held when no prefix matches


def test_earliest_of_several_stop_strings_wins() -> None:
    emitted, stopped = feed_all(StopStringMatcher(["world", "lo w"]), ["hel", "lo world"])
    assert stopped and "".join(emitted) == "hel"


def test_text_that_only_looked_like_a_stop_is_flushed_at_the_end() -> None:
    emitted, stopped = feed_all(StopStringMatcher(["STOP"]), ["the end ST"])
    assert not stopped
    assert "".join(emitted) == "the end ST"


def test_stop_split_into_single_characters() -> None:
    text = "one two ###three"
    emitted, stopped = feed_all(StopStringMatcher(["###"]), list(text))
    assert stopped and "".join(emitted) == "one two "


def test_no_stop_strings_passes_everything() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_no_stop_string_ends_in_text_fed_before_the_minimum() -> None:
    """``can_stop=False`` (min_tokens not reached): a stop string ending in that text never
    counts, also when a longer stop string it starts held it back until later; one that
    starts there and ends in later text does (vLLM's rule)."""

    def run(stop: list[str], feeds: list[tuple[str, bool]]) -> tuple[str, bool]:
        matcher = StopStringMatcher(stop)
        text, stopped = "", False
        for piece, can_stop in feeds:
            emitted, stopped = matcher.feed(piece, can_stop)
            text += emitted
        return (text if stopped else text + matcher.flush()), stopped

    early = [(" Paris", False), (".", False), ("\n\nThe", True)]
    assert run([".", ".XYZ"], early) == (" Paris.\n\nThe", False)
    assert run(["\n", "\n\nX"], [(" Paris.\n", False), ("\nThe", True)]) == (" Paris.\n", True)
    assert run(["ck bro"], [(" the qui", False), ("ck brown", True)]) == (" the qui", True)
    assert run(["ab"], [("xab", False), ("ab", True)]) == ("xab", True)
