"""Who may talk on the peer channel (issue 40, item 1): a client must prove the pickers' credential over
the receiver's challenge (an HMAC; the secret never crosses the wire) and name one of its peers.
Before, with the shipped manifests (no admin token), anyone reaching the peer port could say hello and
send forged picks: 10,000 of them raised one endpoint's load by 10,000. (Issue 53 made the handshake
mutual and bound: tests/unit/peers/test_peer_session.py.)"""

from __future__ import annotations

from typing import Any

import msgpack

from loadtest.procs import async_wait_until
from picker.peers.auth import EVENTS, new_nonce
from tests.unit.peers.peer_client import Client
from tests.unit.peers.test_peer_links import E1, REQUEST, Side, peer_counts

SECRET = "s3cret"  # Side's


async def two(sides: list[Side]) -> tuple[Side, Side, int]:
    """A takes links from B; A's port."""
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    return a, b, int(a.name.rsplit(":", 1)[1])


async def answer_to(port: int, hello: Any, then: list[Any] | None = None) -> Any:
    """A hello written by hand (a function of the challenge), events after it; the picker's answer."""
    client = await Client.connect(port)
    try:
        client.write(msgpack.packb(hello(client.challenge)))
        if then is not None:
            client.write(msgpack.packb(then))
        return await client.read()
    finally:
        client.close()


async def test_a_client_without_the_credential_is_refused_and_changes_nothing(sides: list[Side]) -> None:
    a, b, port = await two(sides)
    forged = [["pick", f"{b.name}~forged{i}", E1] for i in range(100)]
    for presented in ("0" * 64, SECRET):  # b's name, no secret; the secret itself is no proof
        answer = await answer_to(
            port, lambda _, p=presented: [EVENTS, b.name, a.name, new_nonce(), p], forged
        )
        assert answer == ["error", "unauthenticated"]
    client = await Client.connect(port)
    client.hello(EVENTS, b.name, a.name, "another-secret")  # a credential, not the pickers'
    assert await client.read() == ["error", "unauthenticated"]
    client.close()
    assert peer_counts(a) == 0 and a.service is not None and a.service.rejected["unauthenticated"] == 3


async def test_a_replayed_hello_is_refused(sides: list[Side]) -> None:
    a, b, port = await two(sides)
    first = await Client.connect(port)
    handshake = first.hello(EVENTS, b.name, a.name, SECRET)
    hello = handshake.hello(SECRET)
    await first.read()  # its welcome
    replayed = await answer_to(port, lambda _: hello)  # the same hello on another connection
    assert replayed == ["error", "unauthenticated"]
    first.close()


async def test_only_the_configured_peers_are_accepted(sides: list[Side]) -> None:
    a, _, port = await two(sides)
    client = await Client.connect(port)
    client.hello(EVENTS, "10.66.6.6:9004", a.name, SECRET)
    assert await client.read() == ["error", "not-a-member"]
    client.close()


async def test_the_pickers_own_links_authenticate_and_carry_the_books(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    b.join(members)
    a.path.admit(REQUEST)
    await async_wait_until(lambda: peer_counts(b) == 1, 5, what="B to count A's request")
    assert b.service is not None and b.service.refused == 0
