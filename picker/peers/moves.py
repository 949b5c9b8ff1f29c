"""Moves that reach every stream: `POST /admin/endpoints/<addr>/drain?move_streams=true` on one
`picker proxy` moves the streams of every picker sharing the pool's books, not only its own.

With N proxies behind a Service the POST reaches one of them, which alone holds its streams' bytes;
so it moves its own (`move`, the proxy's `move_streams`) and, at the same time, asks each peer over
the channel between pickers to move theirs (picker/peers/asks.py `peer_moves`; the peer answers
in picker/peers/inbox.py through the same `move_streams`). Every answer is judged whole
(picker/peers/events.py `answer_problem`): a malformed one, or one from a peer that could not prove
the credential or whose frame failed, is counted by reason (picker_peer_move_answers_rejected_total)
and that peer reported as not reached, never raised. A peer that
does not answer within `peers.move_timeout_s` (all are asked at once) is reported too: a dead peer
cannot hold the admin POST longer than that.

Each ask is a new connection, held in the peer's pre-hello places until its hello is read, of which
a peer gives one member's address `peers.max_unauthenticated_per_source`: so at most
`ASKING_AT_ONCE` moves ask at once (a rollback moves every candidate endpoint together), the rest
wait their turn, and a dead peer holds a rollback of n endpoints ceil(n / ASKING_AT_ONCE) timeouts
at most.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from picker.peers.asks import peer_moves
from picker.peers.books import Peering
from picker.peers.events import CANNOT, MOVED, answer_problem

log = logging.getLogger(__name__)

# moves asking the peers at once: each opens a connection to every peer, and a peer admits at most
# peers.max_unauthenticated_per_source from one address before their hellos (by default twice this):
# half of them leaves room for this picker's other asks (its events link, a drains read)
ASKING_AT_ONCE = 4

# peer, name, secret, address, timeout, and where to count an answer refused before it is judged
Ask = Callable[[str, str, str | None, str, float, Counter[str]], Awaitable[Any]]


def everywhere(
    move: Callable[[str], int], moves: PoolMoves | None
) -> Callable[[str], Awaitable[tuple[int, dict[str, str]]]]:
    """Moving an endpoint's streams as `?move_streams=true` does (a canary's rollback moves its
    candidate's so): with peers, every picker's sharing the books, else this one's; how many moved,
    and each peer not reached with why (its streams on that endpoint were not moved)."""

    async def moved(address: str) -> tuple[int, dict[str, str]]:
        if moves is None:
            return move(address), {}
        answer = await moves.move(address)
        return int(answer["moved_streams"]), dict(answer["moved_streams_unreached"])

    return moved


class PoolMoves:
    """One picker's `?move_streams=true`, reaching every peer's streams (see the module docstring)."""

    def __init__(
        self,
        peering: Peering,
        secret: str | None,
        move: Callable[[str], int],
        timeout_s: float,
        ask: Ask = peer_moves,
    ) -> None:
        self._peering, self._secret, self._move = peering, secret, move
        self._timeout_s, self._ask = timeout_s, ask
        self.rejected: Counter[str] = Counter()  # peers' answers refused whole, by reason
        self._asking = asyncio.Semaphore(ASKING_AT_ONCE)  # within the peers' pre-hello places

    async def move(self, address: str) -> dict[str, Any]:
        """Move every picker's streams on `address`: what the admin answer adds. `moved_streams` is
        the total; `moved_streams_by_picker` each picker's count, by its peer name (this one's
        included); `moved_streams_unreached` each peer whose streams were not moved, and why
        (`no-answer`, `refused: ...`, `cannot: ...`, `malformed: ...`)."""
        peers, name = self._peering.peers, self._peering.name
        by_picker = {name: self._move(address)}  # this picker's own first: no network in the way
        async with self._asking:
            answers = await asyncio.gather(
                *(self._ask(p, name, self._secret, address, self._timeout_s, self.rejected) for p in peers),
                return_exceptions=True,  # peer_moves catches what a peer can cause: this is a backstop
            )
        unreached: dict[str, str] = {}
        for peer, answer in zip(peers, answers, strict=True):
            moved, why = self.judge(peer, answer)
            if moved is None:
                unreached[peer] = why
            else:
                by_picker[peer] = moved
        total = sum(by_picker.values())
        log.info(
            "move_streams address=%s moved=%d by_picker=%s%s",
            address,
            total,
            ",".join(f"{picker}:{n}" for picker, n in by_picker.items()),
            "".join(f" unreached={peer}({why})" for peer, why in unreached.items()),
        )
        return {
            "moved_streams": total,
            "moved_streams_by_picker": by_picker,
            "moved_streams_unreached": unreached,
        }

    def judge(self, peer: str, answer: Any) -> tuple[int | None, str]:
        """A peer's answer: (how many it moved, "") or (None, why none were)."""
        if answer is None or isinstance(answer, BaseException):
            return None, "no-answer"
        reason = answer_problem(answer)
        if reason is not None:
            self.rejected[reason] += 1
            log.warning("peer %s answered a move ask malformed (%s); counted as not reached", peer, reason)
            return None, f"malformed: {reason}"
        kind, value = answer
        if kind == MOVED:
            return int(value), ""
        return None, f"{'cannot' if kind == CANNOT else 'refused'}: {value}"
