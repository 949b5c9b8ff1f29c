"""The pool status writer's loop against an in-memory API (the condition and events as the API server
would keep them): a new writer writes within ~1 s of a handover, whatever the resync; a change that
arrives while a look awaits the API server gets its own look; the endpoint source's problem wakes the
writer; a shutdown with a successor leaves the condition to it; a write raced by a controller is
retried at once, and `stopping()` waits for a look in progress rather than racing it; an Event
names the pool's uid and keeps within the API server's limits; the wiring says who may succeed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest

from loadtest.procs import async_wait_until
from picker.pool import Pool
from picker.pool.endpoint import EndpointState
from picker.sources.pool_status import PoolStatusWriter
from picker.sources.pool_status.api import StatusConflict

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class MemoryStatusApi:
    """The InferencePool's status.parents and the namespace's events, as the API server keeps them:
    a write under a stale resourceVersion is a 409. `gate`: when set, a read waits for it to open
    (the test holds a look in the middle of its I/O). `race`: writes a controller makes between this
    picker's read and its write (each one a 409 for the picker's write)."""

    namespace = "default"

    def __init__(self) -> None:
        self.parents: list[Mapping[str, Any]] = []
        self.version = 1
        self.writes: list[list[Mapping[str, Any]]] = []
        self.events: list[Mapping[str, Any]] = []
        self.reads = 0
        self.gate: asyncio.Event | None = None
        self.reading = asyncio.Event()
        self.race = 0

    async def may(self, verb: str, resource: str, group: str, subresource: str = "") -> tuple[bool, str]:
        return True, ""

    async def read(self, name: str) -> tuple[list[Mapping[str, Any]], str, str, int, Mapping[str, Any]]:
        self.reads += 1
        self.reading.set()
        if self.gate is not None:
            await self.gate.wait()
        return list(self.parents), str(self.version), "uid-vllm", 1, {}

    async def write(self, name: str, parents: list[Mapping[str, Any]], version: str) -> str:
        if self.race > 0:
            self.race -= 1
            self.version += 1  # a gateway controller wrote meanwhile
        if version != str(self.version):
            raise StatusConflict("patch inferencepool vllm/status: HTTP 409 (written meanwhile)")
        self.version += 1
        self.parents = list(parents)
        self.writes.append(list(parents))
        return str(self.version)

    async def record(self, event: Mapping[str, Any]) -> None:
        self.events.append(event)

    async def aclose(self) -> None:
        pass

    def shown(self) -> tuple[str, str] | None:
        if not self.parents:
            return None
        condition = self.parents[-1]["conditions"][0]
        return condition["status"], condition["reason"]

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]


@pytest.fixture
def pool() -> Pool:
    pool = Pool()
    pool.apply(ready=[A, B])
    return pool


@pytest.fixture
async def running() -> AsyncIterator[Callable[[PoolStatusWriter], None]]:
    tasks: list[asyncio.Task[None]] = []

    def start(writer: PoolStatusWriter) -> None:
        tasks.append(asyncio.create_task(writer.run()))

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def writer_of(api: MemoryStatusApi, pool: Pool, **options: Any) -> PoolStatusWriter:
    return PoolStatusWriter(api, pool, "vllm", identity="picker-a", debounce_s=0.05, resync_s=30.0, **options)


async def test_a_new_writer_writes_within_about_a_second_of_the_handover(
    pool: Pool, running: Callable[[PoolStatusWriter], None]
) -> None:
    api, leading = MemoryStatusApi(), False
    writer = writer_of(api, pool, writing=lambda: leading)
    running(writer)  # at start it stands by: in HA mode another picker holds the Lease
    await async_wait_until(lambda: writer.skipped["standby"] >= 1, 2.0, what="standing by")
    assert api.writes == [] and api.events == []
    leading, took_over = True, time.monotonic()  # the Lease is taken over; nothing changes in the pool
    await async_wait_until(lambda: api.shown() == ("True", "Ready"), 2.0, what="the new writer's write")
    print(f"handover to first write: {time.monotonic() - took_over:.3f} s")
    assert api.reasons() == ["PoolReady"]


async def test_a_change_while_a_look_awaits_the_api_server_gets_its_own_look(
    pool: Pool, running: Callable[[PoolStatusWriter], None]
) -> None:
    api = MemoryStatusApi()
    api.gate = asyncio.Event()
    writer = writer_of(api, pool)
    running(writer)
    await async_wait_until(api.reading.is_set, 2.0, what="the first look reading")
    pool.drain(A)  # both drain while the look awaits the API server
    pool.drain(B)
    api.gate.set()
    await async_wait_until(lambda: api.shown() == ("False", "AllDraining"), 2.0, what="the change's look")
    assert [w[-1]["conditions"][0]["reason"] for w in api.writes] == ["Ready", "AllDraining"]


async def test_a_problem_of_the_endpoint_source_wakes_the_writer(
    pool: Pool, running: Callable[[PoolStatusWriter], None]
) -> None:
    api, problem = MemoryStatusApi(), None
    writer = writer_of(api, pool, problem=lambda: problem)
    running(writer)
    await async_wait_until(lambda: api.shown() == ("True", "Ready"), 2.0, what="Ready at start")
    problem = "inferencepool vllm: not found"
    writer.wake()  # what sources.on_problem calls (picker/sources/pool_status/opening.py)
    await async_wait_until(
        lambda: api.shown() == ("False", "EndpointSourceUnavailable"), 2.0, what="the problem written"
    )


async def test_stopping_with_a_successor_records_the_event_and_leaves_the_condition(pool: Pool) -> None:
    api = MemoryStatusApi()
    writer = writer_of(api, pool, successor=lambda: True)  # a linked peer, or a standby for the Lease
    assert await writer.step() and api.shown() == ("True", "Ready")
    await writer.stopping(2.0)
    assert api.shown() == ("True", "Ready") and len(api.writes) == 1
    assert api.reasons() == ["PoolReady", "PickerStopping"]
    pool.set_state(A, EndpointState.NOT_READY)  # a look after it, until the task is cancelled
    assert not await writer.step()
    assert len(api.writes) == 1 and api.reasons() == ["PoolReady", "PickerStopping"]


async def test_stopping_without_a_successor_writes_stopping(pool: Pool) -> None:
    api = MemoryStatusApi()
    writer = writer_of(api, pool, successor=lambda: False)
    assert await writer.step()
    await writer.stopping(2.0)
    assert api.shown() == ("False", "Stopping") and api.reasons() == ["PoolReady", "PickerStopping"]


async def test_a_write_raced_by_a_controller_is_retried_at_once(pool: Pool) -> None:
    api = MemoryStatusApi()
    writer = writer_of(api, pool, successor=lambda: False)
    api.race = 1
    assert await writer.step() and api.shown() == ("True", "Ready")
    assert writer.writes == {"conflict": 1, "written": 1}
    api.race = 1
    await writer.stopping(2.0)  # the Stopping write, raced too, still lands
    assert api.shown() == ("False", "Stopping") and writer.writes == {"conflict": 2, "written": 2}


async def test_a_write_raced_twice_is_left_to_the_next_look(pool: Pool) -> None:
    api = MemoryStatusApi()
    writer = writer_of(api, pool)
    api.race = 2
    assert not await writer.step() and api.writes == [] and writer.writes == {"conflict": 2}
    assert await writer.step() and api.shown() == ("True", "Ready")


async def test_stopping_waits_for_the_look_in_progress(
    pool: Pool, running: Callable[[PoolStatusWriter], None]
) -> None:
    api = MemoryStatusApi()
    api.gate = asyncio.Event()
    writer = writer_of(api, pool, successor=lambda: False)
    running(writer)
    await async_wait_until(api.reading.is_set, 2.0, what="the first look reading")
    stopping = asyncio.create_task(writer.stopping(2.0))
    await asyncio.sleep(0)  # let it start (not a synchronisation: the order is checked below)
    assert api.reads == 1  # it waits for the look: no second read beside the first
    api.gate.set()
    await stopping
    assert [w[-1]["conditions"][0]["reason"] for w in api.writes] == ["Ready", "Stopping"]
    assert api.shown() == ("False", "Stopping")


async def test_stopping_is_bounded_by_its_timeout(pool: Pool) -> None:
    api = MemoryStatusApi()
    api.gate = asyncio.Event()  # the API server never answers
    writer = writer_of(api, pool, successor=lambda: False)
    started = time.monotonic()
    await writer.stopping(0.2)
    assert time.monotonic() - started < 1.0 and api.writes == []


async def test_an_event_names_its_pool_by_uid_and_stays_within_the_api_servers_limits() -> None:
    api, pool = MemoryStatusApi(), Pool()
    long_name = "p" * 250  # a DNS subdomain: up to 253 characters
    rolled_back: tuple[int, str | None] = (0, None)
    pool.apply(ready=["10.0.0.1:8000"])
    writer = PoolStatusWriter(
        api, pool, long_name, identity="", debounce_s=0.05, resync_s=30.0, rollbacks=lambda: rolled_back
    )
    await writer.step()
    pool.drain("10.0.0.1:8000")
    rolled_back = (1, "é" * 600)  # a note past 1 kB in bytes, in two-byte characters
    await writer.step()
    assert api.reasons() == ["PoolReady", "EndpointDraining", "RolloutRolledBack", "PoolDegraded"]
    for event in api.events:
        assert event["regarding"]["uid"] == "uid-vllm" and event["regarding"]["kind"] == "InferencePool"
        assert event["reportingInstance"] == "inference-picker"  # never empty: the API server refuses it
        assert event["reportingController"] == "inference-picker"
        prefix, _ = event["metadata"]["name"].rsplit(".", 1)
        assert len(event["metadata"]["name"]) <= 253 and long_name.startswith(prefix)
        assert len(event["note"].encode()) <= 1024
    rollback = api.events[2]["note"]
    assert len(rollback.encode()) > 1000 and rollback.endswith("é")  # cut between characters


def test_the_wiring_names_a_successor_and_wakes_the_writer_on_the_sources_problem() -> None:
    """open_pool_status (picker/sources/pool_status/opening.py): a successor is a linked peer in another
    pod, never a standby for the Lease (not ready until it holds it, and maybe absent) nor a worker
    of the same pod (they stop together); a change of the endpoint source's problem wakes the writer."""
    from types import SimpleNamespace

    from picker.config.sources import load_config
    from picker.observability.metrics import Metrics
    from picker.sources.pool_status.opening import open_pool_status

    listeners: list[Callable[[str | None], None]] = []
    unlinked: list[str] = []
    peering = SimpleNamespace(name="picker-a", peers=("picker-b",), unlinked=lambda: list(unlinked))
    sources = SimpleNamespace(
        status_api=MemoryStatusApi(), status_grants=None, problem=None, on_problem=listeners.append
    )

    def core(leader: Callable[[], bool] | None, peers: object, workers: int = 1) -> Any:
        config = load_config(overrides={"kube": {"pool_name": "vllm", "pool_status": True}})
        config = config.model_copy(update={"server": config.server.model_copy(update={"workers": workers})})
        return SimpleNamespace(
            config=config,
            sources=sources,
            path=SimpleNamespace(peering=peers),
            pool=Pool(),
            metrics=Metrics(pool="vllm"),
            leader=leader,
            rollout=None,
            drains=None,
        )

    assert not open_pool_status(core(lambda: True, None))._successor()  # a standby is not ready
    assert not open_pool_status(core(lambda: True, peering))._successor()  # nor a linked one
    assert not open_pool_status(core(None, peering, workers=2))._successor()  # the pod's own workers
    alone = open_pool_status(core(None, None))
    assert not alone._successor()
    linked = open_pool_status(core(None, peering))
    assert linked._successor()
    unlinked.append("picker-b")  # its one peer's link dropped: nobody to take over
    assert not linked._successor()
    assert not linked._wake.is_set()
    listeners[-1]("inferencepool vllm: not found")
    assert linked._wake.is_set()
