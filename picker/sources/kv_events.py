"""The engines' KV-cache events (vLLM `--kv-events-config`, publisher zmq): each endpoint's real cache.

One ZMQ SUB socket per endpoint the picker routes to (READY or DRAINING), connected to
`tcp://<endpoint ip>:<port>` (vLLM binds `tcp://*:5557`) and subscribed to `affinity.kv_events_topic`.
A message is three frames: topic (`kv@<ip>@<model>`), an 8-byte big-endian sequence number and a
msgpack batch `[timestamp, [events...], (dp rank)]`. Events come as maps with a `type` (what vLLM 0.32
sends, measured here) or as tagged arrays `[type, field, ...]` (vLLM's array_like structs, what the
reference decodes positionally); both are read, extra fields ignored:
- `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name):
  the picker computes its own chained key of each block from its token ids (picker/scheduling/
  prefix.py `chain_tokens`), from the parent's key, or the model's seed for a first block; the
  engine's hashes are only names (the reference's dual-key design: no need to match vLLM's hash);
- `BlockRemoved` (block_hashes): those go; `AllBlocksCleared`: everything goes;
- a gap in the sequence numbers (PUB drops what a slow subscriber cannot take) empties the view,
  which new events rebuild.
Endpoints that leave the pool are closed. The socket for an endpoint is opened when the pool says it
exists; a publisher not up yet is fine (ZMQ reconnects by itself). pyzmq's asyncio sockets, one
reader task per endpoint, owned by `run`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from picker.config.model import AffinityConfig, parse_address
from picker.pool import EndpointState, Pool
from picker.pool.cache import KvBlocks
from picker.scheduling.prefix import chain_tokens, seed_of

log = logging.getLogger(__name__)

# Positional fields of the array form (vLLM's msgspec structs, tag first).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_REMOVED_FIELDS = ("block_hashes", "medium")
_RESTART_AFTER_S = 1.0  # a reader that died is replaced this long after (no tight loop on a bad socket)


def _event(raw: Any) -> Mapping[str, Any] | None:
    """One event as a mapping with a `type`, from either wire form; None when it is neither."""
    if isinstance(raw, Mapping):
        return raw if isinstance(raw.get("type"), str) else None
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        fields = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(raw[0], ())
        return {"type": raw[0], **dict(zip(fields, raw[1:], strict=False))}
    return None


def _names(value: Any) -> list[Any] | None:
    """Block names: ints, or bytes with a cryptographic hash algorithm (sha256_cbor); every one is
    checked, so an event with one unhashable name applies nothing (not the names before it)."""
    if isinstance(value, list) and all(isinstance(v, int | bytes) for v in value):
        return value
    return None


def apply_batch(view: KvBlocks, model: str, sequence: int, payload: bytes) -> int:
    """Apply one message to an endpoint's view; the number of events applied. ValueError when the
    payload is not a batch (the caller counts it and goes on)."""
    if not view.sequence(sequence):
        log.info("kv events: a gap before sequence %d; the view is rebuilt from here", sequence)
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # TypeError: a map keyed by an array (unhashable) is no batch either
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise ValueError("not a [timestamp, [events...]] batch")
    applied = 0
    for raw in batch[1]:
        event = _event(raw)
        if event is None:
            continue
        match event["type"]:
            case "BlockStored":
                applied += _stored(view, model, event)
            case "BlockRemoved":
                names = _names(event.get("block_hashes"))
                if names is not None:
                    try:
                        view.removed(names)
                    except TypeError:  # an unhashable name
                        continue
                    applied += 1
            case "AllBlocksCleared":
                view.reset()
                applied += 1
            case _:
                pass  # other event kinds (future ones) are not the picker's
    return applied


def _stored(view: KvBlocks, model: str, event: Mapping[str, Any]) -> int:
    names, tokens = _names(event.get("block_hashes")), event.get("token_ids")
    size = event.get("block_size")
    if names is None or not isinstance(tokens, list) or not isinstance(size, int) or size <= 0:
        return 0
    view.block_size = size
    parent_name = event.get("parent_block_hash")
    if parent_name is None:
        lora = event.get("lora_name")
        parent = seed_of(lora if isinstance(lora, str) and lora else model)
    else:
        known = view.key_of(parent_name) if isinstance(parent_name, int | bytes) else None
        if known is None:
            return 0  # its parent was missed: these blocks cannot be keyed (nor matched)
        parent = known
    try:
        keys = chain_tokens(parent, tokens, size)  # not token ids (not ints): TypeError, in C
        view.stored(names[: len(keys)], keys)
    except TypeError:
        return 0
    return 1


def _model_of(topic: bytes) -> str:
    """`kv@<ip>@<model>` -> model ("" when the topic says none)."""
    parts = topic.decode("utf-8", "replace").split("@", 2)
    return parts[2] if len(parts) == 3 else ""


class KvEvents:
    """Subscribes to every endpoint the picker routes to; feeds each endpoint's `KvBlocks`."""

    def __init__(self, pool: Pool, config: AffinityConfig, default_model: str = "") -> None:
        self._pool = pool
        self._config = config
        self._default_model = default_model
        self._context = zmq.asyncio.Context()
        self._followers: dict[str, asyncio.Task[None]] = {}  # address -> its socket's reader
        self._changed = asyncio.Event()
        self.messages = 0
        self.bad = 0
        self.rejected: Counter[str] = Counter()  # messages refused whole, by reason
        self.restarts = 0  # readers replaced after they died
        pool.on_change(self._changed.set)
        pool.on_forget(lambda address: self._changed.set())

    def _url(self, address: str) -> str:
        host, port = parse_address(address)
        offset = self._config.kv_events_port_offset
        kv_port = port + offset if offset is not None else self._config.kv_events_port
        return f"tcp://{host}:{kv_port}"

    def reconcile(self) -> None:
        """One subscriber per endpoint the picker may route to or still finishes work on."""
        wanted = {e.address for e in self._pool.endpoints() if e.state is not EndpointState.GONE}
        for address in list(self._followers):
            if address not in wanted:
                self._followers.pop(address).cancel()
            elif self._followers[address].done():  # its reader died (a socket error): a new one
                self._followers.pop(address)
                self.restarts += 1
        for address in wanted - self._followers.keys():
            endpoint = self._pool.get(address)
            if endpoint is not None and endpoint.kv is None:
                endpoint.kv = KvBlocks()
            task = asyncio.create_task(self._follow(address), name=f"kv-events {address}")
            task.add_done_callback(self._ended)
            self._followers[address] = task

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A reader ended: if not cancelled, it died; the next reconcile (after a pause) replaces it."""
        if not task.cancelled() and task.exception() is not None:
            log.warning("kv events reader %s failed: %r; restarting it", task.get_name(), task.exception())
            asyncio.get_running_loop().call_later(_RESTART_AFTER_S, self._changed.set)

    async def run(self) -> None:
        """Forever: follow the pool's endpoints (each socket read by a task of its own)."""
        try:
            while True:
                self._changed.clear()
                self.reconcile()
                await self._changed.wait()
        finally:
            for task in self._followers.values():
                task.cancel()
            await asyncio.gather(*self._followers.values(), return_exceptions=True)
            self._followers.clear()
            self._context.term()

    async def _follow(self, address: str) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.SUBSCRIBE, self._config.kv_events_topic.encode())
        socket.connect(self._url(address))
        try:
            while True:
                frames = await socket.recv_multipart()
                self._message(address, frames)
        finally:
            socket.close(0)

    def _message(self, address: str, frames: Sequence[bytes]) -> None:
        self.messages += 1
        endpoint = self._pool.get(address)
        if endpoint is None or endpoint.kv is None:
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self._refuse("bad-frames", address, f"{len(frames)} frames")
            return
        model = _model_of(frames[0]) or self._default_model
        try:
            apply_batch(endpoint.kv, model, int.from_bytes(frames[1], "big"), frames[2])
        except ValueError as exc:
            self._refuse("not-a-batch", address, str(exc))
        except Exception as exc:  # whatever an engine sends must not end its reader
            self._refuse("failed", address, repr(exc))

    def _refuse(self, reason: str, address: str, detail: str) -> None:
        self.bad += 1
        self.rejected[reason] += 1
        if self.bad == 1 or self.bad % 1000 == 0:
            log.warning("kv events from %s: %s (%d bad messages)", address, detail[:200], self.bad)
