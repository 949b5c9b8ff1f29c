"""Protobuf <-> core: the only module that builds or reads ext_proc messages."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from picker import headers
from picker.contract import Reply
from picker.streams import Attempts

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(message: ep.HttpHeaders) -> dict[str, str]:
    """Lower-cased header names to values (Envoy sends raw_value bytes; older builds use value)."""
    out: dict[str, str] = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


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
    upstream = f"{address.address}:{address.port_value}" if address.address else ""
    attempts = Attempts(
        count=max(1, common.upstream_request_attempt_count),
        flags=flags,
        status=entry.response.response_code.value,
        upstream=upstream,
    )
    return entry.request.request_headers.get(headers.PICKER_REQUEST_ID) or None, attempts


def streams_response_bodies(request: ep.ProcessingRequest) -> bool:
    """Whether this filter was configured to send the picker every response body chunk."""
    return request.HasField("protocol_config") and request.protocol_config.response_body_mode in (
        processing_mode_pb2.ProcessingMode.STREAMED,
        processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
    )


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def route_response(phase: str, destinations: Iterable[str], request_id: str) -> ep.ProcessingResponse:
    """Answer the headers or body phase with the pick, in metadata and (for ORIGINAL_DST) a header."""
    value = ",".join(destinations)
    mutation = ep.HeaderMutation(
        set_headers=[_set(headers.DESTINATION, value), _set(headers.PICKER_REQUEST_ID, request_id)]
    )
    common = ep.CommonResponse(header_mutation=mutation)
    metadata = struct_pb2.Struct()
    metadata.update({headers.LB_METADATA_NAMESPACE: {headers.DESTINATION: value}})
    if phase == "request_headers":
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def continue_response(phase: str) -> ep.ProcessingResponse:
    """Let Envoy carry on unchanged in the given phase."""
    common = ep.CommonResponse()
    match phase:
        case "request_headers":
            return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
        case "response_headers":
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))
        case "request_body":
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        case "response_body":
            return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))
        case "request_trailers":
            return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        case "response_trailers":
            return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        case _:
            raise ValueError(f"no continue response for phase {phase!r}")


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
