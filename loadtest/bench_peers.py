"""The channel between pickers, two transports side by side: CPU per message on each side, and the
one-way latency, for a grpc.aio stream (what every other picker channel uses) and plain asyncio TCP
with msgpack framing (what picker/peers/channel.py uses), the latter also with each message sealed
as the channel seals it since issue 53 (picker/peers/session.py: a frame with a keyed-BLAKE2b tag
over its sequence number, opened and checked on the other side). Each side is its own process, as
two pickers are.

Run: `python -m loadtest.bench_peers [--messages 20000] [--transports tcp,sealed]` (about 20 s). The
message is a `pick` event, the most frequent one; messages go one at a time (each loop turn sends
what it has).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import subprocess
import sys
import time

import msgpack
import uvloop

from loadtest.procs import free_port
from picker.peers.auth import EVENTS, Handshake
from picker.peers.session import Session

EVENT = ["pick", "10.1.0.1:9004~0123456789abcdef", "10.0.0.1:8000"]
METHOD = "/bench.Peers/Events"
LABELS = {"grpc": "grpc.aio stream", "tcp": "asyncio TCP + msgpack", "sealed": "  ... sealed frames"}


def _session(role: str) -> Session:
    """Both processes derive the same session from a fixed handshake (a benchmark has no stranger)."""
    handshake = Handshake(EVENTS, "10.1.0.2:9004", "10.1.0.1:9004", "a" * 32, "b" * 32)
    if role == "send":
        return Session.connector(handshake, "bench-credential")
    return Session.listener(handshake, "bench-credential")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- the receiving side --------------------------------------------------------------------------------


async def receive_grpc(port: int, count: int) -> list[float]:
    import grpc

    lags: list[float] = []
    done = asyncio.Event()

    async def events(requests: object, context: object) -> bytes:
        async for raw in requests:  # type: ignore[attr-defined]
            _, sent_at = msgpack.unpackb(raw)
            lags.append(time.time() - sent_at)
            if len(lags) >= count:
                done.set()
        return b""

    handler = grpc.method_handlers_generic_handler(
        "bench.Peers", {"Events": grpc.stream_unary_rpc_method_handler(events)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    await server.stop(0.5)
    return lags


async def receive_tcp(port: int, count: int, sealed: bool = False) -> list[float]:
    lags: list[float] = []
    done = asyncio.Event()
    session = _session("receive")

    class Inbound(asyncio.Protocol):
        def __init__(self) -> None:
            self.unpacker = msgpack.Unpacker()

        def data_received(self, data: bytes) -> None:
            self.unpacker.feed(data)
            for frame in self.unpacker:
                _, sent_at = session.open(frame) if sealed else frame
                lags.append(time.time() - sent_at)
                if len(lags) >= count:
                    done.set()

    server = await asyncio.get_running_loop().create_server(Inbound, "127.0.0.1", port)
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 120)
    server.close()
    return lags


# --- the sending side --------------------------------------------------------------------------------


async def send_grpc(port: int, count: int, gap_s: float) -> None:
    import grpc

    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def messages() -> object:
        while (item := await queue.get()) is not None:
            yield item

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_unary(METHOD)(messages())
        for _ in range(count):
            queue.put_nowait(msgpack.packb([EVENT, time.time()]))
            await asyncio.sleep(gap_s)  # the pacing of the load, not a synchronisation
        queue.put_nowait(None)
        try:
            await asyncio.wait_for(call, 30)
        except (grpc.aio.AioRpcError, TimeoutError):
            pass  # the receiver stops once it has every message


async def send_tcp(port: int, count: int, gap_s: float, sealed: bool = False) -> None:
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, "127.0.0.1", port)
    session = _session("send")
    for _ in range(count):
        message = [EVENT, time.time()]
        transport.write(session.seal(message) if sealed else msgpack.packb(message))
        await asyncio.sleep(gap_s)  # the pacing of the load, not a synchronisation
    transport.close()


# --- the run -----------------------------------------------------------------------------------------------


def child(role: str, transport: str, port: int, count: int, gap_s: float) -> None:
    """One side, in its own process: prints its CPU seconds (and, receiving, the lags)."""
    started = _cpu()
    sealed = transport == "sealed"
    if role == "receive":
        receiving = receive_grpc(port, count) if transport == "grpc" else receive_tcp(port, count, sealed)
        lags = uvloop.run(receiving)
        print("lags", " ".join(f"{lag:.6f}" for lag in lags), flush=True)
    else:
        sending = (
            send_grpc(port, count, gap_s) if transport == "grpc" else send_tcp(port, count, gap_s, sealed)
        )
        uvloop.run(sending)
    print("cpu", _cpu() - started, flush=True)


def measure(transport: str, count: int, gap_s: float) -> tuple[float, float, float, float]:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.bench_peers", "--child"]
    receiver = subprocess.Popen(
        [*argv, "receive", transport, str(port), str(count), str(gap_s)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert receiver.stdout is not None
        assert receiver.stdout.readline().strip() == "ready"
        sender = subprocess.run(
            [*argv, "send", transport, str(port), str(count), str(gap_s)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        out, _ = receiver.communicate(timeout=180)
    finally:
        if receiver.poll() is None:
            receiver.kill()  # by its PID, should it still run
            receiver.wait()
    send_cpu = float(sender.stdout.split("cpu")[-1])
    receive_cpu = float(out.split("cpu")[-1])
    lags = sorted(float(v) for v in out.split("lags", 1)[1].split("cpu")[0].split())
    return (
        send_cpu / count * 1e6,
        receive_cpu / count * 1e6,
        statistics.median(lags) * 1e3,
        lags[int(len(lags) * 0.99)] * 1e3,
    )


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        role, transport, port, count, gap = sys.argv[2:7]
        child(role, transport, int(port), int(count), float(gap))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--gap-ms", type=float, default=0.2, help="between two messages")
    parser.add_argument("--transports", default="grpc,tcp,sealed", help="which rows, comma-separated")
    args = parser.parse_args()
    print(
        f"CPU: {args.messages} pick events, one per message, {args.gap_ms} ms apart (start-up included); "
        "latency: 500 more, 5 ms apart (an idle channel)"
    )
    print(" | ".join(("transport".ljust(22), "send us/msg", "receive us/msg", "one-way p50 ms", "  p99")))
    for transport in args.transports.split(","):
        label = LABELS[transport]
        send_us, receive_us, _, _ = measure(transport, args.messages, args.gap_ms / 1e3)
        _, _, p50, p99 = measure(transport, 500, 0.005)
        print(f"{label:<22} | {send_us:>11.1f} | {receive_us:>14.1f} | {p50:>14.3f} | {p99:>5.2f}")


if __name__ == "__main__":
    main()
