"""httpx for the tests and benches, with one TLS context for every client instead of one each.

httpx builds a new SSL context for each client it makes (loading the CA bundle: 47 ms of CPU here,
against 0.2 ms for a client given a context), and `httpx.get` makes a client per call. The suite's
polling loops (a health check every few milliseconds) spent most of the test process's CPU on it,
on the two cores the pickers, Envoy and the simulators under test share. Same calls, same arguments
as httpx's own; a caller's own `verify` wins.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The default verifying context, built once (thread-safe to share: it only wraps sockets)."""
    return ssl.create_default_context()


def _with_context(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("verify", tls_context())
    return kwargs


class Client(httpx.Client):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_with_context(kwargs))


class AsyncClient(httpx.AsyncClient):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_with_context(kwargs))


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, **_with_context(kwargs))


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, **_with_context(kwargs))


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.delete(url, **_with_context(kwargs))


def stream(method: str, url: str, **kwargs: Any) -> Any:
    """`httpx.stream`: a context manager yielding the response."""
    return httpx.stream(method, url, **_with_context(kwargs))
