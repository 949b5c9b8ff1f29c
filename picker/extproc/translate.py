"""Protobuf <-> core: the only module that builds or reads ext_proc messages."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from picker.config.model import canonical_address, format_address
from picker.contract import Reply, headers
from picker.streams import Attempts

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(message: ep.HttpHeaders) -> dict[str, str]:
    """Lower-cased header names to values (Envoy sends raw_value bytes; older builds use value)."""
    out: dict[str, str] = {}
    for header in message.headers.headers:  # the value inline: a call per header costs 7 %
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def header_value(message: ep.HttpHeaders, name: str) -> str | None:
    """One header's value (`name` lower-cased), without building the whole map (`header_map`)."""
    for header in message.headers.headers:
        if header.key.lower() == name:
            return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
    return None


def served_endpoint(request: ep.ProcessingRequest) -> str | None:
    """The endpoint Envoy's override_host policy really connected to, if it reported one."""
    namespace = request.metadata_context.filter_metadata.get(headers.LB_METADATA_NAMESPACE)
    if namespace is None:
        return None
    value = namespace.fields.get(headers.DESTINATION_SERVED)
    return value.string_value or None if value is not None else None


def access_log_entry(entry: accesslog_pb2.HTTPAccessLogEntry) -> tuple[str | None, Attempts]:
    """The picker's request id and what Envoy says of the upstream side, from one access-log entry."""
    common = entry.common_properties
    flags = frozenset(field.name for field, value in common.response_flags.ListFields() if value is True)
    address = common.upstream_remote_address.socket_address
    # canonical, as endpoints are named (IPv6 in brackets): its failures are charged to the endpoint
    upstream = (
        canonical_address(format_address(address.address, address.port_value)) if address.address else ""
    )
    attempts = Attempts(
        count=max(1, common.upstream_request_attempt_count),
        flags=flags,
        status=entry.response.response_code.value,
        upstream=upstream,
    )
    return entry.request.request_headers.get(headers.PICKER_REQUEST_ID) or None, attempts


_MODE = processing_mode_pb2.ProcessingMode
BUFFERED = _MODE.BUFFERED
BUFFERED_PARTIAL = _MODE.BUFFERED_PARTIAL
STREAMED = _MODE.STREAMED
FULL_DUPLEX = _MODE.FULL_DUPLEX_STREAMED
NONE = _MODE.NONE


@dataclass(frozen=True, slots=True)
class Modes:
    """How this filter sends bodies, from the protocol_config Envoy puts on a stream's first message."""

    request_body: int = BUFFERED  # what the shipped config uses; older Envoys send no protocol_config
    response_body: int = NONE
    body_without_waiting: bool = False
    known: bool = False

    @property
    def sees_response_bodies(self) -> bool:
        return self.response_body in (STREAMED, FULL_DUPLEX)

    @property
    def holds_request_headers(self) -> bool:
        """Whether the headers answer waits for the body's end (see picker/extproc/routing.py)."""
        return self.request_body == FULL_DUPLEX


def modes(request: ep.ProcessingRequest) -> Modes:
    if not request.HasField("protocol_config"):
        return Modes()
    config = request.protocol_config
    return _known_modes(
        config.request_body_mode,
        config.response_body_mode,
        config.send_body_without_waiting_for_header_response,
    )


@functools.lru_cache(maxsize=64)  # a filter's modes are its config's: one Modes each, built once
def _known_modes(request_body: int, response_body: int, body_without_waiting: bool) -> Modes:
    return Modes(request_body, response_body, body_without_waiting, known=True)


def mode_name(mode: int) -> str:
    return _MODE.BodySendMode.Name(mode)


def subset_hint(request: ep.ProcessingRequest) -> tuple[str, ...] | None:
    """The endpoints the data plane allows for this request (EPP protocol), or None: no restriction."""
    namespace = request.metadata_context.filter_metadata.get(headers.SUBSET_HINT_NAMESPACE)
    if namespace is None or headers.DESTINATION_SUBSET not in namespace.fields:
        return None
    value = namespace.fields[headers.DESTINATION_SUBSET]
    if value.HasField("list_value"):
        return tuple(v.string_value.strip() for v in value.list_value.values if v.string_value.strip())
    return tuple(p.strip() for p in value.string_value.split(",") if p.strip())


_ONE_AT_A_TIME = frozenset({"HTTP/1.0", "HTTP/1.1"})  # protocols whose connection holds one request


def client_connection(request: ep.ProcessingRequest) -> str | None:
    """The HTTP/1.x client connection a request came on (`source>destination`, unique across
    Envoys), from the attributes the routing filter sends with its headers (its
    `request_attributes`, config/envoy.yaml); None on HTTP/2 or /3 (a connection holds many
    requests at once) or without them (picker/pool/connections.py)."""
    for attributes in request.attributes.values():
        fields = attributes.fields
        protocol = fields.get("request.protocol")
        source, destination = fields.get("source.address"), fields.get("destination.address")
        if protocol is None or source is None or destination is None:
            continue
        if protocol.string_value not in _ONE_AT_A_TIME or not source.string_value:
            return None
        return f"{source.string_value}>{destination.string_value}"
    return None


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def route_response(
    phase: str,
    destinations: Iterable[str],
    request_id: str,
    remove: Sequence[str] = (),
    extra: Sequence[tuple[str, str]] = (),
) -> ep.ProcessingResponse:
    """Answer a request phase with the pick: the same value in metadata and (for ORIGINAL_DST) a header.

    `remove` names the client's scheduling hints: they are the picker's, not the model server's.
    `extra`: headers the routed request carries (the trace context naming the picker's span).
    Built in place, field by field: nested constructors copy each level again.
    """
    value = ",".join(destinations)
    response = ep.ProcessingResponse()
    match phase:
        case "request_headers" | "request_body":
            mutation = getattr(response, phase).response.header_mutation
            for name, text in ((headers.DESTINATION, value), (headers.PICKER_REQUEST_ID, request_id), *extra):
                option = mutation.set_headers.add()
                option.header.key = name
                option.header.raw_value = text.encode()
                option.append_action = _OVERWRITE
            mutation.remove_headers.extend(remove)
        case "request_trailers":
            # A trailers answer cannot change request headers: only metadata-reading data planes route.
            response.request_trailers.SetInParent()
        case _:
            raise ValueError(f"no route response for phase {phase!r}")
    lb = response.dynamic_metadata.fields[headers.LB_METADATA_NAMESPACE].struct_value
    lb.fields[headers.DESTINATION].string_value = value
    return response


def streamed_body(phase: str, body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """FULL_DUPLEX: Envoy forwards only what the picker sends back, so every chunk goes back as is."""
    mutation = ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    )
    answer = ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
    if phase == "request_body":
        return ep.ProcessingResponse(request_body=answer)
    return ep.ProcessingResponse(response_body=answer)


def response_headers_answer(set_headers: Sequence[tuple[str, str]] = ()) -> ep.ProcessingResponse:
    """Let the response headers through, with headers added (the conformance hook's served endpoint)."""
    common = ep.CommonResponse()
    if set_headers:
        common.header_mutation.CopyFrom(ep.HeaderMutation(set_headers=[_set(k, v) for k, v in set_headers]))
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))


_CONTINUE_PHASES = frozenset(
    {
        "request_headers",
        "response_headers",
        "request_body",
        "response_body",
        "request_trailers",
        "response_trailers",
    }
)


def continue_response(phase: str) -> ep.ProcessingResponse:
    """Let Envoy carry on unchanged in the given phase (an empty answer of that phase's kind)."""
    if phase not in _CONTINUE_PHASES:
        raise ValueError(f"no continue response for phase {phase!r}")
    response = ep.ProcessingResponse()
    answer = getattr(response, phase)
    if phase.endswith("trailers"):
        answer.SetInParent()
    else:
        answer.response.SetInParent()  # headers and body answers carry an (empty) CommonResponse
    return response


def extend_timeout(seconds: float) -> ep.ProcessingResponse:
    """Ask Envoy to wait longer than its message_timeout for the next answer (the request is queued)."""
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(seconds * 1e9))
    return ep.ProcessingResponse(override_message_timeout=timeout)


def immediate_response(reply: Reply) -> ep.ProcessingResponse:
    """A local answer from the status contract; Envoy contacts no model server."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=ep.HeaderMutation(set_headers=[_set(k, v) for k, v in reply.headers()]),
            body=reply.body(),
            details=f"picker_{reply.reason}",
        )
    )
