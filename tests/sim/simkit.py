"""Helpers for the simulator's tests (simulator-only; checks valid for real vLLM are in parity_checks.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_sim import LatencyConfig, SimConfig
from vllm_sim.prefix import next_token, token_text

from loadtest import http_client

# Fast timing so streams of tens of tokens take tens of milliseconds.
FAST_LATENCY = LatencyConfig(ttft_ms=5.0, itl_ms=5.0)


def fast_config(**changes: Any) -> SimConfig:
    """SimConfig with fast timing; keyword arguments replace whole fields (latency=..., capacity=...)."""
    return dataclasses.replace(SimConfig(latency=FAST_LATENCY), **changes)


def sse_frames(text: str) -> list[dict[str, Any]]:
    """The JSON events of an SSE body (not [DONE])."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def greedy_tokens(prompt_ids: list[int], count: int) -> list[int]:
    """The simulator's tokens after `prompt_ids` when nothing masks one (prefix.next_token)."""
    context = list(prompt_ids)
    for _ in range(count):
        context.append(next_token(context))
    return context[len(prompt_ids) :]


def texts(tokens: list[int]) -> str:
    """The text of generated tokens: " t<id>" each (prefix.token_text)."""
    return "".join(token_text(t) for t in tokens)


async def sim_requests(base_url: str, request_id: str | None = None) -> list[dict[str, Any]]:
    async with http_client.AsyncClient(base_url=base_url, timeout=10) as http:
        params = {"request_id": request_id} if request_id else None
        response = await http.get("/sim/requests", params=params)
    assert response.status_code == 200
    return list(response.json())


class SimProcess:
    """`python -m vllm_sim` as a child process, stopped by its PID (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.stderr_path = log_dir / f"sim-{time.monotonic_ns()}.err"
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_sim", *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=Path(__file__).resolve().parents[2],
        )
        self.addresses: list[str] = []
        self._stdout = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def urls(self) -> list[str]:
        return [f"http://{address}" for address in self.addresses]

    def wait_listening(self, replicas: int, timeout: float = 20.0) -> None:
        """Read stdout until one `sim listening HOST:PORT` line per replica."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while len(self.addresses) < replicas:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"simulator not listening: {self.stderr_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if not ready:
                continue
            data = os.read(self.proc.stdout.fileno(), 4096)
            self._stdout += data
            lines = self._stdout.decode().splitlines()
            self.addresses = [line.split()[-1] for line in lines if line.startswith("sim listening ")]

    def sigterm(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stdout_rest(self) -> str:
        """Everything printed so far (call after exit)."""
        assert self.proc.stdout is not None
        rest = self.proc.stdout.read() if self.exited() else b""
        self._stdout += rest or b""
        return self._stdout.decode()

    def stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
