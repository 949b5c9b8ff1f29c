"""h2c (HTTP/2 over cleartext, prior knowledge) on the proxy's port, beside HTTP/1.1.

The first bytes of a connection choose: the HTTP/2 preface goes to `H2Protocol` (the `h2` state
machine, one task per stream), anything else to aiohttp's HTTP/1.1 handler. Each stream is a
`Downstream` for the same `ProxyFrontend.serve()`; HTTP/2 flow control is the back-pressure (a write
waits for the client's window), RST_STREAM or a lost connection cancels the stream's task as a
disconnect does on HTTP/1.1. No Upgrade: h2c; no TLS (put ALPN h2 in front if needed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes

from picker.contract import Reply

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_CONCURRENT_STREAMS = 256


class ProtocolSniffer(asyncio.Protocol):
    """Reads just enough of a new connection to hand it to the HTTP/1.1 or the HTTP/2 protocol."""

    def __init__(self, http1: Callable[[], asyncio.Protocol], http2: Callable[[], asyncio.Protocol]) -> None:
        self._http1 = http1
        self._http2 = http2
        self._transport: asyncio.Transport | None = None
        self._seen = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._seen += data
        if len(self._seen) < len(PREFACE) and PREFACE.startswith(self._seen):
            return  # could still be the preface
        chosen = self._http2() if self._seen.startswith(PREFACE) else self._http1()
        transport = self._transport
        assert transport is not None
        transport.set_protocol(chosen)
        chosen.connection_made(transport)
        seen, self._seen = self._seen, b""
        chosen.data_received(seen)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


class H2Stream:
    """One HTTP/2 request stream as a `Downstream` (see downstream.py)."""

    def __init__(self, protocol: H2Protocol, stream_id: int, request: list[tuple[str, str]]) -> None:
        self._protocol = protocol
        self.stream_id = stream_id
        pseudo = {name: value for name, value in request if name.startswith(":")}
        self._headers = [(name, value) for name, value in request if not name.startswith(":")]
        self.method = pseudo.get(":method", "GET")
        self.target = pseudo.get(":path", "/")
        self.path = self.target.split("?", 1)[0]
        self._body = bytearray()
        self._body_ended = False
        self._body_ready = asyncio.Event()
        self._window = asyncio.Event()
        self.reset = False
        self._started = False
        self.task: asyncio.Task[None] | None = None

    @property
    def content_length(self) -> int | None:
        value = self.header("content-length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def started(self) -> bool:
        return self._started

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((value for key, value in self._headers if key == name), None)

    def header_items(self) -> Iterable[tuple[str, str]]:
        return self._headers

    def received(self, data: bytes) -> None:
        self._body += data
        self._body_ready.set()

    def body_ended(self) -> None:
        self._body_ended = True
        self._body_ready.set()

    def window_opened(self) -> None:
        self._window.set()

    async def read(self, size: int) -> bytes:
        while not self._body and not self._body_ended:
            self._body_ready.clear()
            await self._body_ready.wait()
        piece = bytes(self._body[:size])
        del self._body[:size]
        return piece

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self._check()
        self._started = True
        fields = [(":status", str(status)), *((name.lower(), value) for name, value in headers)]
        self._protocol.send(lambda conn: conn.send_headers(self.stream_id, fields))
        await self._protocol.drained()

    async def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            self._check()
            conn = self._protocol.conn
            room = min(conn.local_flow_control_window(self.stream_id), conn.max_outbound_frame_size)
            if room <= 0:
                self._window.clear()
                await self._window.wait()  # the client's flow-control window: HTTP/2's back-pressure
                continue
            piece, view = view[:room], view[room:]
            self._protocol.send(lambda conn, piece=piece: conn.send_data(self.stream_id, bytes(piece)))
        await self._protocol.drained()

    async def finish(self) -> None:
        self._check()
        self._protocol.send(lambda conn: conn.end_stream(self.stream_id))
        await self._protocol.drained()

    def abort(self) -> None:
        if not self.reset:
            self.reset = True
            self._protocol.send(lambda conn: conn.reset_stream(self.stream_id, ErrorCodes.INTERNAL_ERROR))

    async def reply(self, reply: Reply) -> None:
        await self.start(reply.status, reply.headers())
        await self.write(reply.body())
        await self.finish()

    def _check(self) -> None:
        if self.reset or self._protocol.closed:
            raise ConnectionResetError("the client reset the stream or closed the connection")


class H2Protocol(asyncio.Protocol):
    """One h2c connection: the h2 state machine, and a task per request stream."""

    def __init__(self, serve: Callable[[H2Stream], Awaitable[None]]) -> None:
        self._serve = serve
        self.conn = H2Connection(
            H2Configuration(client_side=False, header_encoding="utf-8", validate_inbound_headers=True)
        )
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, H2Stream] = {}
        self._writable = asyncio.Event()
        self._writable.set()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.conn.initiate_connection()
        self.conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_CONCURRENT_STREAMS})
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except ProtocolError as exc:
            log.info("h2c protocol error from a client: %s", exc)
            self._flush()
            self.close()
            return
        for event in events:
            self._on_event(event)
        self._flush()

    def _on_event(self, event: object) -> None:
        match event:
            case RequestReceived(stream_id=stream_id, headers=request):
                stream = H2Stream(self, stream_id, list(request or []))
                self._streams[stream_id] = stream
                stream.task = asyncio.get_running_loop().create_task(self._run(stream))
            case DataReceived(stream_id=stream_id, data=data, flow_controlled_length=length):
                stream = self._streams.get(stream_id)
                if stream is not None:
                    stream.received(data or b"")
                self.conn.acknowledge_received_data(length or 0, stream_id)
            case StreamEnded(stream_id=stream_id):
                if (stream := self._streams.get(stream_id)) is not None:
                    stream.body_ended()
            case StreamReset(stream_id=stream_id):
                if (stream := self._streams.pop(stream_id, None)) is not None:
                    stream.reset = True
                    if stream.task is not None:
                        stream.task.cancel()  # the client went away from this request
            case WindowUpdated(stream_id=stream_id):
                targets = self._streams.values() if not stream_id else [self._streams.get(stream_id)]
                for stream in targets:
                    if stream is not None:
                        stream.window_opened()
            case ConnectionTerminated():
                self.close()
            case _:
                pass

    async def _run(self, stream: H2Stream) -> None:
        try:
            await self._serve(stream)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("h2c stream %d failed", stream.stream_id)
            stream.abort()
        finally:
            self._streams.pop(stream.stream_id, None)
            self._flush()

    def send(self, action: Callable[[H2Connection], object]) -> None:
        """Apply one h2 action and write what it produced (a closed stream is skipped)."""
        if self.closed:
            return
        try:
            action(self.conn)
        except ProtocolError as exc:  # the stream closed under us (a reset crossed our write)
            log.debug("h2c send skipped: %s", exc)
            return
        self._flush()

    async def drained(self) -> None:
        """Wait while the socket's write buffer is over its high mark."""
        await self._writable.wait()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def close(self) -> None:
        """Close the connection (its streams' tasks are cancelled as the connection goes)."""
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()
        for stream in list(self._streams.values()):
            stream.reset = True
            stream.window_opened()
            if stream.task is not None:
                stream.task.cancel()
        self._streams.clear()
