"""A do-nothing ext_proc server on one of several Python gRPC stacks, for bench_grpc_servers.

It answers the routing filter as the picker does (headers: continue; body: dynamic metadata and a
header mutation of the same size as a pick) and decides nothing, so what it costs is the gRPC
stack's own. Run: `python -m loadtest.ext_proc_bare --stack grpc-aio-uvloop --port P --upstream ip:port`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Iterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from picker.contract import headers
from picker.extproc import translate

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
    def __init__(self, upstream: str) -> None:
        self._upstream = upstream

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: object):  # type: ignore[override]
        async for request in request_iterator:
            reply = answer(request, self._upstream)
            if reply is not None:
                yield reply


class SyncService(ep_grpc.ExternalProcessorServicer):
    def __init__(self, upstream: str) -> None:
        self._upstream = upstream

    def Process(self, request_iterator: Iterator[ep.ProcessingRequest], context: object):  # type: ignore[override]
        for request in request_iterator:
            reply = answer(request, self._upstream)
            if reply is not None:
                yield reply


async def _serve_grpc_aio(port: int, upstream: str) -> None:
    import grpc

    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(AsyncService(upstream), server)
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
    parser.add_argument("--upstream", required=True, help="ip:port every body answer routes to")
    args = parser.parse_args()
    if args.stack == "grpc-sync-threads":
        _serve_grpc_sync(args.port, args.upstream)
    elif args.stack == "grpclib":
        asyncio.run(_serve_grpclib(args.port, args.upstream))
    elif args.stack == "grpc-aio-uvloop":
        import uvloop

        uvloop.run(_serve_grpc_aio(args.port, args.upstream))
    else:
        asyncio.run(_serve_grpc_aio(args.port, args.upstream))


if __name__ == "__main__":
    main()
