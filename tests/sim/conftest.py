"""Shared fixtures for the simulator's tests: in-process replicas and the simulator as a child process.

Importable helpers live in simkit.py (simulator-only) and parity_checks.py (also valid for real vLLM):
test modules import those, never this file.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from simkit import SimProcess, fast_config
from vllm_sim import Replica, run_sim

from loadtest import http_client


@pytest.fixture
async def sim() -> AsyncIterator[Replica]:
    """One in-process replica with fast timing."""
    async with run_sim(fast_config()) as (replica,):
        yield replica


@pytest.fixture
async def client(sim: Replica) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client.AsyncClient(base_url=sim.url, timeout=10) as http:
        yield http


@pytest.fixture
def sim_process(tmp_path: Path) -> Iterator[Any]:
    """Factory: `proc = sim_process("--port", "0", ...)` starts and waits; every process is stopped."""
    started: list[SimProcess] = []

    def start(*args: str, replicas: int | None = None) -> SimProcess:
        process = SimProcess(list(args), tmp_path)
        started.append(process)
        process.wait_listening(replicas if replicas is not None else args.count("--port"))
        return process

    try:
        yield start
    finally:
        for process in started:
            process.stop()
