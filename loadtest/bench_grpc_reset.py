"""Benchmark: a grpc.aio server's native memory per ext_proc RPC, by who ends the RPC (issue 15's soak).

grpc.aio leaks a batch's op array for every batch that fails on a call the client has reset
(grpc/grpc#43360, open at grpcio 1.85): the read the server has outstanding, and the status it sends
when its handler returns. Envoy closes an ext_proc stream by half-closing and resetting it at once,
so an RPC the server keeps open until Envoy's close leaks; one the server ends first does not.

A bare ExternalProcessor server (no picker code) in its own process; a client sends three messages
per RPC, 32 at a time, and ends each RPC one way:
  server-ends    the server returns after the third message (what the picker does), then the client
                 resets, as Envoy does
  client-resets  the client resets while the server still reads (an observer the picker kept open)
  half-close     the client half-closes and waits for the status (a clean close, the baseline)
It prints the server's RSS growth per 10,000 RPCs after a warm-up. Run:
`python -m loadtest.bench_grpc_reset` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from loadtest.bench_soak import rss
from loadtest.procs import Proc, free_port, port_open

MODES = ("server-ends", "client-resets", "half-close")
MESSAGES = (
    ep.ProcessingRequest(request_headers=ep.HttpHeaders()),
    ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * 300, end_of_stream=True)),
    ep.ProcessingRequest(response_headers=ep.HttpHeaders()),
)


class _Processor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, end_first: bool) -> None:
        self.end_first = end_first

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for request in request_iterator:
            yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            if self.end_first and request.HasField("response_headers"):
                return


async def _serve(port: int, end_first: bool) -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(_Processor(end_first), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _drive(port: int, mode: str, count: int, concurrency: int = 32) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        remaining = count

        async def one() -> None:
            call = stub.Process()
            for message in MESSAGES:
                await call.write(message)
                await call.read()
            if mode == "half-close":
                await call.done_writing()
                await call.read()  # EOF, then the status
                await call.code()
            else:
                call.cancel()  # Envoy: half-close and reset at once

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(mode: str, warmup: int, count: int) -> tuple[float, float]:
    """(server RSS growth in MB per 10k RPCs after the warm-up, wall seconds)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "loadtest.bench_grpc_reset", "--serve", str(port), "--mode", mode]
        server = Proc("bare gRPC server", argv, Path(tmp) / "server.log")
        try:
            server.wait_ready(lambda: port_open(port), 10)
            asyncio.run(_drive(port, mode, warmup))
            before, started = rss(server.pid), time.monotonic()
            asyncio.run(_drive(port, mode, count))
            after = rss(server.pid)
            return (after - before) / 1e6 * 10_000 / count, time.monotonic() - started
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rpcs", type=int, default=40_000, help="RPCs measured per mode")
    parser.add_argument("--warmup", type=int, default=10_000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="server-ends", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.mode == "server-ends"))
        return
    print(f"grpcio {grpc.__version__}, {os.cpu_count()} cores: server RSS growth per 10k RPCs")
    for mode in args.modes.split(","):
        per_10k, wall = measure(mode, args.warmup, args.rpcs)
        print(f"  {mode:<14} {per_10k:+6.2f} MB per 10k RPCs ({args.rpcs:,} RPCs in {wall:.0f} s)")
    print("  the picker ends each ext_proc RPC itself once it has what it needs (server-ends)")


if __name__ == "__main__":
    main()
