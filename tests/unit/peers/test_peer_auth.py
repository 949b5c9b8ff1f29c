"""Who may talk on the peer channel (issue 40, item 1): a client must prove the pickers' credential over
the receiver's challenge (an HMAC; the secret never crosses the wire) and name one of its peers.
Before, with the shipped manifests (no admin token), anyone reaching the peer port could say hello and
send forged picks: 10,000 of them raised one endpoint's load by 10,000."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from loadtest.procs import async_wait_until
from picker.peers.auth import proof
from picker.peers.channel import DRAINS, EVENTS
from tests.unit.peers.test_peer_links import E1, REQUEST, Side, peer_counts

SECRET = "s3cret"  # Side's


@pytest.fixture
async def sides() -> AsyncIterator[list[Side]]:
    made = [Side(), Side()]
    yield made
    for side in made:
        await side.close()


async def hello(
    port: int, name: str, make_proof: Any, then: list[Any] | None = None, answered: bool = True
) -> Any:
    """Connect, read the challenge, send a hello (and events); the picker's answer (a refusal) when
    `answered`, else None once the bytes are written (an accepted connection gets no answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    unpacker = msgpack.Unpacker(raw=False)
    try:
        unpacker.feed(await asyncio.wait_for(reader.read(4096), 5))
        challenge = next(unpacker)
        assert challenge[0] == "challenge" and len(challenge[1]) == 32
        writer.write(msgpack.packb([EVENTS, name, make_proof(challenge[1])]))
        if then is not None:
            writer.write(msgpack.packb(then))
        await writer.drain()
        if not answered:
            return None
        unpacker.feed(await asyncio.wait_for(reader.read(4096), 5))
        return next(unpacker)
    finally:
        if answered:
            writer.close()
        else:
            OPEN.append(writer)  # kept open until the test ends: its events are read when pulled


OPEN: list[asyncio.StreamWriter] = []


async def test_a_client_without_the_credential_is_refused_and_changes_nothing(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    port = int(a.name.rsplit(":", 1)[1])
    forged = [["pick", f"{b.name}~forged{i}", E1] for i in range(100)]
    answer = await hello(port, b.name, lambda nonce: "0" * 64, forged)  # b's name, no secret
    assert answer == ["error", "unauthenticated"]
    answer = await hello(port, b.name, lambda nonce: SECRET, forged)  # the secret itself is no proof
    assert answer == ["error", "unauthenticated"]
    assert peer_counts(a) == 0 and a.service is not None and a.service.rejected["unauthenticated"] == 2


async def test_a_replayed_hello_is_refused(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    port = int(a.name.rsplit(":", 1)[1])
    seen: list[str] = []

    def once(nonce: str) -> str:
        seen.append(proof(SECRET, nonce, EVENTS, b.name))
        return seen[0]  # the first connection's proof, replayed on the second

    await hello(port, b.name, once, [["pick", f"{b.name}~real", E1]], answered=False)
    await async_wait_until(lambda: peer_counts(a) == 1, 5, what="the proven hello's pick to count")
    replayed = await hello(port, b.name, once, [["pick", f"{b.name}~replayed", E1]])
    assert replayed == ["error", "unauthenticated"] and peer_counts(a) == 1
    for writer in OPEN:
        writer.close()
    OPEN.clear()


async def test_only_the_configured_peers_are_accepted(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    port = int(a.name.rsplit(":", 1)[1])
    stranger = "10.66.6.6:9004"
    answer = await hello(port, stranger, lambda nonce: proof(SECRET, nonce, EVENTS, stranger))
    assert answer == ["error", "not-a-member"]


async def test_the_pickers_own_links_authenticate_and_carry_the_books(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    b.join(members)
    a.path.admit(REQUEST)
    await async_wait_until(lambda: peer_counts(b) == 1, 5, what="B to count A's request")
    assert b.service is not None and b.service.refused == 0
    assert proof(SECRET, "n" * 32, DRAINS, a.name) != proof(SECRET, "n" * 32, EVENTS, a.name)
