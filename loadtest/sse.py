"""Incremental Server-Sent Events parser (the framing OpenAI-compatible servers stream in).

The parser works on raw bytes as they come off the socket, so an event is timestamped when the
bytes that complete it arrive, not when some higher layer gets round to reading a line. It
follows the WHATWG EventSource rules that matter for LLM servers:

- lines end with ``\\n``, ``\\r\\n`` or a lone ``\\r``;
- ``data:`` lines accumulate (joined by ``\\n``) until a blank line dispatches the event;
- one space after the colon is stripped; lines starting with ``:`` are comments (keep-alives);
- a blank line with no data dispatches nothing.

Servers that close the stream without a final blank line (seen in the wild) still get their
last event through :meth:`SSEParser.close`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DONE_SENTINEL = "[DONE]"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event. ``data`` is the joined ``data:`` lines, decoded as UTF-8."""

    data: str
    event: str | None = None
    id: str | None = None


@dataclass(slots=True)
class SSEParser:
    """Feed bytes in, get complete events out. Holds partial lines between feeds."""

    _buffer: bytearray = field(default_factory=bytearray)
    _data_lines: list[str] = field(default_factory=list)
    _event: str | None = None
    _id: str | None = None
    _started: bool = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume ``chunk`` and return the events it completed, in order."""
        self._buffer.extend(chunk)
        if not self._started and len(self._buffer) >= 3:
            # A UTF-8 byte-order mark may precede the first line only.
            if self._buffer[:3] == b"\xef\xbb\xbf":
                del self._buffer[:3]
            self._started = True
        events: list[SSEEvent] = []
        for line in self._take_lines():
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: treat a trailing partial line and pending data as complete."""
        events: list[SSEEvent] = []
        if self._buffer:
            line = bytes(self._buffer).rstrip(b"\r")
            self._buffer.clear()
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _take_lines(self) -> list[bytes]:
        """Split complete lines off the buffer, keeping the unfinished tail."""
        lines: list[bytes] = []
        buf = self._buffer
        start = 0
        i = 0
        n = len(buf)
        while i < n:
            b = buf[i]
            if b == 0x0A:  # \n
                lines.append(bytes(buf[start:i]))
                start = i + 1
            elif b == 0x0D:  # \r, alone or as the first half of \r\n
                if i + 1 == n:
                    # NOTE: a \r at the very end may be followed by \n in the next chunk;
                    # wait for it rather than emitting a spurious blank line.
                    break
                lines.append(bytes(buf[start:i]))
                if buf[i + 1] == 0x0A:
                    i += 1
                start = i + 1
            i += 1
        del buf[:start]
        return lines

    def _process_line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            return self._dispatch()
        # Line boundaries never split a UTF-8 sequence, so decoding per line is safe.
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_lines.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        # "retry" and unknown fields are ignored, as the spec says.
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data_lines:
            self._event = None
            return None
        event = SSEEvent(data="\n".join(self._data_lines), event=self._event, id=self._id)
        self._data_lines.clear()
        self._event = None
        return event
