"""A /metrics server that serves one canned page, from a thread (its sending costs the loop nothing).

For pages a hostile or broken model server might send: huge, all gauge lines, one endless line.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MIB = 1024 * 1024


def gauge_flood(size: int) -> bytes:
    """`size` bytes (at most) of valid vLLM gauge lines, all three families, many engines."""
    block = b"".join(
        f'vllm:{name}{{engine="{i}",model_name="m"}} {value}\n'.encode()
        for i in range(64)
        for name, value in (
            ("num_requests_running", 1),
            ("num_requests_waiting", 0),
            ("kv_cache_usage_perc", 0.1),
        )
    )
    page = block * (size // len(block))
    return page + block[: size - len(page)].rpartition(b"\n")[0] + b"\n"


class _Handler(BaseHTTPRequestHandler):
    server: PageServer  # type: ignore[assignment]

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        self.server.requests += 1
        page = self.server.page
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the scraper may hang up once it has seen enough
            self.wfile.write(page)


class PageServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, page: bytes) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.page = page
        self.requests = 0
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@contextlib.contextmanager
def page_server(page: bytes) -> Iterator[PageServer]:
    server = PageServer(page)
    server._thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        server._thread.join(5)
