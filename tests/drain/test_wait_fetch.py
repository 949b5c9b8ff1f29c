"""drain-wait's /metrics reader against misbehaving servers: every failure is a SampleError, on time.

Time bounds: a poll must end within its budget plus a generous 0.5 s for thread scheduling on a
shared 2-core machine (the watchdog closes the socket at the budget).
"""

from __future__ import annotations

import time

import pytest

from loadtest.procs import free_port
from picker.drain.wait import Sample, SampleError, fetch_metrics
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


def test_nothing_listening() -> None:
    result, elapsed = timed_fetch(f"http://127.0.0.1:{free_port()}/metrics", 1.0)
    assert isinstance(result, SampleError)
    assert result.kind == "refused"
    assert elapsed < 1.0
