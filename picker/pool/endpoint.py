"""One model-server endpoint as the picker sees it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from picker.pool.cache import KvBlocks, PrefixIndex
from picker.pool.drain import DrainRecord
from picker.pool.load import LoadSample
from picker.pool.roles import Role
from picker.pool.served import Served


class EndpointState(enum.Enum):
    """Only READY endpoints are ever picked; the others are kept while requests are still in flight."""

    READY = "ready"
    DRAINING = "draining"  # shutting down: finishing its in-flight work, never given new work
    NOT_READY = "not-ready"  # listed but neither ready nor draining (starting up, failing probes)
    GONE = "gone"  # no longer listed by the source; kept only until its last request ends


@dataclass(slots=True)
class Endpoint:
    address: str
    state: EndpointState
    since: float
    in_flight: int = 0
    picks: int = 0
    load: LoadSample | None = None  # last good scrape; None until the first one
    scrape_failures: int = 0  # consecutive; reset by a good scrape
    learned_slots: int = 0  # running count seen while the engine had a queue: its slot count
    arrivals: int = 0  # requests ever attributed here (picked, or moved here by Envoy's choice)
    departures: int = 0  # requests ever ended here or moved away
    drain: DrainRecord | None = None  # the open drain record, while there is one
    cut: int = 0  # requests that ended here cut after their first token (truncated, stalled, ...)
    failed: int = 0  # requests that ended here with an upstream error (5xx, error event)
    # What the endpoint holds, for cache-aware routing (picker/pool/cache.py); dropped when GONE.
    prefix: PrefixIndex | None = None  # approximate: learned from what was routed here
    kv: KvBlocks | None = None  # precise: from the engine's KV events
    # uncached prompt tokens of the requests routed here that have not sent a first token yet:
    # the prefill backlog a new request would wait behind (the reference's in-flight token load)
    pending_prefill: float = 0.0
    peer_in_flight: int = 0  # requests other pickers have in flight here (picker/peers/books.py)
    peer_arrivals: int = 0  # of `arrivals`, those other pickers' books added
    # of the requests counted here, those a newer request on the same client connection shows have
    # ended, their end not heard yet (picker/peers/books.py): the load estimate leaves them out
    superseded: int = 0
    # its load (running + waiting, estimated) averaged over the last seconds, at `load_avg_at`: a
    # sustained imbalance, which breaks affinity, from the moment-to-moment swings, which must not
    load_avg: float = 0.0
    load_avg_at: float | None = None
    # From the engine's /metrics (vllm:cache_config_info, vllm:lora_requests_info), when it has them.
    block_size: int | None = None
    num_blocks: int | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int | None = None
    # From its model server's /v1/models (scheduling.by_model): the model names it answers to and
    # its context window; None until read (such an endpoint may take any request).
    served: Served | None = None
    # Its pod's labels (the InferencePool source) or the endpoints file's `labels:`; canary groups
    # are read from them (picker/rollout). None: its source says nothing.
    labels: Mapping[str, str] | None = None
    # Which instance stands behind the address (its pod's uid, from the InferencePool source): a
    # rollback's drain is this instance's, not the address's. None: its source does not say.
    instance: str | None = None
    # Which part of a request it serves in a prefill / decode pool, from its labels
    # (picker/pool/roles.py); None: its role label names no role, so it serves neither.
    role: Role | None = Role.BOTH
    pulls: int = 0  # of `in_flight`, prefill hand-offs whose KV no decode replica has pulled yet

    @property
    def pickable(self) -> bool:
        return self.state is EndpointState.READY
