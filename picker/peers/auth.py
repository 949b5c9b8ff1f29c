"""Who may talk on the channel between pickers: a mutual handshake over the pickers' own credential
(`peers.secret`, from a Secret), never the admin token and never sent.

    listener  -> connector  ["challenge", nL]                       nL: 16 random bytes, hex, fresh
    connector -> listener   [kind, sender, receiver, nC, hello]     nC: the same, the connector's
    listener  -> connector  ["welcome", welcome]                    (or ["error", why], then closed)

Both proofs are HMAC-SHA256(secret, label || transcript), the transcript being msgpack's encoding of
[kind, sender, receiver, nL, nC], so each proof binds both nonces (neither side can be replayed
another connection's), both names (a member cannot relay a hello meant for another picker: the
receiver checks it is the one named) and the connection kind (`events`, `drains`, `moves`). The
listener checks the hello (constant time), that it is the receiver named and that the sender is one
of its peers; the connector checks the welcome before it sends anything more. A stranger can neither
say hello nor welcome a member, nor name itself one.

Each side then derives the session key HMAC(secret, "session" || transcript) and from it one key per
direction; every frame after the hello is sealed with its direction's key and its sequence number
(picker/peers/session.py). With `peers.allow_unauthenticated` the credential is the empty string: the
same handshake and frames, which anyone can compute (loopback-only test setups).
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Any

import msgpack

EVENTS, DRAINS, MOVES = "events", "drains", "moves"  # what a connection is for (the hello's first field)
KINDS = frozenset({EVENTS, DRAINS, MOVES})
CHALLENGE, WELCOME, REFUSAL = "challenge", "welcome", "error"
NONCE_CHARS, PROOF_CHARS = 32, 64
MAX_NAME = 512  # a picker's name: its peer address


def new_nonce() -> str:
    return secrets.token_hex(NONCE_CHARS // 2)


def _nonce(value: Any) -> bool:
    return isinstance(value, str) and len(value) == NONCE_CHARS and value.isascii()


def _name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def challenge_of(message: Any) -> str | None:
    """The nonce of a challenge message, or None when it is not one."""
    if isinstance(message, list) and len(message) == 2 and message[0] == CHALLENGE and _nonce(message[1]):
        return str(message[1])
    return None


def welcome_of(message: Any) -> str | None:
    """The proof a welcome carries, or None when the message is not a welcome."""
    if isinstance(message, list) and len(message) == 2 and message[0] == WELCOME:
        return message[1] if isinstance(message[1], str) else None
    return None


def proven(expected: str, presented: Any) -> bool:
    """Whether `presented` is the `expected` proof (constant-time; anything else is simply False)."""
    if not isinstance(presented, str) or len(presented) != PROOF_CHARS or not presented.isascii():
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())


@dataclass(frozen=True, slots=True)
class Handshake:
    """One connection's handshake: who connects to whom, for what, over which two nonces."""

    kind: str
    sender: str  # the connecting picker
    receiver: str  # the listening picker, as the sender names it
    listener_nonce: str
    connector_nonce: str

    def _mac(self, secret: str | None, label: bytes) -> bytes:
        transcript = msgpack.packb(
            [self.kind, self.sender, self.receiver, self.listener_nonce, self.connector_nonce]
        )
        return hmac.digest((secret or "").encode(), label + b"\0" + transcript, "sha256")

    def hello_proof(self, secret: str | None) -> str:
        return self._mac(secret, b"picker-peers hello").hex()

    def welcome_proof(self, secret: str | None) -> str:
        return self._mac(secret, b"picker-peers welcome").hex()

    def hello(self, secret: str | None) -> list[Any]:
        """The connector's hello, proving the credential."""
        return [self.kind, self.sender, self.receiver, self.connector_nonce, self.hello_proof(secret)]

    def welcome(self, secret: str | None) -> list[Any]:
        """The listener's answer to a hello it accepted, proving the credential in turn."""
        return [WELCOME, self.welcome_proof(secret)]

    def keys(self, secret: str | None) -> tuple[bytes, bytes]:
        """The session's keys: (connector to listener, listener to connector)."""
        session = self._mac(secret, b"picker-peers session")
        return (
            hmac.digest(session, b"to-listener", "sha256"),
            hmac.digest(session, b"to-connector", "sha256"),
        )


def hello_of(message: Any, listener_nonce: str) -> tuple[Handshake, str] | str:
    """A hello as the listener reads it: (its handshake, the proof presented), or why it is none
    (`old-protocol`: the hello of a picker before the mutual handshake, which named no receiver)."""
    if (
        not isinstance(message, list)
        or not message
        or not isinstance(message[0], str)
        or message[0] not in KINDS
    ):
        return "not-a-hello"
    if len(message) in (3, 4):
        return "old-protocol"
    if len(message) != 5:
        return "not-a-hello"
    kind, sender, receiver, connector_nonce, presented = message
    if not (_name(sender) and _name(receiver) and _nonce(connector_nonce)):
        return "not-a-hello"
    return Handshake(kind, sender, receiver, listener_nonce, connector_nonce), presented
