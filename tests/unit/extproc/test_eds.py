"""The EDS server over a real gRPC stream: state mapping, versions and nonces, ACK / NACK, pushes on
pool changes, GONE endpoints leaving once their last request ends, holding while the source is
untrusted, and a restarted picker resending its view."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.rpc import status_pb2

from picker.extproc.eds import TYPE_URL, EndpointDiscovery, EndpointPublisher, add_eds_to_server
from picker.pool import EndpointState, Pool

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
HEALTHY, DRAINING, UNHEALTHY = health_check_pb2.HEALTHY, health_check_pb2.DRAINING, health_check_pb2.UNHEALTHY
WAIT_S = 5.0  # a broken server misses this by forever, a working one by milliseconds


class Picker:
    """One EDS server on loopback over a pool."""

    def __init__(self, pool: Pool, hold: Callable[[], bool] = lambda: False) -> None:
        self.publisher = EndpointPublisher(pool, debounce_s=0.01, resync_s=0.05, hold=hold)
        self.service = EndpointDiscovery(self.publisher)
        self.server = grpc.aio.server()
        add_eds_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Picker:
        await self.server.start()
        self.task = asyncio.create_task(self.publisher.run())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await self.server.stop(0)


class Envoy:
    """The client side of one StreamEndpoints stream, as Envoy drives it."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self.call = eds_pb2_grpc.EndpointDiscoveryServiceStub(self.channel).StreamEndpoints(self._send())

    async def _send(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    def ask(
        self, version: str = "", nonce: str = "", error: str = "", names: tuple[str, ...] = ("pool",)
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            version_info=version, resource_names=names, type_url=TYPE_URL, response_nonce=nonce
        )
        request.node.id = "test-envoy"
        if error:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        self.requests.put_nowait(request)

    async def response(self) -> discovery_pb2.DiscoveryResponse:
        return await asyncio.wait_for(self.call.read(), WAIT_S)  # type: ignore[return-value]

    async def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        await self.channel.close()


def hosts(response: discovery_pb2.DiscoveryResponse) -> dict[str, int]:
    (resource,) = response.resources
    assignment = endpoint_pb2.ClusterLoadAssignment()
    assert resource.Unpack(assignment)
    assert assignment.cluster_name == "pool"
    return {
        f"{lb.endpoint.address.socket_address.address}:{lb.endpoint.address.socket_address.port_value}": (
            lb.health_status
        )
        for locality in assignment.endpoints
        for lb in locality.lb_endpoints
    }


@contextlib.asynccontextmanager
async def connected(pool: Pool, **options: Callable[[], bool]) -> AsyncIterator[tuple[Picker, Envoy]]:
    """An EDS server over `pool` and an Envoy-like stream to it, the stream closed after the block."""
    async with Picker(pool, **options) as picker:
        envoy = Envoy(picker.port)
        try:
            yield picker, envoy
        finally:
            await envoy.close()


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():  # noqa: ASYNC110 (a poll with a deadline, on counters of the server)
            await asyncio.sleep(0.01)


async def test_states_map_to_health_and_changes_are_pushed_as_new_versions() -> None:
    pool = Pool()
    pool.reconcile({A: EndpointState.READY, B: EndpointState.DRAINING, C: EndpointState.NOT_READY}, "test")
    async with connected(pool) as (picker, envoy):
        envoy.ask()
        first = await envoy.response()
        assert first.type_url == TYPE_URL and first.nonce
        assert hosts(first) == {A: HEALTHY, B: DRAINING, C: UNHEALTHY}
        envoy.ask(first.version_info, first.nonce)  # ACK
        await until(lambda: picker.service.acks == 1)

        lease = pool.lease(A)
        pool.set_state(A, EndpointState.GONE)  # no longer listed, one request still running
        second = await envoy.response()
        assert second.version_info != first.version_info and second.nonce != first.nonce
        assert hosts(second) == {A: DRAINING, B: DRAINING, C: UNHEALTHY}
        envoy.ask(second.version_info, second.nonce)

        lease.release()  # its last request ended: forgotten, so removed from Envoy's view
        third = await envoy.response()
        assert hosts(third) == {B: DRAINING, C: UNHEALTHY}


async def test_nack_is_counted_and_the_version_is_not_resent() -> None:
    pool = Pool()
    pool.apply(ready=[A])
    async with connected(pool) as (picker, envoy):
        envoy.ask()
        first = await envoy.response()
        envoy.ask("", first.nonce, error="rejected for the test")  # NACK: nothing accepted yet
        await until(lambda: picker.service.nacks == 1)
        pool.apply(ready=[A, B])
        second = await envoy.response()  # the next response is the new view, not the NACKed one
        assert hosts(second) == {A: HEALTHY, B: HEALTHY}
        assert second.version_info != first.version_info


async def test_stale_nonce_is_ignored() -> None:
    pool = Pool()
    pool.apply(ready=[A])
    async with connected(pool) as (picker, envoy):
        envoy.ask()
        first = await envoy.response()
        pool.apply(ready=[A, B])
        second = await envoy.response()
        envoy.ask(first.version_info, first.nonce, error="late NACK of the older response")
        envoy.ask(second.version_info, second.nonce)
        await until(lambda: picker.service.acks == 1)
        assert picker.service.nacks == 0


async def test_holds_while_the_source_is_untrusted() -> None:
    pool = Pool()
    untrusted = True
    async with connected(pool, hold=lambda: untrusted) as (picker, envoy):
        envoy.ask()
        await until(lambda: picker.service.requests == 1)  # taken: an answer would be on its way
        pool.apply(ready=[D])
        untrusted = False
        # The first answer is the trusted view: the empty one was never sent to replace Envoy's.
        assert hosts(await envoy.response()) == {D: HEALTHY}


async def test_restarted_picker_resends_its_view() -> None:
    pool = Pool()
    pool.apply(ready=[A], draining=[B])
    async with Picker(pool) as picker:
        envoy = Envoy(picker.port)
        envoy.ask()
        before = await envoy.response()
        envoy.ask(before.version_info, before.nonce)
        await envoy.close()
    restarted_pool = Pool()
    restarted_pool.apply(ready=[A], draining=[B])
    async with connected(restarted_pool) as (_, envoy):
        envoy.ask(version=before.version_info)  # a new stream from an Envoy holding the old view
        after = await envoy.response()
        assert hosts(after) == {A: HEALTHY, B: DRAINING}
        assert after.version_info != before.version_info


@pytest.mark.parametrize("names", [("pool",), ("pool", "other")])
async def test_every_requested_cluster_gets_the_pool(names: tuple[str, ...]) -> None:
    pool = Pool()
    pool.apply(ready=[A])
    async with connected(pool) as (_, envoy):
        envoy.ask(names=names)
        response = await envoy.response()
        assert len(response.resources) == len(names)


async def test_a_burst_of_changes_is_one_push() -> None:
    pool = Pool()
    pool.apply(ready=[A])
    async with connected(pool) as (_, envoy):
        envoy.ask()
        first = await envoy.response()
        envoy.ask(first.version_info, first.nonce)
        for address in (B, C, D):  # three changes within one debounce interval
            pool.apply(ready=[A, address])
        pool.apply(ready=[A, B, C, D])
        second = await envoy.response()
        assert hosts(second) == {A: HEALTHY, B: HEALTHY, C: HEALTHY, D: HEALTHY}
        counter = int(second.version_info.rsplit("-", 1)[1]) - int(first.version_info.rsplit("-", 1)[1])
        assert counter == 1, "one version for the whole burst"


async def test_a_change_can_wait_until_every_stream_acked_it() -> None:
    pool = Pool()
    pool.apply(ready=[A, B])
    async with connected(pool) as (picker, envoy):
        envoy.ask()
        first = await envoy.response()
        envoy.ask(first.version_info, first.nonce)
        await until(lambda: picker.service.acks == 1)
        pool.drain(A)
        waiting = asyncio.create_task(picker.service.propagate(timeout_s=WAIT_S))
        pushed = await envoy.response()  # pushed at once, not after the debounce
        assert hosts(pushed)[A] == DRAINING
        await asyncio.sleep(0)
        assert not waiting.done()  # not held until Envoy says so
        envoy.ask(pushed.version_info, pushed.nonce)
        assert await waiting == (True, 1)


async def test_waiting_for_an_ack_has_a_deadline_and_says_so() -> None:
    pool = Pool()
    pool.apply(ready=[A, B])
    async with connected(pool) as (picker, envoy):
        envoy.ask()
        first = await envoy.response()
        envoy.ask(first.version_info, first.nonce)
        await until(lambda: picker.service.acks == 1)
        pool.drain(A)
        assert await picker.service.propagate(timeout_s=0.2) == (False, 1)  # never ACKed
    assert await picker.service.propagate(timeout_s=0.2) == (True, 0)  # no stream: nothing to wait for
