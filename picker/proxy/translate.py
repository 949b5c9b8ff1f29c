"""HTTP <-> core for the proxy: which headers cross, contract replies as responses, the drain tail.

Pure functions over header mappings and bytes: no sockets, so both the server and the tests use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from aiohttp import web

from picker.contract import Reply, headers

_DROPPED_UPSTREAM = frozenset(
    {*headers.HOP_BY_HOP, *headers.CLIENT_ROUTING, headers.PICKER_REQUEST_ID, headers.RESUME}
)
_SSE = "text/event-stream"


def upstream_headers(
    incoming: Iterable[tuple[str, str]], request_id: str, replace: Sequence[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones and the picker's hints, plus the request id and
    `replace` (which supersede the client's of the same name: the trace context, with tracing on)."""
    replaced = {name for name, _ in replace}
    out = [
        (name, value)
        for name, value in incoming
        if name.lower() not in _DROPPED_UPSTREAM and name.lower() not in replaced
    ]
    out.append((headers.PICKER_REQUEST_ID, request_id))
    out.extend(replace)
    return out


def downstream_headers(
    upstream: Iterable[tuple[str, str]], served: str, request_id: str
) -> list[tuple[str, str]]:
    """The model server's headers minus hop-by-hop ones, plus who served and the request id."""
    out = [(name, value) for name, value in upstream if name.lower() not in headers.HOP_BY_HOP]
    out.append((headers.DESTINATION_SERVED, served))
    out.append((headers.PICKER_REQUEST_ID, request_id))
    return out


def is_event_stream(response_headers: Mapping[str, str]) -> bool:
    return response_headers.get(headers.CONTENT_TYPE, "").startswith(_SSE)


def reply_response(reply: Reply) -> web.Response:
    """A contract reply as an HTTP response: status, reason header, Retry-After, JSON error body."""
    return web.Response(status=reply.status, body=reply.body(), headers=reply.headers())


def at_event_boundary(tail: bytes) -> bool:
    """Whether bytes written so far end between two SSE events (after a blank line)."""
    return tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")) or not tail


def stream_cut_tail(reply: Reply, boundary: bool) -> bytes:
    """The end of a stream the picker must cut: an OpenAI-shaped error event, then [DONE].

    Written only after the last complete upstream event when possible; otherwise the partial event
    is closed first (its data is incomplete, and the error event after it says why).
    """
    prefix = b"" if boundary else b"\n\n"
    return prefix + b"data: " + reply.body() + b"\n\ndata: [DONE]\n\n"
