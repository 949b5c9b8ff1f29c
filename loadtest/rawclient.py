"""A raw asyncio streaming client for benchmarks: no HTTP library, so the client's own cost stays out
of the figures. Counts SSE events as they arrive, with their arrival times."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

ITL_S = 0.05  # 20 tokens/s, the benchmarks' stream rate
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """User + system CPU a process has used so far (its main thread's alone: `main_thread`; in
    the picker that is the event loop, the rest gRPC's threads)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def wakeups(pid: int) -> int:
    """How often a process's threads have blocked so far (voluntary context switches: each one a
    wake-up to come): what a message between processes costs beyond its own work."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total


@dataclass
class StreamStats:
    status: int = 0
    arrivals: list[float] = field(default_factory=list)
    started: float = 0.0
    done: bool = False
    error: str = ""


class _SSEProtocol(asyncio.Protocol):
    def __init__(self, request: bytes, stats: StreamStats, finished: asyncio.Future[None]) -> None:
        self._request = request
        self._stats = stats
        self._finished = finished
        self._head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._stats.started = time.perf_counter()
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self._stats.status:
            self._head += data
            if b"\r\n" in self._head:
                self._stats.status = int(self._head.split(b" ", 2)[1])
        count = data.count(b"data: ")
        self._stats.arrivals.extend([now] * count)
        if b"data: [DONE]" in data:
            self._stats.done = True
            self._stats.arrivals.pop()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._stats.done:
            self._stats.error = "cut" if exc is None else type(exc).__name__
        if not self._finished.done():
            self._finished.set_result(None)


async def one_stream(
    port: int, tokens: int, itl_s: float = ITL_S, prompt: str = "hi", token_ids: bool = False
) -> StreamStats:
    """One streaming completion; `token_ids`: it asks for vLLM's `return_token_ids` itself."""
    extra = b',"return_token_ids":true' if token_ids else b""
    body = b'{"model":"tiny-llama","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":true%s}' % (
        prompt.encode(),
        tokens,
        extra,
    )
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    ) + body
    stats = StreamStats()
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        transport, _ = await asyncio.get_running_loop().create_connection(
            lambda: _SSEProtocol(request, stats, finished), "127.0.0.1", port
        )
        await asyncio.wait_for(finished, tokens * itl_s + 30)
        transport.close()
    except (OSError, TimeoutError) as exc:
        stats.error = type(exc).__name__
    return stats
