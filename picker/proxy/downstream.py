"""The client side of one proxied request, as the frontend needs it, whatever the HTTP version.

`ProxyFrontend` (server.py) speaks only to this interface; `Http1Downstream` maps it onto aiohttp's
server (HTTP/1.1), `h2c.H2Stream` onto one HTTP/2 stream. Writes raise `ConnectionError` once the
client is gone; a client that goes away cancels the task serving its request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from aiohttp import web

from picker.contract import Reply


class Downstream(Protocol):
    method: str
    path: str  # without the query
    target: str  # path and query, as sent upstream

    @property
    def content_length(self) -> int | None: ...

    @property
    def started(self) -> bool: ...

    def header(self, name: str) -> str | None: ...

    def header_items(self) -> Iterable[tuple[str, str]]: ...

    async def read(self, size: int) -> bytes:
        """The next piece of the request body; b"" at its end."""
        ...

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None: ...

    async def write(self, chunk: bytes) -> None:
        """Waits while the client cannot take more (back-pressure)."""
        ...

    async def finish(self) -> None: ...

    def abort(self) -> None:
        """End the response as a cut (connection abort or stream reset), never as a clean end."""
        ...

    async def reply(self, reply: Reply) -> None:
        """A complete local answer (the status contract), before anything was started."""
        ...


class Http1Downstream:
    """One HTTP/1.1 request on aiohttp's low-level server; `response` is what the handler returns."""

    __slots__ = ("_request", "method", "path", "response", "target")

    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request
        self.method = request.method
        self.path = request.path
        self.target = request.path_qs
        self.response: web.StreamResponse | None = None

    @property
    def content_length(self) -> int | None:
        return self._request.content_length

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    def header(self, name: str) -> str | None:
        return self._request.headers.get(name)

    def header_items(self) -> Iterable[tuple[str, str]]:
        return self._request.headers.items()

    async def read(self, size: int) -> bytes:
        return await self._request.content.read(size)

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self._request)

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        await self.response.write(chunk)  # drains when the transport's buffer is over its high mark

    async def finish(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def abort(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()

    async def reply(self, reply: Reply) -> None:
        self.response = web.Response(status=reply.status, body=reply.body(), headers=reply.headers())
