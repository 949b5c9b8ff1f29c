"""drain-wait as the kubelet runs it: a child process beside a (simulated) vLLM engine.

Each drain-wait process is stopped by its PID in a finally. Time bounds are behavioural: "returns
within 1 s of the engine reaching idle" is measured from the client seeing its last stream end; a
process run is allowed 2.0 s more than its own deadline for interpreter start-up and exit on a
shared 2-core machine (the deadline itself is checked from the hook's own summary, to 0.5 s); the
exact timing logic is covered on a fake clock in test_wait_machine.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import picker.drain.wait as drain_wait
from loadtest import http_client
from loadtest.procs import Proc, free_port, wait_until
from loadtest.stack import health_ok, sim_argv
from loadtest.traffic import completion_body
from tests.drain.servers import metrics_server

START_AND_EXIT_S = 2.0  # interpreter start-up + exit, beyond the hook's own deadline
ITL_MS = 20
FAST = ["--quiet-interval", "0.2", "--poll-interval", "0.05", "--request-timeout", "0.3"]


@pytest.fixture(scope="module")
def sim_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    argv = sim_argv([port], ["--ttft-ms", "20", "--itl-ms", str(ITL_MS)])
    proc = Proc("sim", argv, tmp_path_factory.mktemp("sim") / "sim.log")
    try:
        proc.wait_ready(lambda: health_ok(port))
        yield port
    finally:
        proc.stop()


def running(port: int) -> int:
    return int(http_client.get(f"http://127.0.0.1:{port}/sim/state", timeout=2).json()["running"])


class Streams:
    """Streaming completions in threads; records when each one ended (client side)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.first_chunks = 0  # streams that got their first chunk (the engine counted their prefill)
        self.ended: list[float] = []
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, count: int, tokens: int) -> Streams:
        for _ in range(count):
            thread = threading.Thread(target=self._one, args=(tokens,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _one(self, tokens: int) -> None:
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        try:
            with http_client.stream("POST", url, json=completion_body(tokens), timeout=30) as response:
                for index, _ in enumerate(response.iter_bytes()):
                    if index == 0:
                        self.first_chunks += 1
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))
        self.ended.append(time.monotonic())

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "streams did not finish"


def start_wait(tmp_path: Path, url: str, *flags: str, argv: list[str] | None = None) -> Proc:
    base = argv or [sys.executable, "-m", "picker", "drain-wait"]
    return Proc("drain-wait", [*base, "--metrics-url", url, *flags], tmp_path / "drain-wait.log")


def exit_time(proc: Proc, timeout: float) -> float:
    wait_until(lambda: not proc.alive(), timeout, interval=0.01, what="drain-wait to exit")
    return time.monotonic()


def summary_of(proc: Proc) -> dict[str, Any]:
    lines = [line for line in proc.log_text().splitlines() if line.startswith("{")]
    assert lines, proc.log_text()
    return json.loads(lines[-1])


def test_returns_within_a_second_of_the_engine_going_idle(sim_port: int, tmp_path: Path) -> None:
    streams = Streams(sim_port).start(count=3, tokens=60)  # ~1.2 s each
    wait_until(lambda: streams.first_chunks == 3, 5, what="3 streams generating")
    proc = start_wait(tmp_path, f"http://127.0.0.1:{sim_port}/metrics", *FAST, "--deadline", "20")
    try:
        streams.join(15)
        idle_at = max(streams.ended)
        exited_at = exit_time(proc, 30)
        assert proc.popen.returncode == 0
        summary = summary_of(proc)
    finally:
        proc.stop()
    assert not streams.errors
    assert summary["outcome"] == "idle", summary
    assert summary["propagation"]["ended_by"] == "quiet", summary
    assert summary["arrivals_seen"] == 0, summary
    assert exited_at - idle_at < 1.0, (exited_at - idle_at, summary)


def test_new_arrivals_hold_the_propagation_phase_until_the_allowance(sim_port: int, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{sim_port}/v1/completions"
    proc = start_wait(
        tmp_path,
        f"http://127.0.0.1:{sim_port}/metrics",
        *FAST,
        "--propagation-allowance",
        "1.5",
        "--deadline",
        "10",
    )
    try:
        # Requests back to back (~120 ms each): one arrives in every quiet interval, until the
        # allowance is over (then the engine goes idle). Bounded in count and time.
        stop_at = time.monotonic() + 2.0
        with http_client.Client(timeout=10) as client:
            for _ in range(100):
                if not proc.alive() or time.monotonic() > stop_at:
                    break
                client.post(url, json=completion_body(5, stream=False))
        exit_time(proc, 30)
        summary = summary_of(proc)
    finally:
        proc.stop()
    assert summary["propagation"]["ended_by"] == "allowance", summary
    assert summary["arrivals_seen"] >= 3, summary
    assert summary["outcome"] == "idle", summary


def test_never_later_than_its_deadline(sim_port: int, tmp_path: Path) -> None:
    streams = Streams(sim_port).start(count=1, tokens=120)  # ~2.4 s, longer than the deadline
    wait_until(lambda: running(sim_port) >= 1, 5, what="the stream to run")
    started = time.monotonic()
    proc = start_wait(tmp_path, f"http://127.0.0.1:{sim_port}/metrics", *FAST, "--deadline", "1.5")
    try:
        exited_at = exit_time(proc, 1.5 + START_AND_EXIT_S + 2)
        assert proc.popen.returncode == 0
        summary = summary_of(proc)
    finally:
        proc.stop()
        streams.join(15)
    assert summary["outcome"] == "deadline", summary
    assert summary["total_s"] <= 1.5 + 0.5
    assert exited_at - started <= 1.5 + START_AND_EXIT_S


@pytest.mark.parametrize(
    ("mode", "outcome"), [("hang", "deadline"), ("garbage", "unobservable"), ("html", "unobservable")]
)
def test_exits_zero_when_metrics_are_slow_or_garbage(tmp_path: Path, mode: str, outcome: str) -> None:
    with metrics_server(mode) as server:
        started = time.monotonic()
        proc = start_wait(tmp_path, server.url, *FAST, "--propagation-allowance", "0.5", "--deadline", "2")
        try:
            exited_at = exit_time(proc, 2 + START_AND_EXIT_S + 2)
            assert proc.popen.returncode == 0
            summary = summary_of(proc)
        finally:
            proc.stop()
    assert summary["outcome"] == outcome, summary
    assert summary["samples"] == 0
    assert exited_at - started <= 2 + START_AND_EXIT_S
    assert server.requests >= 1


def test_exits_zero_when_the_engine_is_down(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = start_wait(
        tmp_path, f"http://127.0.0.1:{free_port()}/metrics", *FAST, "--propagation-allowance", "0.5"
    )
    try:
        exited_at = exit_time(proc, 0.9 + START_AND_EXIT_S + 2)
        assert proc.popen.returncode == 0
        summary = summary_of(proc)
    finally:
        proc.stop()
    assert summary["outcome"] == "unobservable"
    assert summary["errors"].get("refused", 0) >= 1
    assert exited_at - started <= 0.5 + 0.4 + START_AND_EXIT_S  # allowance + 2 quiet intervals


def test_sigterm_ends_it_with_exit_zero_and_a_summary(tmp_path: Path) -> None:
    with metrics_server("hang") as server:
        proc = start_wait(tmp_path, server.url, *FAST, "--deadline", "30")
        try:
            wait_until(lambda: server.requests >= 1, 10, what="the first poll")
            proc.stop()
            assert proc.popen.returncode == 0
            summary = summary_of(proc)
        finally:
            proc.stop()
    assert summary["outcome"] == "interrupted"


def test_runs_as_a_lone_file_without_site_packages(tmp_path: Path, sim_port: int) -> None:
    alone = tmp_path / "image" / "wait.py"
    alone.parent.mkdir()
    shutil.copy(drain_wait.__file__, alone)
    log = tmp_path / "summary.log"
    # -I -S: no site-packages, no script directory on the path: the standard library only.
    argv = [sys.executable, "-I", "-S", str(alone)]
    proc = start_wait(
        tmp_path, f"http://127.0.0.1:{sim_port}/metrics", *FAST, "--log-file", str(log), argv=argv
    )
    try:
        exit_time(proc, 30)
        assert proc.popen.returncode == 0
    finally:
        proc.stop()
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["outcome"] == "idle", proc.log_text()


def test_picker_cli_exits_zero_on_bad_flags(tmp_path: Path) -> None:
    proc = Proc(
        "drain-wait", [sys.executable, "-m", "picker", "drain-wait", "--deadline", "soon"], tmp_path / "w.log"
    )
    try:
        exit_time(proc, 30)
        assert proc.popen.returncode == 0
        assert summary_of(proc)["outcome"] == "bad-arguments"
    finally:
        proc.stop()
