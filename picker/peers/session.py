"""The frames of an authenticated connection between pickers, after its handshake (picker/peers/auth.py).

Each message is a frame: a msgpack `bin` holding a 16-byte tag and then the message's own msgpack
bytes. The tag is keyed BLAKE2b over the frame's sequence number (8 bytes, big-endian; 0 for the
first frame each way, never sent) and the message, under the session key of that direction. So a
frame cannot be forged or altered without the credential, nor replayed, dropped or reordered
undetected (the sequence number the receiver expects would not match), nor reflected back to its
sender (the other direction has another key), nor carried over to another connection (another key).
A frame that fails closes the session, and is counted by reason: `bad-mac`, `not-a-frame` (anything
but a `bin` of at least a tag), `unreadable` (a proven frame that is not msgpack).

Why BLAKE2b and not HMAC-SHA256 per frame: a keyed BLAKE2b costs a fraction of an HMAC on a small
message, and each message takes one on each side; the handshake, once per connection, uses
HMAC-SHA256.

Pure: no I/O. The limits here bound what a connection may make this picker hold.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack

from picker.peers.auth import Handshake

TAG = 16  # bytes of a frame's tag
MAX_FRAME = 16 * 1024 * 1024  # a proven peer's frame larger than this closes its connection
HELLO_MAX = 4096  # bytes a connection may send before its hello is accepted (a hello is < 1.2 KiB)
# The outer stream carries only hellos, challenges, welcomes, refusals (short arrays of short strings)
# and `bin` frames; its reader refuses anything larger before allocating it (msgpack's C reader makes a
# list at its announced length, and leaks a half-read nested one when thrown away)
STREAM_LIMITS = {"max_array_len": 8, "max_map_len": 0, "max_ext_len": 0, "max_str_len": 4096}
HELLO_TIMEOUT_S = 5.0  # a connection that has not said (or answered) its hello by then is closed


class FrameError(ValueError):
    """A frame that cannot be taken: the session ends (`reason` is a metric label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Session:
    """One side of one connection's frames: seals what it sends, opens what it receives, in order."""

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        self._send = hashlib.blake2b(key=send_key, digest_size=TAG)
        self._receive = hashlib.blake2b(key=receive_key, digest_size=TAG)
        self.sent = 0  # frames sealed: the next one's sequence number
        self.received = 0  # frames opened: the sequence number the next one must carry

    @classmethod
    def listener(cls, handshake: Handshake, secret: str | None) -> Session:
        to_listener, to_connector = handshake.keys(secret)
        return cls(to_connector, to_listener)

    @classmethod
    def connector(cls, handshake: Handshake, secret: str | None) -> Session:
        to_listener, to_connector = handshake.keys(secret)
        return cls(to_listener, to_connector)

    def seal(self, message: Any) -> bytes:
        """`message` as its frame's bytes on the wire (the next sequence number)."""
        body = msgpack.packb(message)
        mac = self._send.copy()
        mac.update(self.sent.to_bytes(8, "big"))
        mac.update(body)
        self.sent += 1
        return msgpack.packb(mac.digest() + body)

    def open(self, frame: Any) -> Any:
        """The message a frame (as msgpack unpacked it) carries; FrameError when it is not the next
        frame of this session, sealed by the other side."""
        if not isinstance(frame, bytes) or len(frame) < TAG:
            raise FrameError("not-a-frame")
        view = memoryview(frame)
        mac = self._receive.copy()
        mac.update(self.received.to_bytes(8, "big"))
        mac.update(view[TAG:])
        if not hmac.compare_digest(mac.digest(), view[:TAG]):
            raise FrameError("bad-mac")
        self.received += 1
        try:
            return msgpack.unpackb(view[TAG:], raw=False)
        except (msgpack.UnpackException, ValueError, TypeError) as exc:
            raise FrameError("unreadable") from exc
