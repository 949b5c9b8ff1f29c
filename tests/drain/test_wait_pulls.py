"""drain-wait beside a prefill replica (--pulls-url): vLLM shows no trace of the KV a decode replica has
still to pull from it (the prompt finished there), so the engine looks idle while stopping it would
fail those pulls. The hook also reads the replica's entry on the picker's admin API and waits until
its kv_pulls_pending is 0; when that entry cannot be read, the engine's own figures decide."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from picker.drain.wait import Settings, UsageError, parse_settings, run
from tests.drain.servers import metrics_server


class _Picker(BaseHTTPRequestHandler):
    server: PickerServer  # type: ignore[assignment]

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        pending = self.server.pending.pop(0) if len(self.server.pending) > 1 else self.server.pending[0]
        body = json.dumps({"address": "10.0.0.1:8000", "kv_pulls_pending": pending}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class PickerServer(ThreadingHTTPServer):
    def __init__(self, pending: list[object]) -> None:
        super().__init__(("127.0.0.1", 0), _Picker)
        self.pending = pending
        self.seen: list[tuple[str, str | None]] = []


@contextmanager
def picker_answering(pending: list[object]) -> Iterator[PickerServer]:
    server = PickerServer(pending)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def settings(metrics_url: str, pulls_url: str | None, **more: object) -> Settings:
    return Settings(
        metrics_url=metrics_url,
        quiet_interval_s=0.05,
        propagation_allowance_s=0.2,
        deadline_s=10.0,
        poll_interval_s=0.02,
        request_timeout_s=0.5,
        pulls_url=pulls_url,
        **more,  # type: ignore[arg-type]
    )


def test_an_idle_prefill_engine_waits_until_its_kv_is_pulled(tmp_path: object) -> None:
    with metrics_server("ok") as engine, picker_answering([3, 3, 2, 2, 1, 1, 0]) as picker:
        url = f"http://127.0.0.1:{picker.server_port}/admin/endpoints/10.0.0.1:8000"
        summary = run(settings(engine.url, url))
    assert summary["outcome"] == "idle", summary
    assert summary["last"]["pulls"] == 0, summary
    assert len(picker.seen) >= 7  # it read the picker until the count reached 0


def test_the_admin_token_goes_with_the_read(tmp_path: pytest.TempPathFactory) -> None:
    token = tmp_path / "token"  # type: ignore[operator]
    token.write_text("s3cret\n")
    with metrics_server("ok") as engine, picker_answering([0]) as picker:
        url = f"http://127.0.0.1:{picker.server_port}/admin/endpoints/10.0.0.1:8000"
        run(settings(engine.url, url, admin_token_file=str(token)))
    assert picker.seen[0] == ("/admin/endpoints/10.0.0.1:8000", "Bearer s3cret")


@pytest.mark.parametrize("answer", ["many", -1, True, None])
def test_an_answer_that_is_not_a_count_leaves_the_engine_to_decide(answer: object) -> None:
    with metrics_server("ok") as engine, picker_answering([answer]) as picker:
        url = f"http://127.0.0.1:{picker.server_port}/admin/endpoints/10.0.0.1:8000"
        summary = run(settings(engine.url, url))
    assert summary["outcome"] == "idle" and summary["last"]["pulls"] == 0, summary


def test_no_picker_leaves_the_engine_to_decide() -> None:
    with metrics_server("ok") as engine:
        summary = run(settings(engine.url, "http://127.0.0.1:9/admin/endpoints/10.0.0.1:8000"))
    assert summary["outcome"] == "idle", summary


def test_the_flag_names_an_admin_endpoint_url() -> None:
    parsed = parse_settings(["--pulls-url", "http://picker:9090/admin/endpoints/10.0.0.1:8000"])
    assert parsed.pulls_url == "http://picker:9090/admin/endpoints/10.0.0.1:8000"
    with pytest.raises(UsageError, match="--pulls-url"):
        parse_settings(["--pulls-url", "http://picker:9090/metrics"])
    with pytest.raises(UsageError, match="--pulls-url"):
        parse_settings(["--pulls-url", "file:///admin/endpoints/x"])
