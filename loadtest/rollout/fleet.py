"""The replicas of one rollout run: one process each (so each can get its own SIGTERM), a simulator
or, with `real_vllm`, a real vLLM CPU server started by the project's launcher (loadtest/realvllm).

Every state change is recorded as a timeline event on the run's clock; the pool setups call `mark`.
`sample` records what each replica's own /metrics says it holds (real vLLM names no replica in its
responses, so its lanes are drawn from these samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import httpx

from loadtest import http_client
from loadtest.procs import Proc, free_port
from loadtest.realvllm.launcher import RealVllm, real_vllm
from loadtest.rollout.attribution import engine_requests
from loadtest.rollout.timeline import TimelineEvent, load_event, mark_event, state_event
from loadtest.stack import health_ok

SAMPLE_INTERVAL_S = 0.25
# vLLM's CPU engine pins its threads to the cores this names; read from the environment at launch.
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_LAUNCH_ENV = threading.Lock()  # one launch at a time while the environment names its core
VLLM_START_TIMEOUT_S = 240.0  # the launcher's own deadline (180 s) fails first, with the log tail


class Replica(Protocol):
    """What the setups do to a replica's process: the subset of loadtest.procs.Proc they use."""

    @property
    def pid(self) -> int: ...

    def signal(self, sig: int) -> None: ...
    def wait_exit(self, timeout: float) -> int | None: ...
    def kill(self) -> None: ...
    def stop(self) -> object: ...


class VllmReplica:
    """A real vLLM server held open by the launcher's `real_vllm` context; stop() closes it.

    `start` blocks (a thread runs it) until /health answers; a stop() that comes first wins: the
    server is closed as soon as its start returns, so an aborted run leaves no vLLM behind. `core`
    pins its engine to one core (replica i and its replacement to core i mod 2 on this machine), so
    two replicas compute side by side rather than both on vLLM's default core 0."""

    def __init__(self, port: int, workdir: Path, shutdown_timeout_s: float, core: str | None = None) -> None:
        self.port, self.workdir, self.shutdown_timeout = port, workdir, round(shutdown_timeout_s)
        self.core = core
        self.server: RealVllm | None = None
        self._exit = contextlib.ExitStack()
        self._lock = threading.Lock()
        self._stopped = False

    def _launch(self) -> RealVllm:
        if self.core is None:
            return self._exit.enter_context(real_vllm(self.port, self.workdir, self.shutdown_timeout))
        with _LAUNCH_ENV:  # the launcher reads os.environ; held until this server is healthy
            saved = os.environ.get(OMP_BIND)
            os.environ[OMP_BIND] = self.core
            try:
                return self._exit.enter_context(real_vllm(self.port, self.workdir, self.shutdown_timeout))
            finally:
                if saved is None:
                    os.environ.pop(OMP_BIND, None)
                else:
                    os.environ[OMP_BIND] = saved

    def start(self) -> None:
        server = self._launch()
        with self._lock:
            self.server = server
            stopped = self._stopped
        if stopped:
            self._exit.close()

    @property
    def pid(self) -> int:
        return self.server.pid if self.server else 0

    def signal(self, sig: int) -> None:
        if self.server is not None and self.server.process.poll() is None:
            os.kill(self.server.pid, sig)

    def wait_exit(self, timeout: float) -> int | None:
        return self.server.wait_exit(timeout) if self.server else None

    def kill(self) -> None:
        """SIGKILL the server's process group (API server, engine, workers), as a kubelet would."""
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.server.pid, signal.SIGKILL)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            started = self.server is not None
        if started:
            self._exit.close()  # the launcher's SIGTERM, bounded wait, SIGKILL of the group


class Fleet:
    """Addresses for the first generation and its replacements, their processes, their state history."""

    def __init__(
        self,
        workdir: Path,
        replicas: int,
        sim_args: Sequence[str],
        *,
        real_vllm_shutdown_s: float | None = None,
    ) -> None:
        """`real_vllm_shutdown_s`: run real vLLM servers with this --shutdown-timeout, not simulators."""
        self.workdir = workdir
        self.sim_args = list(sim_args)
        self.real_vllm_shutdown_s = real_vllm_shutdown_s
        self.first = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.replacements = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.procs: dict[str, Replica] = {}
        self.states: dict[str, str] = {}
        self.events: list[TimelineEvent] = []
        self.origin = time.monotonic()

    @property
    def every_address(self) -> list[str]:
        return [*self.first, *self.replacements]

    def now(self) -> float:
        return time.monotonic() - self.origin

    def mark(self, address: str, state: str) -> None:
        self.states[address] = state
        self.events.append(state_event(max(0.0, self.now()), address, state))
        if state == "gone" and self.real_vllm_shutdown_s is not None:  # its line ends with it
            self.events.append(load_event(max(0.0, self.now()), address, 0))

    def restart_clock(self) -> None:
        """Time zero is now (the load starts): the first generation is ready, nothing else happened."""
        self.origin = time.monotonic()
        self.events = [state_event(0.0, a, "ready") for a in self.first]
        self.states.update(dict.fromkeys(self.first, "ready"))

    def moment(self, address: str, label: str) -> None:
        """A tick on the replica's lane: "SIGTERM" or "router told" (timeline.MARK_STYLES)."""
        self.events.append(mark_event(max(0.0, self.now()), address, label))

    def lane_names(self) -> dict[str, str]:
        """ "old 1 (:port)" for the first generation, "new 1 (:port)" for its replacement."""
        names = {}
        for index, (old, new) in enumerate(zip(self.first, self.replacements, strict=True), start=1):
            names[old] = f"old {index}  :{old.rsplit(':', 1)[1]}"
            names[new] = f"new {index}  :{new.rsplit(':', 1)[1]}"
        return names

    def launch(self, address: str) -> Proc:
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "vllm_sim", "--port", port, *self.sim_args]
        proc = Proc(f"sim-{port}", argv, self.workdir / f"sim-{port}.log")
        self.procs[address] = proc
        self.mark(address, "starting")
        return proc

    async def start(self, address: str, timeout_s: float = 30.0) -> None:
        """Launch a replica and return once its /health answers 200 (not yet in any pool)."""
        port = int(address.rsplit(":", 1)[1])
        if self.real_vllm_shutdown_s is not None:
            slot = self.first.index(address) if address in self.first else self.replacements.index(address)
            cores = os.cpu_count() or 1  # the operator's own binding, when set, is left alone
            core = str(slot % cores) if cores > 1 and OMP_BIND not in os.environ else None
            replica = VllmReplica(port, self.workdir / f"vllm-{port}", self.real_vllm_shutdown_s, core)
            self.procs[address] = replica
            self.mark(address, "starting")
            await asyncio.wait_for(asyncio.to_thread(replica.start), VLLM_START_TIMEOUT_S)
            return
        proc = self.launch(address)
        await asyncio.to_thread(proc.wait_ready, lambda: health_ok(port), timeout_s)

    async def sample(self, stop: asyncio.Event, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        """Until `stop`: every `interval_s`, each ready or draining replica's own count of requests."""
        async with http_client.AsyncClient(timeout=1.0) as client:

            async def one(address: str) -> None:
                try:
                    text = (await client.get(f"http://{address}/metrics")).text
                except httpx.HTTPError:
                    return
                value = engine_requests(text)
                if value is not None and self.states.get(address) in ("ready", "draining"):
                    self.events.append(load_event(max(0.0, self.now()), address, value))

            while not stop.is_set():
                live = [a for a, s in self.states.items() if s in ("ready", "draining")]
                await asyncio.gather(*(one(a) for a in live))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)

    async def wait_exit(self, address: str, timeout_s: float) -> int | None:
        """Wait for the replica's process to end (SIGKILL at the deadline, as the kubelet would)."""
        proc = self.procs[address]
        code = await asyncio.to_thread(proc.wait_exit, timeout_s)
        if code is None:
            proc.kill()
        self.mark(address, "gone")
        return code

    def stop_all(self) -> None:
        """Stop every replica, together: a vLLM takes seconds to exit even when idle."""
        procs = list(self.procs.values())
        if procs:
            with ThreadPoolExecutor(max_workers=len(procs)) as pool:
                list(pool.map(lambda p: p.stop(), procs))
