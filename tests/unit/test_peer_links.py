"""The channel between pickers over real loopback TCP, in process (picker/peers.py): books cross it,
a wrong token is refused, a peer found by discovery gets a link and one that leaves is orphaned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from loadtest.procs import async_wait_until
from picker.inference import InferenceRequest
from picker.peering import Peering
from picker.peers import PeerLinks, PeerService, peer_drains, peer_server, wait_linked
from picker.pipeline import RequestPath
from picker.pool import Pool
from picker.streams import EndReason
from picker.telemetry import Metrics

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)


class Side:
    """One picker's peering, its server on a loopback port and its links (started by `run`)."""

    def __init__(self, token: str | None = "s3cret") -> None:
        self.pool = Pool()
        self.pool.apply(ready=[E1, E2])
        self.token = token
        self.peering: Peering | None = None
        self.server: asyncio.Server | None = None
        self.service: PeerService | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def listen(self) -> str:
        self.probe = Peering("127.0.0.1:1", (), self.pool)  # renamed once the port is known
        self.path = RequestPath(self.pool, Metrics(), fallback_count=0, schedule=lambda d, f: lambda: None)
        self.service = PeerService(self.probe, self.path, self.token, lambda: [{"address": E1}])
        self.server, port = await peer_server(self.service, "127.0.0.1", 0)
        self.name = f"127.0.0.1:{port}"
        return self.name

    def join(self, members: list[str], resolver: object | None = None) -> PeerLinks:
        self.peering = Peering(self.name, members, self.pool)
        self.path = RequestPath(
            self.pool, Metrics(), fallback_count=0, schedule=lambda d, f: lambda: None, peering=self.peering
        )
        assert self.service is not None
        self.service._peering, self.service._path = self.peering, self.path  # the wired objects
        self.peering.heard |= self.probe.heard  # links that came in before
        kwargs = {"service": "pickers:9004", "every_s": 0.05, "resolver": resolver} if resolver else {}
        links = PeerLinks(self.peering, self.path, self.token, **kwargs)  # type: ignore[arg-type]
        self.tasks.append(asyncio.create_task(links.run()))
        return links

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server is not None:
            self.server.close()
            assert self.service is not None
            await self.service.close()
            await self.server.wait_closed()


@pytest.fixture
async def sides() -> AsyncIterator[list[Side]]:
    made = [Side(), Side()]
    yield made
    for side in made:
        await side.close()


def peer_counts(side: Side) -> int:
    return sum(e.peer_in_flight for e in side.pool.endpoints())


async def test_a_pick_and_its_end_cross_the_channel(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    b.join(members)
    record = a.path.admit(REQUEST).payload
    await async_wait_until(lambda: peer_counts(b) == 1, 5, what="B to count A's request")
    a.path.finish(record, EndReason.COMPLETED)
    await async_wait_until(lambda: peer_counts(b) == 0, 5, what="B to drop it")
    assert await peer_drains(a.name, b.name, "s3cret") == [{"address": E1}]
    assert await peer_drains(a.name, b.name, "wrong") == []  # refused: not its drains


async def test_linked_means_both_ways_and_a_missing_peer_only_delays_readiness(sides: list[Side]) -> None:
    """What readiness waits for (App._await_peers): this picker's link to each peer open, and each
    peer's link here (its books in). One way is not enough; a peer that never comes is a timeout."""
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    assert a.peering is not None
    await async_wait_until(lambda: b.name in a.peering.connected, 5, what="A's link to B")  # type: ignore[union-attr]
    assert not a.peering.linked()  # B has not linked back: A has not got B's books
    b.join(members)
    assert await wait_linked(a.peering, 5)
    assert b.peering is not None and await wait_linked(b.peering, 5)
    await b.close()  # B's link to A goes: A no longer hears B
    await async_wait_until(lambda: not a.peering.linked(), 5, what="A to notice B's link gone")  # type: ignore[union-attr]
    alone = Peering("127.0.0.1:1", ("127.0.0.1:1", "127.0.0.1:2"), Pool())  # its peer never answers
    assert not await wait_linked(alone, 0.05)


async def test_a_wrong_token_gets_no_books_in(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    b.token = "other"
    a.join(members)
    b.join(members)
    b.path.admit(REQUEST)
    assert a.service is not None
    await async_wait_until(lambda: a.service.refused >= 1, 5, what="A to refuse B")  # type: ignore[union-attr]
    assert peer_counts(a) == 0


async def test_discovery_opens_links_to_new_pickers_and_orphans_gone_ones(sides: list[Side]) -> None:
    a, b = sides
    found = [await a.listen(), await b.listen()]
    listed = list(found)

    async def resolver(service: str) -> list[str]:
        return list(listed)

    a.join([], resolver)
    b.join([], resolver)
    await async_wait_until(lambda: a.peering is not None and b.name in a.peering.connected, 5, what="a link")
    b.path.admit(REQUEST)
    await async_wait_until(lambda: peer_counts(a) == 1, 5, what="A to count B's request")
    listed.remove(b.name)  # B's pod left the headless Service
    assert a.peering is not None
    await async_wait_until(lambda: b.name not in a.peering.peers, 5, what="A to drop B")
    assert peer_counts(a) == 1 and a.peering.orphans == 1  # its stream may still run: an orphan
