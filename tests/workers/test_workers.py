"""`picker serve --workers 2` as a pod runs it (picker/lifecycle/workers.py): both workers answer on
the one ext_proc port, an admin drain through either is honoured by both, SIGTERM to the parent
stops every worker through its drain, and a worker that dies takes the pod down non-zero.

The ext_proc client is NGINX Gateway Fabric's shim (loadtest/ngf_client.py): a fresh connection per
request, so the kernel's SO_REUSEPORT hash spreads them over the workers as it would Envoy's many."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.ngf_client import ShimClient
from loadtest.procs import Proc, free_port, wait_until
from loadtest.stack import parse_metrics, picker_ready, serve_argv
from loadtest.traffic import completion_body

E1, E2 = "127.0.0.1:18101", "127.0.0.1:18102"  # never connected to: --no-scrape, and no response phase
BODY = json.dumps(completion_body(8)).encode()
WORKERS = 2


@dataclass
class Pod:
    parent: Proc
    grpc: int
    health: int
    metrics: int  # worker i's: metrics + i

    def worker_pids(self) -> list[int]:
        found = re.search(r"workers started count=\d+ pids=([\d,]+)", self.parent.log_text())
        assert found is not None, self.parent.log_text()[-2000:]
        return [int(pid) for pid in found.group(1).split(",")]

    def picks(self, worker: int) -> float:
        text = http_client.get(f"http://127.0.0.1:{self.metrics + worker}/metrics", timeout=5).text
        return sum(v for (name, _), v in parse_metrics(text).items() if name == "picker_picks_total")

    def state(self, worker: int, address: str) -> str:
        url = f"http://127.0.0.1:{self.metrics + worker}/admin/endpoints/{address}"
        state = http_client.get(url, timeout=5).json()["endpoint"]["state"]
        assert isinstance(state, str)
        return state

    def ask(self) -> str | None:
        return ShimClient(f"127.0.0.1:{self.grpc}", tls=False).ask(BODY).endpoint


def alive(pid: int) -> bool:
    """Still a process (the parent reaps its workers, so an exited one is gone from /proc)."""
    return Path(f"/proc/{pid}").exists()


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    grpc, health, metrics, peers = free_port(), free_port(), free_port(paired=1), free_port(paired=1)
    argv = serve_argv(grpc, health, metrics, "--workers", str(WORKERS), "--endpoints", f"{E1},{E2}")
    argv += ["--secure-serving=false", "--no-scrape", "--peer-port", str(peers), "--quiet-interval", "0.2"]
    argv += ["--propagation", "0.5"]
    parent = Proc("picker", argv, tmp_path / "picker.log")
    pod = Pod(parent, grpc, health, metrics)
    pids: list[int] = []
    try:
        parent.wait_ready(lambda: parent.log_text().count("picker ready") == WORKERS)
        pids = pod.worker_pids()
        wait_until(lambda: picker_ready(health), 15, what="worker 0 ready (linked to its peer)")
        yield pod
    finally:
        if not pids:  # it failed before the fixture read them: from the log, if it got that far
            with contextlib.suppress(Exception):
                pids = pod.worker_pids()
        parent.stop()
        for pid in pids:  # each worker by its PID, should the parent have left one behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_both_workers_serve_picks_on_the_one_port(pod: Pod) -> None:
    answers = [pod.ask() for _ in range(40)]  # 40 connections: all on one worker, p = 2^-39
    assert set(answers) <= {E1, E2} and None not in answers, answers
    assert pod.picks(0) > 0 and pod.picks(1) > 0
    assert pod.picks(0) + pod.picks(1) == len(answers)


def test_a_drain_through_one_workers_admin_api_is_honoured_by_the_other(pod: Pod) -> None:
    reply = http_client.post(f"http://127.0.0.1:{pod.metrics + 1}/admin/endpoints/{E1}/drain", timeout=5)
    assert reply.status_code == 200, reply.text
    wait_until(lambda: pod.state(0, E1) == "draining", 10, what="worker 0 to apply worker 1's drain")
    answers = [pod.ask() for _ in range(30)]
    assert answers == [E2] * len(answers)
    assert pod.picks(0) > 0 and pod.picks(1) > 0  # both answered, after the drain


def test_sigterm_to_the_parent_drains_and_stops_every_worker(pod: Pod) -> None:
    pids = pod.worker_pids()
    pod.parent.signal(signal.SIGTERM)
    assert pod.parent.wait_exit(20) == 0, pod.parent.log_text()[-3000:]
    assert not any(alive(pid) for pid in pids)
    assert pod.parent.log_text().count("picker shutdown done") == WORKERS * 2  # each: log line + summary


def test_a_worker_that_dies_takes_the_pod_down_non_zero(pod: Pod) -> None:
    first, second = pod.worker_pids()
    os.kill(second, signal.SIGKILL)
    assert pod.parent.wait_exit(20) == 1, pod.parent.log_text()[-3000:]
    assert not alive(first)
    assert f"worker exited index=1 pid={second} code=-9" in pod.parent.log_text()


def test_a_worker_stops_when_its_parent_is_gone(pod: Pod) -> None:
    pids = pod.worker_pids()
    pod.parent.kill()  # SIGKILL: nothing forwarded; each worker reads the end of its pipe
    wait_until(lambda: not any(_running(pid) for pid in pids), 20, what="the orphaned workers to exit")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe later)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return status != "Z"
