"""An incremental Server-Sent Events parser: bytes in, complete events out.

Splits lines only on CRLF, LF or CR (the SSE grammar), never on other Unicode line breaks, and
copes with a CRLF split across two chunks. Pure: `feed()` / `flush()`, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

_CR, _LF = 0x0D, 0x0A


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: bytes  # data lines joined by "\n"
    event: str = ""  # the `event:` field, empty for the default "message"


class SSEParser:
    """Feed chunks as they arrive; each call returns the events those bytes completed."""

    __slots__ = ("_data", "_event", "_has_data", "_line", "_skip_lf")

    def __init__(self) -> None:
        self._line = bytearray()
        self._data = bytearray()
        self._has_data = False
        self._event = ""
        self._skip_lf = False  # the previous chunk ended in CR: a leading LF belongs to it

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        end = len(chunk)
        if (  # the common chunk: exactly one whole `data:` event, nothing pending (the hot path)
            end > 6
            and not self._line
            and not self._has_data
            and not self._skip_lf
            and chunk.startswith(b"data:")
            and chunk.find(b"\n") == end - 2
            and chunk[-1] == _LF
            and b"\r" not in chunk
        ):
            value = chunk[6:-2] if chunk[5] == 0x20 else chunk[5:-2]
            event = SSEEvent(value, self._event)
            self._event = ""
            return [event]
        events: list[SSEEvent] = []
        start = 0
        if not end:
            return events
        if self._skip_lf and chunk[0] == _LF:
            start = 1
        self._skip_lf = False
        while start < end:
            cr = chunk.find(b"\r", start)
            lf = chunk.find(b"\n", start)
            if cr < 0 and lf < 0:
                self._line += chunk[start:]
                break
            stop = lf if cr < 0 or (0 <= lf < cr) else cr
            self._line += chunk[start:stop]
            self._take_line(events)
            start = stop + 1
            if chunk[stop] == _CR:
                if start < end and chunk[start] == _LF:
                    start += 1
                elif start == end:
                    self._skip_lf = True
        return events

    def flush(self) -> list[SSEEvent]:
        """The stream ended: an event without its blank line is incomplete and is dropped (per spec)."""
        self._line.clear()
        self._reset_event()
        return []

    def _take_line(self, events: list[SSEEvent]) -> None:
        line = bytes(self._line)
        self._line.clear()
        if not line:
            if self._has_data:
                events.append(SSEEvent(bytes(self._data), self._event))
            self._reset_event()
            return
        if line[0] == 0x3A:  # ":" comment
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            if self._has_data:
                self._data += b"\n"
            self._data += value
            self._has_data = True
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")

    def _reset_event(self) -> None:
        self._data.clear()
        self._has_data = False
        self._event = ""
