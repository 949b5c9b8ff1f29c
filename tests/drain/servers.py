"""Misbehaving /metrics servers for drain-wait tests: a stdlib HTTP server on 127.0.0.1, port 0.

Each mode answers GET /metrics one way: a valid vLLM page, garbage bytes, HTML, NaN values, a page
over drain-wait's byte cap, HTTP 500, or no answer at all ("hang": the handler waits on an event
that `stop()` sets, so nothing outlives the test).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from picker.drain.wait import MAX_METRICS_BYTES

HANG_LIMIT_S = 30.0  # a hanging handler gives up after this even if stop() is never called


def vllm_page(running: float = 0, waiting: float = 0, prompt_tokens: float = 0) -> bytes:
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt_tokens}\n'
    ).encode()


_BODIES = {
    "ok": vllm_page(),
    "garbage": bytes(range(256)) * 64,
    "html": b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>",
    "nan": b'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting{engine="0"} 0\n',
}


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer  # type: ignore[assignment]

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        mode = self.server.mode
        self.server.requests += 1
        if mode == "hang":
            self.server.release.wait(HANG_LIMIT_S)
            return
        if mode == "status500":
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "huge":
            self._send_huge()
            return
        if mode == "trickle":
            self._send_trickle()
            return
        body = _BODIES[mode]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_trickle(self) -> None:
        """A valid page, one byte every 50 ms (a slowloris): never complete within a short budget."""
        body = vllm_page()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            for index in range(len(body)):
                if self.server.release.wait(0.05):
                    return
                self.wfile.write(body[index : index + 1])
                self.wfile.flush()

    def _send_huge(self) -> None:
        """A valid-looking page, streamed without a length, 4x past the cap (bounded)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        line = b'vllm:num_requests_running{engine="0"} 0\n' * 1024
        with contextlib.suppress(OSError):
            for _ in range(4 * MAX_METRICS_BYTES // len(line) + 1):
                self.wfile.write(line)


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.requests = 0
        self.release = threading.Event()
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.02}, name=f"metrics-{mode}", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()
        self._thread.join(5)


@contextlib.contextmanager
def metrics_server(mode: str) -> Iterator[MetricsServer]:
    server = MetricsServer(mode).start()
    try:
        yield server
    finally:
        server.stop()
