"""One simulated vLLM server on one port, and its shutdown, phase by phase as vLLM 0.32 does it.

Abort mode (shutdown timeout 0): close the listener and idle connections, cut every request (queued or
running) per the abort style, wait for the handlers, stop.
Drain mode (timeout N > 0): refuse new completions with vLLM's 500 while /health, /v1/models and /metrics
keep answering; when the last request ended, wait post_drain_close_s, close the listener, stop. If N
expires first: close the listener and leave the remaining streams hanging (or abort them), then stop once
their clients went away (or the hang limit passed).

The listening socket is our own `asyncio.Server` around aiohttp's low-level server, so the listener can
close while connections stay open, exactly the state vLLM is in while it drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from aiohttp import web

from vllm_sim.admin import CONTROLS_KEY, add_routes
from vllm_sim.config import AbortStyle, DrainTimeoutAction, Role, SimConfig
from vllm_sim.engine import Interrupt
from vllm_sim.handlers import STATE_KEY
from vllm_sim.state import ReplicaState

log = logging.getLogger("vllm_sim")

CLIENT_MAX_SIZE = 64 * 1024 * 1024  # request bodies up to 64 MiB (long prompts)
STOP_GRACE_S = 2.0
_T = TypeVar("_T")


class Replica:
    """One replica: `await start()`, then `begin_shutdown()` + `wait_stopped()`, or `await stop()`."""

    def __init__(
        self,
        config: SimConfig,
        port: int = 0,
        kv_events_port: int | None = None,
        role: Role | None = None,
        engine_id: str | None = None,
    ) -> None:
        """`role` and `engine_id` override the config's for this replica (P/D pairs in one process)."""
        self.config = config
        self._requested_port = port
        self._kv_events_port = kv_events_port
        self._role, self._engine_id = role, engine_id
        self.port = 0
        self._state: ReplicaState | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._torn_down = False

    @property
    def state(self) -> ReplicaState:
        if self._state is None:
            raise RuntimeError("replica not started")
        return self._state

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_task is not None or self._stop_task is not None

    async def start(self) -> None:
        sock = socket.create_server((self.config.host, self._requested_port), backlog=1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._state = ReplicaState(
            self.config, self.address, self._kv_events_port, self._role, self._engine_id
        )
        app = web.Application(client_max_size=CLIENT_MAX_SIZE)
        app[STATE_KEY] = self._state
        app[CONTROLS_KEY] = self
        add_routes(app)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=STOP_GRACE_S
        )
        await self._runner.setup()
        assert self._runner.server is not None
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self._runner.server, sock=sock, backlog=1024)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def begin_shutdown(
        self, timeout_s: float | None = None, on_drain_timeout: DrainTimeoutAction | None = None
    ) -> bool:
        """Start the vLLM-like shutdown (SIGTERM); False when one is already under way."""
        if self.shutting_down or self._state is None:
            return False
        timeout = self.config.shutdown.timeout_s if timeout_s is None else timeout_s
        action = on_drain_timeout or self.config.shutdown.on_drain_timeout
        self._shutdown_task = asyncio.get_running_loop().create_task(self._shutdown(timeout, action))
        self._shutdown_task.add_done_callback(self._log_task_end)
        return True

    def request_stop(self) -> None:
        """Stop now, from a handler (the admin API's "force"): runs in a task the replica owns."""
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self.stop())
            self._stop_task.add_done_callback(self._log_task_end)

    async def stop(self) -> None:
        """End now: close the listener, cut every request and its connection, release the port."""
        if self._state is None or self.stopped:
            return
        self._state.draining = True
        self._close_listener()
        self._state.cut_all(Interrupt.FORCE_STOP)
        task = self._shutdown_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # A handler blocked writing to a client that does not read never sees the cut: the runner's
        # cleanup cancels it after this grace.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._state.wait_idle(), STOP_GRACE_S)
        await self._teardown()

    def _log_task_end(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("replica %s: shutdown failed", self.address, exc_info=task.exception())

    async def _shutdown(self, timeout_s: float, on_drain_timeout: DrainTimeoutAction) -> None:
        state = self.state
        state.draining = True
        if timeout_s <= 0:
            log.info("replica %s: shutdown, abort mode (style %s)", self.address, state.abort_style.value)
            self._close_listener()
            state.cut_all(Interrupt.SHUTDOWN_ABORT)
        else:
            log.info(
                "replica %s: draining %d requests, timeout %.1fs", self.address, len(state.active), timeout_s
            )
            try:
                async with asyncio.timeout(timeout_s):
                    await state.wait_idle()
            except TimeoutError:
                log.info(
                    "replica %s: drain timeout, %s %d requests",
                    self.address,
                    on_drain_timeout.value,
                    len(state.active),
                )
                self._close_listener()
                if on_drain_timeout is DrainTimeoutAction.ABORT:
                    state.abort_style = AbortStyle.ABORT
                    state.cut_all(Interrupt.SHUTDOWN_ABORT)
                else:
                    state.cut_all(Interrupt.DRAIN_HANG)
            else:
                # Deliberate delay, not synchronisation: vLLM closes its listener 3-4 s after the drain.
                await asyncio.sleep(self.config.shutdown.post_drain_close_s)
                self._close_listener()
        await state.wait_idle()
        await self._teardown()

    def _close_listener(self) -> None:
        """Refuse new connections and close idle keep-alive ones; busy ones close after their request."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            log.info("replica %s: listener closed", self.address)
        if self._runner is not None and self._runner.server is not None:
            self._runner.server.pre_shutdown()

    async def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self._close_listener()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._state is not None:
            self._state.kv.clear()  # the blocks a decode would pull are gone with the process
            if self._state.engine.publisher is not None:
                self._state.engine.publisher.close()
        self._stopped.set()
        log.info("replica %s: stopped", self.address)


def nth(values: Sequence[_T], index: int) -> _T | None:
    """The value for the replica at `index` of a per-replica option given for the first ones only."""
    return values[index] if index < len(values) else None


@contextlib.asynccontextmanager
async def run_sim(
    config: SimConfig | None = None,
    ports: Sequence[int] = (0,),
    kv_events_ports: Sequence[int] = (),
    roles: Sequence[Role] = (),
) -> AsyncIterator[list[Replica]]:
    """Run one replica per port (0 = any free port) in this event loop; stop them all on exit.
    `kv_events_ports` and `roles` apply in port order; replicas beyond them get none / the config's."""
    replicas = [
        Replica(config or SimConfig(), port, kv_events_port=nth(kv_events_ports, i), role=nth(roles, i))
        for i, port in enumerate(ports)
    ]
    try:
        for replica in replicas:
            await replica.start()
        yield replicas
    finally:
        for replica in replicas:
            await replica.stop()
