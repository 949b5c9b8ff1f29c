"""A client connection's next request ends its last (picker/pool/connections.py): several pickers
stop counting a request whose HTTP/1.x connection already carries a newer one, before its end
comes round from the picker that observed it, and count it exactly once that end arrives."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from picker.extproc import translate
from picker.pool import ClientConnections, Pool
from picker.scheduling import estimated_load
from tests.unit.peers.test_peering import LAST, REQUEST, Picker, deliver

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"


def pool() -> Pool:
    p = Pool(clock=lambda: 0.0)
    p.apply(ready=[E1, E2])
    return p


def superseded(p: Pool, address: str) -> int:
    endpoint = p.get(address)
    assert endpoint is not None
    return endpoint.superseded


def test_a_newer_request_on_the_connection_supersedes_the_last_until_its_end_arrives() -> None:
    p = pool()
    connections = ClientConnections(p)
    connections.placed("q", "client:1>envoy:80", E1)
    connections.arrived("client:1>envoy:80", "r")
    assert superseded(p, E1) == 1 and connections.total == 1
    connections.placed("r", "client:1>envoy:80", E2)  # r's own pick: q is superseded once, r not at all
    assert superseded(p, E1) == 1 and superseded(p, E2) == 0 and connections.total == 1
    connections.ended("q")
    assert superseded(p, E1) == 0
    connections.ended("q")  # told twice (the observer's picker, then the owner): nothing more
    assert superseded(p, E1) == 0 and len(connections) == 1


def test_other_connections_and_ended_requests_supersede_nothing() -> None:
    p = pool()
    connections = ClientConnections(p)
    connections.placed("q", "client:1>envoy:80", E1)
    connections.arrived("client:2>envoy:80", "r")  # another client connection
    connections.arrived("client:1>other-envoy:80", "s")  # the same client port to another Envoy
    assert superseded(p, E1) == 0
    connections.ended("q")
    connections.arrived("client:1>envoy:80", "t")  # q's end came first: nothing left to supersede
    assert superseded(p, E1) == 0 and connections.total == 0


def test_a_superseded_request_moved_by_envoy_is_uncounted_where_it_went() -> None:
    p = pool()
    connections = ClientConnections(p)
    connections.placed("q", "c", E1)
    connections.arrived("c", "r")
    connections.moved("q", E2)
    assert (superseded(p, E1), superseded(p, E2)) == (0, 1)
    connections.ended("q")
    assert superseded(p, E2) == 0


def test_the_load_estimate_leaves_out_the_superseded() -> None:
    p = pool()
    endpoint = p.get(E1)
    assert endpoint is not None
    endpoint.peer_in_flight = 3
    endpoint.superseded = 1
    assert estimated_load(endpoint) == 2


def test_a_pick_on_another_picker_frees_the_slot_before_the_end_comes_round() -> None:
    """Picker A routed four requests, two per replica; one of them ended on the replica picker B
    would not choose on a tie, and its end has not reached B yet. The client's next request on
    that connection reaches B: B counts the slot free and picks the replica that has it."""
    a, b = Picker("10.1.0.1:9004"), Picker("10.1.0.2:9004")
    records = [a.path.admit(REQUEST, connection=f"client:{i}>envoy:80").payload for i in range(4)]
    deliver(a, b)
    order = b.peering.stagger.order([E1, E2])
    unpreferred = max((E1, E2), key=lambda address: order[address])  # B's second choice on a tie
    ended = next(r for r in records if r.picked[0] == unpreferred)
    assert ended.connection is not None
    nxt = b.path.admit(REQUEST, connection=ended.connection).payload
    assert nxt.picked[0] == unpreferred
    b.metrics.register_peers(b.peering)
    assert b.metrics.registry.get_sample_value("picker_peer_superseded_total") == 1
    deliver(a, b)  # B's pick reaches A, which stops counting the superseded one too
    assert superseded(a.pool, unpreferred) == 1
    observer = a.path.attach_observer(ended.request_id)  # its end arrives at last
    assert observer is not None
    a.path.response_started(observer, 200, unpreferred, True)
    a.path.body_chunk(observer, LAST)
    a.path.observer_ended(observer, True)
    deliver(a, b)
    for picker in (a, b):
        endpoint = picker.pool.get(unpreferred)
        assert endpoint is not None and endpoint.superseded == 0
        assert endpoint.in_flight + endpoint.peer_in_flight == 2  # the other one, and the new one


def test_without_a_connection_a_tie_goes_the_pickers_own_way() -> None:
    """The control: the same pick without the connection goes to B's first choice."""
    a, b = Picker("10.1.0.1:9004"), Picker("10.1.0.2:9004")
    for i in range(4):
        a.path.admit(REQUEST, connection=f"client:{i}>envoy:80")
    deliver(a, b)
    order = b.peering.stagger.order([E1, E2])
    preferred = min((E1, E2), key=lambda address: order[address])
    assert b.path.admit(REQUEST).payload.picked[0] == preferred


def _attributes(**fields: str) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    struct = struct_pb2.Struct()
    struct.update(fields)
    request.attributes["envoy.filters.http.ext_proc"].CopyFrom(struct)
    return request


def test_the_connection_comes_from_envoys_attributes_for_http1_only() -> None:
    http1 = {"source.address": "10.2.0.7:51234", "destination.address": "10.3.0.1:8080"}
    assert (
        translate.client_connection(_attributes(**http1, **{"request.protocol": "HTTP/1.1"}))
        == "10.2.0.7:51234>10.3.0.1:8080"
    )
    assert translate.client_connection(_attributes(**http1, **{"request.protocol": "HTTP/2"})) is None
    assert translate.client_connection(_attributes(**http1)) is None  # not configured: no protocol
    assert translate.client_connection(ep.ProcessingRequest()) is None
