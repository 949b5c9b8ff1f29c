"""Prefill/decode disaggregation as vLLM 0.32's NixlConnector does it in pull mode.

The hand-off, as vLLM's P/D proxy examples drive it:
1. Prefill: the request with `kv_transfer_params: {"do_remote_decode": true, ...}` (the proxies also send
   `max_tokens: 1` and `stream: false`). It runs like any request. When it finishes (length or stop) the
   replica holds its KV blocks for the decode, and its JSON body carries what the decode needs
   (`producer_params`, the fields of vLLM's `request_finished`). A streamed prefill holds its blocks too
   but carries no params: vLLM puts them in the non-streaming body only. A request that was cut holds none.
2. Decode: the same request with those params (`do_remote_prefill: true`, `remote_*`). Once it has its
   slot it pulls the blocks its own prefix cache lacks from the replica the params name
   (`POST /sim/kv/pull` on remote_host:remote_port, standing in for NIXL's side channel), which takes
   transfer_ms + transfer_per_block_ms per block; its first token follows one step later (the fixed TTFT
   part: the pulled tokens are not computed again). A failed pull (connection refused, blocks no longer
   held, the prefill stopped mid-transfer) ends the request by the load-failure policy: vLLM's default
   "fail" is its GenerationError, "recompute" computes the prompt locally.
3. The prefill frees the blocks when their pull ends (done or cut) or when the lease ends unpulled.
   Held blocks count in the prefill's KV usage, as vLLM keeps them allocated.

vLLM gates none of this on the replica's role, and neither does the simulator. Params it cannot use (a
`do_remote_prefill` without the remote_* fields) are ignored, as vLLM's connector ignores them with a
warning: the request is served with a local prefill.

Concurrency model: the replica's event loop; lease timers are loop timers the holds own and cancel.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_sim.config import DisaggConfig, Role
from vllm_sim.engine import Engine

PULL_PATH = "/sim/kv/pull"
PULL_CONNECT_TIMEOUT_S = 5.0
PULL_SLACK_S = 30.0  # beyond the transfer time, before a pull that gets no answer counts as failed
MAX_TRANSFER_S = 600.0  # a pull's transfer time is the decode's to say; the prefill caps it


class KvIntent(enum.Enum):
    REMOTE_DECODE = "remote-decode"  # this replica prefills; a decode will pull its blocks


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What a decode reads from its kv_transfer_params: where its prompt's blocks are held."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    prefill_cached_tokens: int | None = None  # the prefill's own cache hits, which the decode reports


def parse_kv_params(raw: dict[str, Any] | None) -> KvIntent | RemotePrefill | None:
    """What a request's kv_transfer_params (an object: parse_request checks it) ask; None for nothing
    usable, which vLLM serves as a plain request."""
    if raw is None:
        return None
    if raw.get("do_remote_prefill"):
        return _remote_prefill(raw)
    if raw.get("do_remote_decode"):
        return KvIntent.REMOTE_DECODE
    return None


def _remote_prefill(raw: dict[str, Any]) -> RemotePrefill | None:
    engine_id, request_id = raw.get("remote_engine_id"), raw.get("remote_request_id")
    host, port, blocks = raw.get("remote_host"), raw.get("remote_port"), raw.get("remote_block_ids")
    if not (isinstance(engine_id, str) and isinstance(request_id, str) and isinstance(host, str)):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not isinstance(blocks, list):
        return None
    # vLLM's remote_block_ids: one list per KV-cache group ([[ids...]]); a flat list is read too.
    flat = [b for group in blocks for b in (group if isinstance(group, list) else [group])]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in flat):
        return None
    cached = raw.get("remote_prefill_cached_tokens")
    if isinstance(cached, bool) or not isinstance(cached, int):
        cached = None
    return RemotePrefill(engine_id, request_id, host, port, tuple(flat), cached)


def transfer_s(config: DisaggConfig, blocks: int) -> float:
    """How long pulling `blocks` blocks takes (0 when there is nothing to pull)."""
    if blocks <= 0:
        return 0.0
    return (config.transfer_ms + config.transfer_per_block_ms * blocks) / 1000


@dataclass(slots=True)
class Held:
    """One finished prefill's blocks, waiting for their decode."""

    tokens: int
    block_ids: tuple[int, ...]
    timer: asyncio.TimerHandle | None
    pulling: bool = False


class KvHolds:
    """A replica's connector state: its engine id and role, the blocks it holds for decodes, counters."""

    def __init__(
        self,
        config: DisaggConfig,
        host: str,
        port: int,
        engine: Engine,
        block_size: int,
        role: Role | None = None,
        engine_id: str | None = None,
    ) -> None:
        self.config = config
        self.role = role or config.role
        self.engine_id = engine_id or config.engine_id or str(uuid.uuid4())
        self.host, self.port = host, port  # where this replica serves pulls
        self._engine = engine  # held blocks count in its KV usage
        self._block_size, self._num_blocks = block_size, engine.num_blocks
        self._held: dict[str, Held] = {}
        self._next_block = 0
        self.pulled = 0
        self.expired = 0
        self.pulls_failed = 0  # this replica's own pulls (as a decode) that failed

    def hold(self, request_id: str, tokens: int, cached_tokens: int) -> dict[str, Any]:
        """Keep a finished prefill's blocks for the lease; returns the params its response carries."""
        self.release(request_id)
        count = max(1, -(-tokens // self._block_size))
        # ids from 1: vLLM's block 0 is its null block
        usable = max(1, self._num_blocks - 1)
        ids = tuple(1 + (self._next_block + i) % usable for i in range(count))
        self._next_block = (self._next_block + count) % usable
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.config.kv_lease_s, self._expire, request_id)
        self._held[request_id] = Held(tokens, ids, timer)
        self._engine.hold_tokens(tokens)
        return self.producer_params(request_id, ids, tokens, cached_tokens)

    def take(self, engine_id: str, request_id: str) -> Held | None:
        """Start a pull: the blocks, now kept until `release`; None when not held here (any more)."""
        held = self._held.get(request_id)
        if engine_id != self.engine_id or held is None or held.pulling:
            return None
        held.pulling = True
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        return held

    def release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        self._engine.free_tokens(held.tokens)

    def producer_params(
        self, request_id: str, block_ids: tuple[int, ...], tokens: int, cached_tokens: int
    ) -> dict[str, Any]:
        """The fields vLLM's NixlConnector (pull mode) returns from a prefill's `request_finished`, in its
        order, then the prefill's cache hits that its scheduler adds (remote_prefill_cached_tokens).
        remote_host/remote_port name this replica's HTTP address, where the simulator serves pulls (vLLM
        names its NIXL side channel, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, default localhost:5600)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens,
        }

    def _expire(self, request_id: str) -> None:
        held = self._held.get(request_id)
        if held is not None and not held.pulling:
            held.timer = None
            self.expired += 1
            self.release(request_id)

    def clear(self) -> None:
        for request_id in list(self._held):
            self.release(request_id)

    def snapshot(self) -> dict[str, Any]:
        """The admin view (GET /sim/state): vLLM exports no gauge of blocks held for decodes."""
        return {
            "role": self.role.value,
            "engine_id": self.engine_id,
            "held_requests": len(self._held),
            "held_tokens": sum(h.tokens for h in self._held.values()),
            "pulling": sum(1 for h in self._held.values() if h.pulling),
            "pulled": self.pulled,
            "expired": self.expired,
            "pulls_failed": self.pulls_failed,
        }


async def pull(remote: RemotePrefill, blocks: int, duration_s: float) -> bool:
    """Pull `blocks` blocks from the prefill the params name, over a connection that lasts the transfer;
    False when it fails (refused, not held, cut, no answer in time)."""
    url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
    body = {
        "remote_engine_id": remote.engine_id,
        "remote_request_id": remote.request_id,
        "blocks": blocks,
        "transfer_ms": duration_s * 1000,
    }
    timeout = aiohttp.ClientTimeout(total=duration_s + PULL_SLACK_S, connect=PULL_CONNECT_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, json=body) as response,
        ):
            await response.read()
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
