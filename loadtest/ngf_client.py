"""An ext_proc client that asks the picker exactly as NGINX Gateway Fabric's endpoint-picker shim does.

NGF is not Envoy: its NJS module hands each request to a small Go shim, which for every request opens
a new gRPC connection to the picker (TLS without verifying the certificate by default, or plaintext),
sends `RequestHeaders` (end_of_stream false, values in the `value` string field, no pseudo-headers, no
`protocol_config`), then the whole body as one `RequestBody` with end_of_stream true, half-closes,
and reads responses until the stream ends. Only the `RequestHeaders` response's header mutation (the
`x-gateway-destination-endpoint` header) or an `ImmediateResponse` matters to it; it never sends a
response phase. Certificate verification is the client's own choice and does not change the bytes
on the wire, so the "skip verify" client here trusts the certificate the picker presents.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc._cython import cygrpc

from picker.contract import headers


@dataclass(frozen=True, slots=True)
class Answer:
    """What the shim makes of the picker's answers."""

    endpoint: str | None  # the header of the RequestHeaders response's mutation
    status: int | None  # an ImmediateResponse's status
    reason: str | None  # its x-picker-dropped-reason header
    kinds: tuple[str, ...]  # every response kind, in order (the stream ended after the last)
    seconds: float  # from opening the connection to the end of the stream


def request_messages(
    body: bytes, extra_headers: Mapping[str, str] | None = None
) -> Iterator[ep.ProcessingRequest]:
    pairs = {"content-type": "application/json", "content-length": str(len(body)), **(extra_headers or {})}
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, value=v) for k, v in pairs.items()])
    yield ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map, end_of_stream=False))
    yield ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


def _header(mutation: ep.HeaderMutation, name: str) -> str | None:
    for option in mutation.set_headers:
        if option.header.key.lower() == name:
            return option.header.raw_value.decode() if option.header.raw_value else option.header.value
    return None


class ShimClient:
    """One picker address; `ask()` opens a fresh connection per request, as the shim does."""

    def __init__(self, address: str, *, tls: bool, session_cache: bool = False, timeout_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self._credentials: grpc.ChannelCredentials | None = None
        self._options: list[tuple[str, object]] = []
        if tls:
            host, port = address.rsplit(":", 1)
            pem = ssl.get_server_certificate((host, int(port))).encode()
            self._credentials = grpc.ssl_channel_credentials(root_certificates=pem)
            self._options.append(("grpc.ssl_target_name_override", "localhost"))
            if session_cache:  # what the shim would gain from TLS session resumption
                # grpcio's own client-side session cache (the object grpc.experimental once wrapped)
                self._options.append(("grpc.ssl_session_cache", cygrpc.SSLSessionCacheLRU(64)))

    def _channel(self) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(self.address, options=self._options)
        return grpc.secure_channel(self.address, self._credentials, options=self._options)

    def ask(self, body: bytes, extra_headers: Mapping[str, str] | None = None) -> Answer:
        started = time.perf_counter()
        endpoint = reason = None
        status = None
        kinds: list[str] = []
        with self._channel() as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            for response in stub.Process(request_messages(body, extra_headers), timeout=self.timeout_s):
                kind = response.WhichOneof("response") or ""
                kinds.append(kind)
                if kind == "request_headers" and endpoint is None:
                    endpoint = _header(response.request_headers.response.header_mutation, headers.DESTINATION)
                elif kind == "immediate_response":
                    status = response.immediate_response.status.code
                    reason = _header(response.immediate_response.headers, headers.DROPPED_REASON)
        return Answer(endpoint, status, reason, tuple(kinds), time.perf_counter() - started)
