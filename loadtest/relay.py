"""A TCP relay on loopback that a test controls: what a network partition between two processes is.

Each connection to the relay's port is forwarded to the target port, bytes both ways. `cut()` resets
every open connection and stops listening, so new ones are refused (a partition: the peer's backoff
runs as it would against a dead host); `restore()` listens again. It runs in a thread of its own with
its own event loop, so the synchronous stack helpers and async tests can both drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from loadtest.procs import free_port

_CHUNK = 64 * 1024
_IDS = b'"token_ids":['


class Tripwire:
    """A cut armed on several relays at once: the first relay through which the target has sent
    `tokens` generated tokens (counted from vLLM's `"token_ids":[...]` lists, whole SSE events only)
    cuts itself after passing them on (resets its connections, refuses new ones); the others stop
    counting. `fired` names the relay that did, `seen` how many tokens had passed when it did."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.fired: Relay | None = None
        self.seen = 0
        self._carry = b""  # the start of an event not yet complete
        self._lock = threading.Lock()

    def count(self, relay: Relay, chunk: bytes) -> bool:
        """Whether `relay` must cut now, after passing `chunk` on."""
        with self._lock:
            if self.fired is not None:
                return False
            *events, self._carry = (self._carry + chunk).split(b"\n\n")
            for event in events:
                at = event.find(_IDS)
                if at >= 0:
                    ids = event[at + len(_IDS) : event.find(b"]", at)]
                    self.seen += ids.count(b",") + 1 if ids.strip() else 0
            if self.seen >= self.tokens:
                self.fired = relay
                return True
            return False


class Relay:
    """127.0.0.1:`port` -> 127.0.0.1:`target`, until cut."""

    def __init__(self, target: int, port: int | None = None) -> None:
        self.target = target
        self.port = port or free_port()
        self.connections = 0  # accepted since start, for a test to see that traffic went through
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{self.port}", daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.tripwire: Tripwire | None = None  # armed: cut after so many events from the target

    def start(self) -> Relay:
        self._thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> None:
        """Reset every connection through the relay and refuse new ones."""
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._listen())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._cut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def _call(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self._loop).result(5)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._open):
            writer.transport.abort()  # a reset, as a partition's timeout would end it
        self._open.clear()
        if server is not None:
            await server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._open |= pair
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer, self._passed))
        finally:
            for end in pair:
                self._open.discard(end)
                end.transport.abort()

    def _passed(self, chunk: bytes) -> None:
        """`chunk` went from the target to the client: the armed tripwire may cut here."""
        tripwire = self.tripwire
        if tripwire is not None and tripwire.count(self, chunk):
            self._loop.create_task(self._cut())


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, passed: Callable[[bytes], None] | None = None
) -> None:
    """Bytes from `reader` to `writer` until either side ends; then both ends are reset."""
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
            if passed is not None:
                passed(chunk)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()
