"""Envoy's pool cluster over xDS EDS, from the picker's own pool view.

Why: with a STATIC pool cluster, Envoy's fallback (failOpen with the picker down, or a list the picker
did not send) round-robins over every replica it was configured with, draining and gone ones too.
Served from the pool, Envoy's cluster says what the picker knows, and Envoy keeps the last view it
received when the picker goes away: READY -> HEALTHY, DRAINING -> DRAINING, NOT_READY -> UNHEALTHY,
GONE -> DRAINING while its last requests run, then removed (the cluster sets
ignore_health_on_host_removal: true so Envoy drops a removed host at once).

State-of-the-world `StreamEndpoints` (no ADS): each stream gets the current assignment for the
cluster names it asks for, then every new version. A version is `<boot>-<n>`, so a restarted
picker's versions never look like the last one's; each response has a fresh nonce. An ACK records
the version a stream holds; a NACK (error_detail set) is logged and the stream keeps the last ACKed
version until the view changes again. Changes are debounced; a periodic resync also catches GONE
endpoints forgotten when their last request ends (the pool announces no change for that).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2 as components
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2

from picker.config.model import parse_address
from picker.pool import EndpointState, Pool

log = logging.getLogger(__name__)

TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
FIRST = asyncio.FIRST_COMPLETED
_HEALTH = {
    EndpointState.READY: health_check_pb2.HEALTHY,
    EndpointState.DRAINING: health_check_pb2.DRAINING,
    EndpointState.NOT_READY: health_check_pb2.UNHEALTHY,
    EndpointState.GONE: health_check_pb2.DRAINING,  # still finishing requests; removed once it ends
}

Snapshot = tuple[tuple[str, int], ...]  # (address, HealthStatus), sorted


def snapshot_of(pool: Pool) -> Snapshot:
    """The pool as Envoy's cluster should see it (GONE endpoints stay until forgotten)."""
    return tuple(sorted((e.address, _HEALTH[e.state]) for e in pool.endpoints()))


def assignment(cluster: str, snapshot: Snapshot) -> endpoint_pb2.ClusterLoadAssignment:
    lb_endpoints = []
    for address, health in snapshot:
        host, port = parse_address(address)
        socket = address_pb2.SocketAddress(address=host, port_value=port)
        lb_endpoints.append(
            components.LbEndpoint(
                endpoint=components.Endpoint(address=address_pb2.Address(socket_address=socket)),
                health_status=health,
            )
        )
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster, endpoints=[components.LocalityLbEndpoints(lb_endpoints=lb_endpoints)]
    )


@dataclass(frozen=True, slots=True)
class Version:
    label: str
    snapshot: Snapshot
    number: int = 0  # the n of `<boot>-<n>`: later versions have larger numbers


class EndpointPublisher:
    """The current version of the pool's assignment; streams wait on `changed()`."""

    def __init__(
        self, pool: Pool, *, debounce_s: float, resync_s: float, hold: Callable[[], bool] = lambda: False
    ) -> None:
        self._pool = pool
        self._debounce_s = debounce_s
        self._resync_s = resync_s
        self._hold = hold  # True while the source cannot be trusted: keep Envoy's last view
        self._boot = format(int(time.time() * 1000) % 10**10, "x")
        self._counter = itertools.count(1)
        self._version: Version | None = None
        self._changed = asyncio.Event()
        self._pending: asyncio.TimerHandle | None = None
        pool.on_change(self._soon)

    @property
    def current(self) -> Version | None:
        return self._version

    def number_of(self, label: str) -> int:
        """The number of one of this picker's version labels; 0 for another boot's (or none)."""
        boot, _, number = label.rpartition("-")
        return int(number) if boot == self._boot and number.isdigit() else 0

    def refresh(self) -> bool:
        """Take a new version when the pool's view differs from the current one."""
        self._pending = None
        if self._hold():
            return False
        snapshot = snapshot_of(self._pool)
        if self._version is not None and snapshot == self._version.snapshot:
            return False
        number = next(self._counter)
        self._version = Version(f"{self._boot}-{number}", snapshot, number)
        self._changed.set()
        self._changed = asyncio.Event()
        log.info("eds version=%s endpoints=%d", self._version.label, len(snapshot))
        return True

    async def changed(self, seen: Version | None) -> Version | None:
        """The current version once it is not `seen`."""
        while self._version is seen or self._version is None:
            await self._changed.wait()
        return self._version

    async def run(self) -> None:
        """Forever: resync (catches endpoints forgotten without a change announcement)."""
        self.refresh()
        while True:
            await asyncio.sleep(self._resync_s)
            self.refresh()

    def _soon(self) -> None:
        if self._pending is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a change outside the loop (startup): the first refresh takes it
        self._pending = loop.call_later(self._debounce_s, self.refresh)


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """envoy.service.endpoint.v3.EndpointDiscoveryService over the picker's pool."""

    def __init__(self, publisher: EndpointPublisher) -> None:
        self._publisher = publisher
        self._nonces = itertools.count(1)
        self.streams = 0  # open streams (tests and logs)
        self.acks = 0
        self.requests = 0
        self.nacks = 0
        # the version number each open stream (that named its clusters) last ACKed; `propagate` waits on it
        self._acked: dict[int, int] = {}
        self._ack_seen = asyncio.Event()
        self._stream_ids = itertools.count(1)

    async def propagate(self, timeout_s: float) -> tuple[bool, int]:
        """Push the pool's view now (no debounce) and wait until every open stream has ACKed it.

        (held by all, open streams): the admin API answers a drain with it, so an operator (or a
        preStop hook) knows whether Envoy's own view, which outlives the picker, carries the drain.
        False after `timeout_s`, or when the view cannot be pushed (the source is held untrusted).
        """
        self._publisher.refresh()
        version = self._publisher.current
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if version is None:
                return not self._acked, len(self._acked)
            behind = [stream for stream, acked in self._acked.items() if acked < version.number]
            if not behind:
                return True, len(self._acked)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False, len(self._acked)
            try:
                await asyncio.wait_for(self._ack_seen.wait(), remaining)
            except TimeoutError:
                return False, len(self._acked)
            version = self._publisher.current  # a later change supersedes: wait for that one

    def _acked_now(self, stream: int, number: int | None) -> None:
        if number is None:
            self._acked.pop(stream, None)
        else:
            self._acked[stream] = max(number, self._acked.get(stream, 0))
        self._ack_seen.set()
        self._ack_seen = asyncio.Event()

    async def StreamEndpoints(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await requests.put(request)
            finally:
                await requests.put(None)

        reader = asyncio.create_task(read(), name="eds-reader")
        names: tuple[str, ...] = ()
        sent: Version | None = None  # the version of the last response on this stream
        nonce = ""
        stream = next(self._stream_ids)
        self.streams += 1
        getter: asyncio.Task[discovery_pb2.DiscoveryRequest | None] | None = None
        waiter: asyncio.Task[Version | None] | None = None  # only once the stream names its clusters
        try:
            while True:
                if getter is None:
                    getter = asyncio.create_task(requests.get())
                if waiter is None and names:
                    waiter = asyncio.create_task(self._publisher.changed(sent))
                await asyncio.wait([t for t in (getter, waiter) if t is not None], return_when=FIRST)
                resend = False
                if getter.done():
                    request, getter = getter.result(), None
                    if request is None:
                        return  # Envoy closed the stream
                    resend = self._take(request, nonce, names)
                    if tuple(request.resource_names) != names:
                        names = tuple(request.resource_names)
                        resend = True
                    if names:
                        acked = "" if request.HasField("error_detail") else request.version_info
                        self._acked_now(stream, self._publisher.number_of(acked))
                if waiter is not None and waiter.done():
                    waiter = None
                version = self._publisher.current
                if version is None or not names or not (resend or version is not sent):
                    continue
                nonce = str(next(self._nonces))
                sent = version
                if waiter is not None:  # it waits for a version other than the previous one
                    waiter.cancel()
                    waiter = None
                yield discovery_pb2.DiscoveryResponse(
                    version_info=version.label,
                    resources=[_packed(assignment(name, version.snapshot)) for name in names],
                    type_url=TYPE_URL,
                    nonce=nonce,
                )
        finally:
            self.streams -= 1
            self._acked_now(stream, None)
            for task in (getter, waiter, reader):
                if task is not None:
                    task.cancel()

    def _take(self, request: discovery_pb2.DiscoveryRequest, nonce: str, names: tuple[str, ...]) -> bool:
        """Account for one request; True when it asks for a response now (first one on the stream)."""
        self.requests += 1
        if not request.response_nonce:
            log.info(
                "eds stream opened node=%s clusters=%s last_version=%s",
                request.node.id or "-",
                ",".join(request.resource_names),
                request.version_info or "-",
            )
            return True
        if request.response_nonce != nonce:
            return False  # about an older response: superseded
        if request.HasField("error_detail"):
            self.nacks += 1
            log.warning(
                "eds NACK nonce=%s kept_version=%s error=%.300s",
                nonce,
                request.version_info or "-",
                request.error_detail.message,
            )
        else:
            self.acks += 1
            log.debug("eds ACK version=%s clusters=%s", request.version_info, ",".join(names))
        return False


def _packed(message: endpoint_pb2.ClusterLoadAssignment) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def add_eds_to_server(service: EndpointDiscovery, server: grpc.aio.Server) -> None:
    """Serve EDS on an existing (not yet started) server: the ext_proc port Envoy already reaches."""
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(service, server)
