"""The test harness's port allocation (loadtest/procs.py): two pytest-xdist workers never hand out
the same port, and a replica's paired port (its KV events) is allocated with it."""

from __future__ import annotations

import pytest

from loadtest import procs


def test_each_xdist_worker_draws_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert procs._worker_slice(10_000, 20_000) in ((10_000, 20_000), (10_000, 15_000), (15_000, 20_000))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    low, _ = procs._ephemeral_range()
    bounds = (max(1024, low - 20000), low)
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        start, end = procs._worker_slice(*bounds)
        slices.append((start, end))
        assert all(start <= procs.free_port() < end for _ in range(20))
    assert slices[0][0] == bounds[0] and slices[0][1] == slices[1][0] and slices[1][1] <= bounds[1]
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert procs._worker_slice(10_000, 20_000) == (10_000, 20_000)  # outside xdist: all of it


def test_a_paired_port_is_free_below_the_ephemeral_range_and_handed_out_too() -> None:
    low, _ = procs._ephemeral_range()
    for _ in range(20):
        port = procs.free_port(paired=1000)
        assert port + 1000 < low  # outgoing connections cannot take it between now and the bind
        assert port in procs._ISSUED and port + 1000 in procs._ISSUED  # never handed out again soon
