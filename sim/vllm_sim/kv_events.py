"""vLLM's KV-cache events, published as vLLM 0.32 publishes them (`--kv-events-config`, publisher zmq).

A ZMQ PUB socket bound to `tcp://HOST:PORT` (vLLM's `tcp://*:5557` form: subscribers connect). Each
message is three frames: the topic (`kv@<ip>@<model>`), an 8-byte big-endian sequence number (one per
batch, from 0), and a msgpack batch `[timestamp, [events...]]`. Events are maps with a `type`, as the
real server's decoded on this machine: `BlockStored` (`block_hashes`, `parent_block_hash`,
`token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, `extra_keys`; vLLM 0.32 adds `group_idx`
and `kv_cache_spec_kind`, tests/realvllm/test_prefix_cache.py), `BlockRemoved` (`block_hashes`,
`medium`) and `AllBlocksCleared`. PUB never blocks: a slow subscriber loses messages, and sees the gap in the
sequence numbers.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

from vllm_sim.prefix import Stored


class KvEventPublisher:
    def __init__(self, host: str, port: int, model: str, block_size: int) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
        self._socket.bind(f"tcp://{host}:{port}")
        self.topic = f"kv@{host}@{model}".encode()
        self._block_size = block_size
        self.sequence = 0
        self.batches = 0

    def stored(self, stored: Stored) -> None:
        """One batch for one prompt's cache changes (nothing is sent when nothing changed)."""
        events: list[dict[str, Any]] = [
            {
                "type": "BlockStored",
                "block_hashes": segment.hashes,
                "parent_block_hash": segment.parent,
                "token_ids": segment.token_ids,
                "block_size": self._block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": None,
            }
            for segment in stored.segments
        ]
        if stored.removed:
            events.append({"type": "BlockRemoved", "block_hashes": stored.removed, "medium": "GPU"})
        if events:
            self._send(events)

    def cleared(self) -> None:
        self._send([{"type": "AllBlocksCleared"}])

    def skip(self, count: int) -> None:
        """Lose `count` batches (a fault for tests: the subscriber must notice the gap)."""
        self.sequence += count

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([time.time(), events])
        self._socket.send_multipart(
            [self.topic, self.sequence.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
        )
        self.sequence += 1
        self.batches += 1

    def close(self) -> None:
        self._socket.close(0)
