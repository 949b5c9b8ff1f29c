"""A do-nothing ext_proc server on one of several Python gRPC stacks, for bench_grpc_servers.

It answers the routing filter as the picker does (headers: continue; body: dynamic metadata and a
header mutation of the same size as a pick) and decides nothing, so what it costs is the gRPC
stack's own. Run: `python -m loadtest.ext_proc_bare --stack grpc-aio-uvloop --port P --upstream ip:port`.

`--shipped` serves what the shipped Envoy config asks of the picker's port, doing nothing with it
(bench_cost's `floor` path): TLS with a self-signed certificate, the routing stream ended by the
server at its answer (as the picker ends it once an observer reports the response), observer streams
and Envoy's gRPC access log read to their end. What that costs is the floor under the picker's own
CPU in the shipped shape.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from picker.contract import headers
from picker.extproc import tls, translate

STACKS = ("grpc-aio-uvloop", "grpc-aio-asyncio", "grpc-sync-threads", "grpclib")
_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def answer(request: ep.ProcessingRequest, upstream: str) -> ep.ProcessingResponse | None:
    """The reply the picker would give this message, without deciding anything (None: no reply)."""
    if request.observability_mode:
        return None
    kind = request.WhichOneof("request")
    if kind == "request_body":
        return translate.route_response(kind, [upstream], "bench", remove=headers.CLIENT_HINTS)
    return translate.continue_response(kind or "request_headers")


class AsyncService(ep_grpc.ExternalProcessorServicer):
    def __init__(self, upstream: str, ends_at_answer: bool = False) -> None:
        self._upstreams = itertools.cycle(upstream.split(","))  # round robin: decides nothing
        self._ends_at_answer = ends_at_answer

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: object):  # type: ignore[override]
        upstream = ""
        async for request in request_iterator:
            if request.WhichOneof("request") == "request_body":  # a routing stream's pick: the next
                upstream = next(self._upstreams)
            reply = answer(request, upstream)
            if reply is not None:
                yield reply
                if self._ends_at_answer and reply.HasField("request_body"):
                    return


class AccessLogSink(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access log, read and dropped."""

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[object], context: object
    ) -> als_pb2.StreamAccessLogsResponse:  # type: ignore[override]
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


class SyncService(ep_grpc.ExternalProcessorServicer):
    def __init__(self, upstream: str) -> None:
        self._upstream = upstream

    def Process(self, request_iterator: Iterator[ep.ProcessingRequest], context: object):  # type: ignore[override]
        for request in request_iterator:
            reply = answer(request, self._upstream)
            if reply is not None:
                yield reply


async def _serve_grpc_aio(port: int, upstream: str, shipped: bool = False) -> None:
    import grpc

    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(AsyncService(upstream, ends_at_answer=shipped), server)
    if shipped:
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogSink(), server)
        pair = tls.self_signed()
        server.add_secure_port(
            f"127.0.0.1:{port}", grpc.ssl_server_credentials([(pair.key_pem, pair.cert_pem)])
        )
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("listening", flush=True)
    await server.wait_for_termination()


def _serve_grpc_sync(port: int, upstream: str) -> None:
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    ep_grpc.add_ExternalProcessorServicer_to_server(SyncService(upstream), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("listening", flush=True)
    server.wait_for_termination()


async def _serve_grpclib(port: int, upstream: str) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server, Stream

    class Service:
        async def process(self, stream: Stream[ep.ProcessingRequest, ep.ProcessingResponse]) -> None:
            async for request in stream:
                reply = answer(request, upstream)
                if reply is not None:
                    await stream.send_message(reply)

        def __mapping__(self) -> dict[str, Handler]:
            return {
                _METHOD: Handler(
                    self.process, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
                )
            }

    server = Server([Service()])
    await server.start("127.0.0.1", port)
    print("listening", flush=True)
    await server.wait_closed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stack", choices=STACKS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--upstream",
        required=True,
        help="ip:port every body answer routes to (the grpc.aio stacks: ip:port,... taken in turn)",
    )
    parser.add_argument(
        "--shipped", action="store_true", help="what the shipped Envoy config asks (the grpc.aio stacks)"
    )
    args = parser.parse_args()
    if not args.stack.startswith("grpc-aio") and (args.shipped or "," in args.upstream):
        parser.error(f"--shipped and a list of upstreams are served by the grpc.aio stacks, not {args.stack}")
    if args.stack == "grpc-sync-threads":
        _serve_grpc_sync(args.port, args.upstream)
    elif args.stack == "grpclib":
        asyncio.run(_serve_grpclib(args.port, args.upstream))
    elif args.stack == "grpc-aio-uvloop":
        import uvloop

        uvloop.run(_serve_grpc_aio(args.port, args.upstream, args.shipped))
    else:
        asyncio.run(_serve_grpc_aio(args.port, args.upstream, args.shipped))


if __name__ == "__main__":
    main()
