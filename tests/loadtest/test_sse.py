from __future__ import annotations

import json

from loadtest.sse import SSEEvent, SSEParser

STREAM = (
    b": keep-alive comment\n\n"
    b'data: {"choices": [{"text": "h\xc3\xa9"}]}\n\n'
    b"event: ping\r\ndata: line one\r\ndata:line two\r\n\r\n"
    b"id: 7\rdata: cr-only\r\r"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent(data='{"choices": [{"text": "h\xe9"}]}'),
    SSEEvent(data="line one\nline two", event="ping"),
    SSEEvent(data="cr-only", id="7"),
    SSEEvent(data="[DONE]", id="7"),  # the last event id persists, as in EventSource
]


def test_whole_stream() -> None:
    parser = SSEParser()
    assert parser.feed(STREAM) + parser.close() == EXPECTED


def test_byte_by_byte_matches_whole_stream() -> None:
    # Network reads split anywhere: inside a multi-byte character, between \r and \n.
    parser = SSEParser()
    events: list[SSEEvent] = []
    for i in range(len(STREAM)):
        events += parser.feed(STREAM[i : i + 1])
    assert events + parser.close() == EXPECTED


def test_event_completes_only_at_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n") == []
    assert parser.feed(b"data: b\n") == []
    assert parser.feed(b"\n") == [SSEEvent(data="a\nb")]


def test_crlf_split_across_feeds_is_one_line_end() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []
    # If the lone \r had been taken as a line end, this \n would be a blank line too early.
    assert parser.feed(b"\n") == []
    assert parser.feed(b"\r\n") == [SSEEvent(data="x")]


def test_blank_lines_without_data_dispatch_nothing() -> None:
    parser = SSEParser()
    assert parser.feed(b"\n\n\r\n: c\n\nevent: e\n\n") == []
    assert parser.feed(b"data: y\n\n") == [SSEEvent(data="y")]  # event name was reset


def test_bom_and_unterminated_last_event() -> None:
    parser = SSEParser()
    assert parser.feed(b"\xef\xbb\xbfdata: first\n\ndata: tail") == [SSEEvent(data="first")]
    assert parser.close() == [SSEEvent(data="tail")]


def test_openai_chunks_round_trip() -> None:
    chunks = [{"choices": [{"text": f" t{i}", "finish_reason": None}]} for i in range(3)]
    raw = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    events = SSEParser().feed(raw)
    assert [json.loads(e.data) for e in events[:-1]] == chunks
    assert events[-1].data == "[DONE]"
