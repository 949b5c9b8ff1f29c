"""drain-wait's /metrics reader against misbehaving servers: every failure is a SampleError, on time.

Time bounds: a poll must end within its budget plus a generous 0.5 s for thread scheduling on a
shared 2-core machine (the watchdog closes the socket at the budget).
"""

from __future__ import annotations

import time

import pytest

from loadtest.procs import free_port
from picker.drain.wait import Sample, SampleError, fetch_metrics, parse_response
from tests.drain.servers import metrics_server

SCHEDULING_SLACK_S = 0.5


def timed_fetch(url: str, budget: float) -> tuple[Sample | SampleError, float]:
    started = time.monotonic()
    result = fetch_metrics(url, budget)
    return result, time.monotonic() - started


def test_valid_page() -> None:
    with metrics_server("ok") as server:
        result, _ = timed_fetch(server.url, 1.0)
    assert result == Sample(running=0, waiting=0, finished=None, admitted=0)


@pytest.mark.parametrize(
    ("mode", "kind"),
    [("garbage", "malformed"), ("html", "malformed"), ("nan", "malformed"), ("status500", "http-status")],
)
def test_bad_pages(mode: str, kind: str) -> None:
    with metrics_server(mode) as server:
        result, elapsed = timed_fetch(server.url, 1.0)
    assert isinstance(result, SampleError)
    assert result.kind == kind
    assert elapsed < 1.0 + SCHEDULING_SLACK_S


def test_huge_page_is_capped() -> None:
    with metrics_server("huge") as server:
        result, _ = timed_fetch(server.url, 5.0)
    assert isinstance(result, SampleError)
    assert result.kind == "too-large"


def test_hanging_server_times_out_within_the_budget() -> None:
    with metrics_server("hang") as server:
        result, elapsed = timed_fetch(server.url, 0.3)
    assert isinstance(result, SampleError)
    assert result.kind == "timeout"
    assert 0.25 <= elapsed < 0.3 + SCHEDULING_SLACK_S


def test_trickling_server_is_cut_at_the_budget() -> None:
    with metrics_server("trickle") as server:
        result, elapsed = timed_fetch(server.url, 0.4)
    assert isinstance(result, SampleError)
    assert result.kind == "timeout"
    assert 0.35 <= elapsed < 0.4 + SCHEDULING_SLACK_S


PAGE = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(PAGE) + PAGE, Sample(1, 2)),
        (b"HTTP/1.0 200 OK\r\n\r\n" + PAGE, Sample(1, 2)),  # delimited by the connection closing
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % 20
            + PAGE[:20]
            + b"\r\n"
            + b"%x;ext=1\r\n" % (len(PAGE) - 20)
            + PAGE[20:]
            + b"\r\n0\r\n\r\n",
            Sample(1, 2),
        ),
    ],
)
def test_parse_response(raw: bytes, expected: Sample) -> None:
    assert parse_response(raw) == expected


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n" + PAGE, "malformed"),  # cut short
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nvllm", "malformed"),
        (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", "http-status"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "malformed"),
        (b"", "malformed"),
    ],
)
def test_parse_response_rejects(raw: bytes, kind: str) -> None:
    result = parse_response(raw)
    assert isinstance(result, SampleError)
    assert result.kind == kind


def test_nothing_listening() -> None:
    result, elapsed = timed_fetch(f"http://127.0.0.1:{free_port()}/metrics", 1.0)
    assert isinstance(result, SampleError)
    assert result.kind == "refused"
    assert elapsed < 1.0
