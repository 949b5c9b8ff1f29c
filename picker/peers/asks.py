"""Questions one picker asks a peer, each on a connection of its own over the channel between pickers:
its drain records (`GET /admin/drains?scope=pool`, `picker scorecard`) and, for `?move_streams=true`,
to move its streams off an address (picker/peers/moves.py gathers those answers).

A question is the mutual handshake (picker/peers/auth.py), then, for a move, the ask as the first
sealed frame, and the answer as the peer's first sealed frame (picker/peers/session.py). The asker
checks the peer's welcome before it sends the ask (a listener that cannot prove the credential is
told nothing and believed in nothing), judges every answer whole (picker/peers/events.py) and counts
what it refused by reason; a peer that does not answer within the timeout is reported, never waited on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import msgpack

from picker.config.model import parse_address
from picker.peers.auth import DRAINS, MOVES, REFUSAL, Handshake, challenge_of, new_nonce, proven, welcome_of
from picker.peers.books import Peering
from picker.peers.events import MAX_WHY, MOVE_ASK, drains_problem
from picker.peers.session import HELLO_MAX, MAX_FRAME, STREAM_LIMITS, FrameError, Session
from picker.pool.drain import merge_summaries

log = logging.getLogger(__name__)

DRAINS_TIMEOUT_S = 2.0


class Refused(Exception):
    """The peer refused the question at its hello (`why`: its reason, as it gave it)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Reader:
    """The peer's messages, in order, however the reads split them; each bounded by itself (at most
    `HELLO_MAX` bytes before its welcome is proven: whoever listens at that address may not be a
    member), never by the read it came in: a welcome and the answer after it often share one."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME, **STREAM_LIMITS)
        self._fed = 0

    async def next(self, limit: int = MAX_FRAME) -> Any:
        """The next whole message, or None when the peer closed; FrameError("too-large") once the
        part of it read so far is larger than `limit`."""
        while True:
            try:
                return self._unpacker.unpack()
            except msgpack.OutOfData:
                pass
            if self._fed - self._unpacker.tell() > limit:  # all of it is this message's beginning
                raise FrameError("too-large")
            data = await self._reader.read(65536)
            if not data:
                return None
            self._fed += len(data)
            self._unpacker.feed(data)


async def _ask(peer: str, kind: str, name: str, secret: str | None, timeout_s: float, ask: Any = None) -> Any:
    """One question: the handshake, `ask` (when given) as the first frame, then the peer's answer
    (None when it closed without one). Raises Refused (the peer refused the hello), FrameError (it
    did not prove itself, or its answer is no frame of this session), OSError, TimeoutError or
    ValueError (msgpack's errors included) when the peer cannot be asked; nothing waits longer than
    `timeout_s`."""
    host, port = parse_address(peer)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            messages = _Reader(reader)
            nonce = challenge_of(await messages.next(HELLO_MAX))
            if nonce is None:
                raise FrameError("no-challenge")
            handshake = Handshake(kind, name, peer, nonce, new_nonce())
            writer.write(msgpack.packb(handshake.hello(secret)))
            reply = await messages.next(HELLO_MAX)
            if isinstance(reply, list) and len(reply) == 2 and reply[0] == REFUSAL:
                why = reply[1]
                raise Refused(why if isinstance(why, str) and 0 < len(why) <= MAX_WHY else "refused")
            if not proven(handshake.welcome_proof(secret), welcome_of(reply)):
                raise FrameError("unproven-peer")
            session = Session.connector(handshake, secret)
            if ask is not None:
                writer.write(session.seal(ask))
            await writer.drain()
            frame = await messages.next()
            return None if frame is None else session.open(frame)
    finally:
        if writer is not None:
            writer.close()


def _count(rejected: Counter[str] | None, reason: str) -> None:
    if rejected is not None:
        rejected[reason] += 1


async def peer_drains(
    peer: str,
    name: str,
    secret: str | None,
    timeout_s: float = DRAINS_TIMEOUT_S,
    rejected: Counter[str] | None = None,
) -> list[dict[str, Any]]:
    """A peer's drain records (its admin API's `drains`), or [] when it does not answer, or answers
    something that is not drain records (counted in `rejected` by reason)."""
    try:
        drains = await _ask(peer, DRAINS, name, secret, timeout_s)
    except Refused as refusal:
        log.warning("drains from peer %s: refused (%s)", peer, refusal.why)
        return []
    except FrameError as exc:
        _count(rejected, exc.reason)
        log.warning("drains from peer %s: %s", peer, exc.reason)
        return []
    except (OSError, TimeoutError, ValueError, msgpack.UnpackException) as exc:
        log.warning("drains from peer %s: %s", peer, type(exc).__name__)
        return []
    if drains is None:
        return []
    reason = drains_problem(drains)
    if reason is not None:
        _count(rejected, reason)
        log.warning("drains from peer %s: malformed (%s); left out of the pool's view", peer, reason)
        return []
    return list(drains)


async def peer_moves(
    peer: str,
    name: str,
    secret: str | None,
    address: str,
    timeout_s: float,
    rejected: Counter[str] | None = None,
) -> Any:
    """Ask a peer to move its streams off `address` now: its answer as it came (judged whole by
    picker/peers/events.py's `answer_problem`), its refusal `["error", why]`, or None when it gave
    none within `timeout_s` (or none from a member: counted in `rejected` by reason)."""
    try:
        return await _ask(peer, MOVES, name, secret, timeout_s, [MOVE_ASK, address])
    except Refused as refusal:
        return [REFUSAL, refusal.why]
    except FrameError as exc:
        _count(rejected, exc.reason)
        log.warning("moving streams through peer %s: %s", peer, exc.reason)
        return None
    except (OSError, TimeoutError, ValueError, msgpack.UnpackException) as exc:
        log.warning("moving streams through peer %s: %s", peer, type(exc).__name__)
        return None


class PoolDrains:
    """Every picker's drain records merged (picker/pool/drain.py `merge_summaries`): what the pool's
    drains were. A peer's malformed answer is left out and counted (`rejected`), never raised."""

    def __init__(self, peering: Peering, secret: str | None, timeout_s: float = DRAINS_TIMEOUT_S) -> None:
        self._peering, self._secret, self._timeout_s = peering, secret, timeout_s
        self.rejected: Counter[str] = Counter()  # peers' answers refused whole, by reason

    async def __call__(self, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
        name = self._peering.name
        theirs = await asyncio.gather(
            *(peer_drains(p, name, self._secret, self._timeout_s, self.rejected) for p in self._peering.peers)
        )
        return merge_summaries([own, *theirs])
