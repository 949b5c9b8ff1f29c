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
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthState:
    """The picker's health as the four service names report it."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def serving(self) -> None:
        for name in ("", LIVENESS, READINESS, EXT_PROC_SERVICE):
            await self.servicer.set(name, _SERVING)

    async def not_ready(self) -> None:
        """Draining: load balancers should stop sending new streams; liveness stays SERVING."""
        for name in ("", READINESS, EXT_PROC_SERVICE):
            await self.servicer.set(name, _NOT_SERVING)


def ext_proc_server(
    service: ExtProcService, access_log: AccessLogService, address: str
) -> tuple[grpc.aio.Server, int]:
    """ext_proc and the access-log service share the port Envoy's `picker` cluster points at."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(service, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    port = server.add_insecure_port(address)
    return server, port


def health_server(state: HealthState, address: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    port = server.add_insecure_port(address)
    return server, port
