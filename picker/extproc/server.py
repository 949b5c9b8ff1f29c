"""gRPC servers: ext_proc for Envoy, and gRPC health for kubelet probes and load balancers."""

from __future__ import annotations

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.extproc.access_log import AccessLogService
from picker.extproc.service import ExtProcService

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
# The name the reference charts' kubelet probes and the GIE conformance suite ask for.
INFERENCE_EXTENSION = "inference-extension"
# Answer with readiness semantics: NOT_SERVING from the start of the picker's shutdown.
_READY_NAMES = ("", READINESS, EXT_PROC_SERVICE, INFERENCE_EXTENSION)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthState:
    """The picker's health as its service names report it (liveness, and the readiness ones)."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        # why not ready: "source", "standby" (not the leader), "peers" (not linked yet), "stopping"
        self.holds: set[str] = set()

    async def serving(self) -> None:
        """Alive; ready unless something holds readiness."""
        await self.servicer.set(LIVENESS, _SERVING)
        await self._apply()

    async def not_ready(self) -> None:
        """Draining: load balancers should stop sending new streams; liveness stays SERVING. For good."""
        self.holds.add("stopping")
        await self._apply()

    async def hold(self, why: str, held: bool) -> None:
        """Readiness is SERVING only while nothing holds it (`why` on or off)."""
        if held:
            self.holds.add(why)
        else:
            self.holds.discard(why)
        await self._apply()

    async def _apply(self) -> None:
        status = _NOT_SERVING if self.holds else _SERVING
        for name in _READY_NAMES:
            await self.servicer.set(name, status)


def ext_proc_server(
    service: ExtProcService,
    access_log: AccessLogService,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int]:
    """ext_proc and the access-log service share the port Envoy's `picker` cluster points at.

    `credentials`: TLS (picker/extproc/tls.py), or None for plaintext (--secure-serving=false).
    `reuse_port`: only for a pod's workers (server.workers > 1), which share the port on purpose and
    whose parent checked first that nothing else holds it. Otherwise off, as gRPC's default is not:
    a second picker started on the same port must be refused, not silently handed half the streams.
    """
    limit = service.grpc_message_limit  # a BUFFERED body arrives in one message: 4 MiB is too small
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    ep_grpc.add_ExternalProcessorServicer_to_server(service, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    return server, port


def health_server(state: HealthState, address: str) -> tuple[grpc.aio.Server, int]:
    """Plaintext always, as the reference picker's: kubelet gRPC probes cannot speak TLS."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    port = server.add_insecure_port(address)
    return server, port
