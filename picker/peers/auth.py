"""Who may talk on the channel between pickers: a challenge and an HMAC over it, with the pickers' own
credential (`peers.secret`, from a Secret), never the admin token and never sent.

The receiving picker opens each connection with `["challenge", nonce]` (16 random bytes, hex, fresh
per connection); the connecting picker's hello is `[kind, sender, proof]`, the proof being
HMAC-SHA256(secret, nonce, kind, sender). The receiver checks it in constant time and that the sender
is one of its configured peers. A replayed hello fails (its nonce was another connection's); a
stranger without the secret cannot say hello at all, nor name itself a member.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

CHALLENGE = "challenge"


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: str, nonce: str, kind: str, sender: str) -> str:
    message = "\n".join((nonce, kind, sender)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def verified(secret: str, nonce: str, kind: str, sender: str, presented: Any) -> bool:
    """Whether `presented` is the proof for this connection's nonce (constant-time compare)."""
    if not isinstance(presented, str) or len(presented) != 64:
        return False
    return hmac.compare_digest(proof(secret, nonce, kind, sender), presented)


def challenge_of(message: Any) -> str | None:
    """The nonce of a challenge message, or None when it is not one."""
    if isinstance(message, list) and len(message) == 2 and message[0] == CHALLENGE:
        nonce = message[1]
        if isinstance(nonce, str) and len(nonce) == 32:
            return nonce
    return None
