"""A small streaming client for tests: POST a completion, record every SSE event with its arrival time.

Generic over any OpenAI-compatible server (the simulator, a real vLLM, the picker in front of them):

    async with http_client.AsyncClient() as client:
        result = await stream_request(client, base_url + "/v1/completions", {"prompt": "hi", "stream": True})
    result.end            # "done" | "eof" | "disconnected" | "timeout" | "error" | "refused"
    result.finish_reason  # of the last chunk carrying one ("length", "stop", "abort", ...)
    result.events[i].at   # seconds since the request was sent

`disconnect_after_events=N` closes the connection after N events (a client abort); `read_timeout`
turns a hanging stream into `end == "timeout"` instead of a stuck test; `first_event` (an asyncio.Event)
tells a concurrent task that the stream is flowing.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

DONE = "[DONE]"


class SseParser:
    """Incremental SSE parser: `feed(bytes)` returns the data of each completed event.

    Lines end at CRLF, LF or CR (never at other Unicode line breaks); a CR at the end of one chunk and an LF
    at the start of the next count as one line end.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[str]:
        events: list[str] = []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        self._buffer += chunk
        start = 0
        buffer = self._buffer
        # Each search resumes after the line just consumed: a feed stays linear in its size.
        lf, cr = buffer.find(b"\n"), buffer.find(b"\r")
        while lf >= 0 or cr >= 0:
            if cr < 0 or (0 <= lf < cr):
                end, nxt = lf, lf + 1
            elif cr + 1 < len(buffer):
                end, nxt = cr, cr + 2 if buffer[cr + 1] == 0x0A else cr + 1
            else:  # CR at the very end: the next chunk may start with its LF
                end, nxt = cr, cr + 1
                self._skip_lf = True
            self._line(bytes(buffer[start:end]).decode("utf-8", errors="replace"), events)
            start = nxt
            if 0 <= lf < start:
                lf = buffer.find(b"\n", start)
            if 0 <= cr < start:
                cr = buffer.find(b"\r", start)
        del buffer[:start]
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


@dataclass(slots=True)
class SseEvent:
    data: str
    at: float  # seconds since the request was sent

    @property
    def json(self) -> Any | None:
        if self.data == DONE:
            return None
        try:
            return json.loads(self.data)
        except json.JSONDecodeError:
            return None


@dataclass
class StreamResult:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[SseEvent] = field(default_factory=list)
    raw: bytearray = field(default_factory=bytearray)  # every body byte received (frames or an error body)
    end: str = "eof"  # done | eof | disconnected | timeout | error | refused
    error: str | None = None  # transport error text when end is "error" / "refused"
    t_headers: float | None = None
    t_end: float = 0.0

    @property
    def done(self) -> bool:
        """Saw `data: [DONE]`. Not the same as completed: check finish_reason too."""
        return any(e.data == DONE for e in self.events)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [payload for e in self.events if isinstance(payload := e.json, dict)]

    @property
    def content_chunks(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if c.get("choices")]

    @property
    def finish_reason(self) -> str | None:
        for chunk in reversed(self.content_chunks):
            reason = chunk["choices"][0].get("finish_reason")
            if reason is not None:
                return str(reason)
        return None

    @property
    def usage(self) -> dict[str, Any] | None:
        for chunk in reversed(self.chunks):
            if chunk.get("usage"):
                return dict(chunk["usage"])
        return None

    @property
    def error_event(self) -> dict[str, Any] | None:
        for chunk in self.chunks:
            if "error" in chunk:
                return dict(chunk["error"])
        return None

    @property
    def text(self) -> str:
        parts: list[str] = []
        for chunk in self.content_chunks:
            choice = chunk["choices"][0]
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)

    @property
    def ttft(self) -> float | None:
        """Arrival of the first event that carries text (chat's role chunk does not)."""
        for event in self.events:
            payload = event.json
            if isinstance(payload, dict) and payload.get("choices"):
                choice = payload["choices"][0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    return event.at
        return None

    def body_json(self) -> Any | None:
        """The body as JSON, for non-streaming answers and error statuses."""
        try:
            return json.loads(self.raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    disconnect_after_events: int | None = None,
    read_timeout: float | None = 30.0,
    connect_timeout: float = 5.0,
    first_event: asyncio.Event | None = None,
) -> StreamResult:
    """POST `body` to `url` and read the response as it arrives; never raises for transport errors.

    `first_event` is set when the first SSE event arrives (or the request ends), so a caller can act while
    the stream is known to be in flight.
    """
    result = StreamResult()
    parser = SseParser()
    timeout = httpx.Timeout(
        connect=connect_timeout, read=read_timeout, write=connect_timeout, pool=connect_timeout
    )
    started = time.monotonic()
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            result.status = response.status_code
            result.headers = dict(response.headers)
            result.t_headers = time.monotonic() - started
            async for chunk in response.aiter_raw():
                now = time.monotonic() - started
                result.raw += chunk
                for data in parser.feed(chunk):
                    result.events.append(SseEvent(data, now))
                if first_event is not None and result.events:
                    first_event.set()
                if disconnect_after_events is not None and len(result.events) >= disconnect_after_events:
                    result.end = "disconnected"
                    break
            else:
                result.end = "done" if result.done else "eof"
    except httpx.ConnectError as exc:
        result.end, result.error = "refused", str(exc)
    except httpx.TimeoutException as exc:
        result.end, result.error = "timeout", str(exc) or type(exc).__name__
    except httpx.TransportError as exc:
        result.end, result.error = "error", str(exc) or type(exc).__name__
    result.t_end = time.monotonic() - started
    if first_event is not None:
        first_event.set()
    return result
