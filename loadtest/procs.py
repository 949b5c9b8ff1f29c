"""Child processes for tests, the demo and benchmarks: started with a log file, stopped by PID.

Readiness is always a condition polled against a deadline (a port answering, a line in the log),
never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_ISSUED: dict[int, None] = {}  # ports handed out by this process, oldest first
_ISSUED_KEPT = 2000


def _worker_slice(start: int, end: int) -> tuple[int, int]:
    """This pytest-xdist worker's part of [start, end) (all of it outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    except (KeyError, ValueError):
        return start, end
    size = (end - start) // max(1, count)
    return start + index * size, start + (index + 1) * size


def free_port(paired: int = 0) -> int:
    """A free port on 127.0.0.1 for a child to bind, chosen below the kernel's ephemeral range.

    A port from bind(0) comes from the ephemeral range, which outgoing connections also draw on:
    between our close and the child's bind, any connect() on the machine may take it. Below that
    range only another explicit bind can, and a random pick makes that unlikely. A port this
    process already handed out is never handed out again soon: a stack takes several ports before
    its children bind any of them, and two of those must not be the same. Under pytest-xdist each
    worker draws from its own slice of the range, so two workers never hand out the same port.
    `paired`: the child also binds the port this far above (vLLM's KV events at the port + an
    offset): that one is free, in the same slice and handed out, too.
    """
    low, _ = _ephemeral_range()
    start, end = _worker_slice(max(1024, low - 20000), low)
    for _ in range(200):
        port = random.randrange(start, end - paired)
        ports = (port, port + paired) if paired else (port,)
        if any(p in _ISSUED for p in ports) or not all(_bindable(p) for p in ports):
            continue
        for p in ports:
            _ISSUED[p] = None
        while len(_ISSUED) > _ISSUED_KEPT:
            del _ISSUED[next(iter(_ISSUED))]
        return port
    raise RuntimeError(f"no free port found in {start}-{end}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(
    predicate: Callable[[], bool], timeout: float, interval: float = 0.02, what: str = "condition"
) -> None:
    """Poll `predicate` until it holds; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
        return True
    return False


class Proc:
    """A child process with its output in a log file. `stop()` is SIGTERM, then SIGKILL, by PID."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()[-3000:]}"
                )
            return predicate()

        wait_until(ready, timeout, what=f"{self.name} to be ready")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole process group; returns the exit code."""
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            if self.wait_exit(timeout) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL by PID, as a crash would."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(5)


async def async_wait_until(
    predicate: Callable[[], bool],
    timeout: float,  # noqa: ASYNC109 (a deadline for the condition, not for the caller)
    interval: float = 0.005,
    what: str = "condition",
) -> None:
    """`wait_until` for code running on the event loop (the predicate must not block)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if predicate():
            return
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        await asyncio.sleep(interval)
