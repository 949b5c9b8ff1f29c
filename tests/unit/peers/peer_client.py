"""A member, or a stranger, speaking the peer protocol by hand over loopback TCP, for tests: the
handshake (picker/peers/auth.py) and the sealed frames (picker/peers/session.py), each step its own
call so that a test can break any one of them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgpack

from picker.peers.auth import (
    CHALLENGE,
    EVENTS,
    MOVES,
    Handshake,
    challenge_of,
    hello_of,
    new_nonce,
    welcome_of,
)
from picker.peers.session import Session


class Client:
    """One connection to a picker's peer port."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.unpacker = msgpack.Unpacker(raw=False)
        self.challenge = ""
        self.handshake: Handshake | None = None
        self.session: Session | None = None

    @classmethod
    async def connect(cls, port: int, challenged: bool = True) -> Client:
        """Connect (and read the listener's challenge, unless `challenged` is False)."""
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        if challenged:
            nonce = challenge_of(await client.read())
            assert nonce is not None, "no challenge"
            client.challenge = nonce
        return client

    async def read(self, timeout: float = 5) -> Any:  # noqa: ASYNC109 (a bound on one read)
        """The next message, or None when the picker closed the connection."""
        while True:
            with contextlib.suppress(StopIteration):
                return next(self.unpacker)
            try:
                data = await asyncio.wait_for(self.reader.read(65536), timeout)
            except ConnectionError:
                return None
            if not data:
                return None
            self.unpacker.feed(data)

    async def closed_by_peer(self, timeout: float = 5) -> bool:  # noqa: ASYNC109
        """True once the picker has closed the connection (whatever it sent first is skipped)."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionError:
                    return True
                if not data:
                    return True

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    def hello(
        self,
        kind: str,
        sender: str,
        receiver: str,
        secret: str | None,
        challenge: str | None = None,
    ) -> Handshake:
        """Send a hello (over this connection's challenge, unless another is given)."""
        self.handshake = Handshake(kind, sender, receiver, challenge or self.challenge, new_nonce())
        self.write(msgpack.packb(self.handshake.hello(secret)))
        return self.handshake

    async def handshake_as(self, kind: str, sender: str, receiver: str, secret: str | None) -> Session:
        """The whole handshake as a member: hello, then the picker's welcome, checked."""
        handshake = self.hello(kind, sender, receiver, secret)
        welcome = await self.read()
        assert welcome_of(welcome) == handshake.welcome_proof(secret), welcome
        self.session = Session.connector(handshake, secret)
        return self.session

    def send(self, message: Any) -> bytes:
        """Seal `message` as the next frame and send it; the frame's bytes."""
        assert self.session is not None
        frame = self.session.seal(message)
        self.write(frame)
        return frame

    async def answer(self) -> Any:
        """The picker's next sealed frame, opened."""
        assert self.session is not None
        return self.session.open(await self.read())

    def close(self) -> None:
        self.writer.close()


class FakePeer:
    """A peer's port, on loopback, speaking the protocol as a listener: its challenge, the hello read,
    a welcome proven with `secret` (another than the asker's: a listener that cannot prove itself),
    then, for an ask, `answer` sealed (None: it never welcomes nor answers, until the asker closes)."""

    def __init__(self, answer: Any, secret: str | None = "s3cret") -> None:
        self.answer, self.secret = answer, secret
        self.server: asyncio.Server | None = None
        self.hellos: list[Any] = []
        self.asks: list[Any] = []
        self.frames: list[bytes] = []  # whatever came after the hello, as read

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = new_nonce()
        writer.write(msgpack.packb([CHALLENGE, nonce]))
        client = Client(reader, writer)
        try:
            hello = await client.read()
            self.hellos.append(hello)
            parsed = hello_of(hello, nonce)
            if self.answer is None or isinstance(parsed, str):
                await reader.read()  # until the asker gives up and closes
                return
            handshake, _ = parsed
            writer.write(msgpack.packb(handshake.welcome(self.secret)))
            session = Session.listener(handshake, self.secret)
            if handshake.kind == MOVES:
                self.asks.append(session.open(await client.read()))
            if handshake.kind == EVENTS:
                while (data := await reader.read(65536)) != b"":
                    self.frames.append(data)
                return
            writer.write(session.seal(self.answer))
            await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
