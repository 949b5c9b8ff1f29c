"""What loadtest/bench_realvllm_resume.py shares between its rounds: the request shapes, the stream
reader, the uncut references and the real vLLM engines it starts, stops and signals.

Six shapes of `TOKENS`-token greedy streams (temperature 0, ignore_eos): completions plain, with a stop
string never produced, with logprobs 2; chat plain, with logprobs, with top_logprobs 2. A `Read` is
what a client read of one stream; `verdict` compares it with its shape's uncut run (`REFS`, filled
by `references` from every engine at once: they must agree). An `Engine` is one vLLM server on a
fixed port and core, in its own session, so SIGKILL of its process group closes its sockets as a
dead pod's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx

from loadtest import http_client
from loadtest.realvllm import launcher
from loadtest.stack import parse_metrics

TOKENS = 160
# content events every stream has read when its engine is hit. Low: a warm engine sends 160 tokens to
# 6 streams in ~0.5 s and the client reads them behind it (measured: at 30 the engine had sent all)
FAULT_AFTER = 2
STREAM_DEADLINE_S = 120.0
BIND = "VLLM_CPU_OMP_THREADS_BIND"
SERVED = "x-gateway-destination-endpoint-served"
BASE = {"model": launcher.SERVED_MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
COMPLETION = {**BASE, "prompt": "The history of the picker began when"}
CHAT = {**BASE, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "cmpl": ("/v1/completions", COMPLETION),
    "cmpl-stop": ("/v1/completions", {**COMPLETION, "stop": ["</answer>"]}),
    "cmpl-logprobs": ("/v1/completions", {**COMPLETION, "logprobs": 2}),
    "chat": ("/v1/chat/completions", CHAT),
    "chat-logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True}),
    "chat-top": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
}


def shape_of(index: int) -> str:
    """The shape of a round's `index`th stream: the six in turn."""
    return list(SHAPES)[index % len(SHAPES)]


@dataclass(eq=False)  # `in` a round's lists: this stream, not an equal one
class Read:
    """What a client read of one stream."""

    shape: str
    served: str = ""  # the replica that served its first part (response header)
    request_id: str = ""
    text: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    logprobs: int = 0  # logprob entries
    roles: int = 0  # chunks with a delta.role
    done: int = 0  # [DONE] lines
    events: int = 0  # events with content
    error: str = ""
    ttft_s: float = 0.0  # the wait for its first data line
    silence_s: float = 0.0  # the longest gap between two data lines
    at_hit: int = 0  # content events read when its engine was hit
    ended: bool = False
    gated: bool = False  # counted at the gate
    via: int = 0  # the proxy it went through (the move round's two)

    def outcome(self) -> tuple[str, list[str], dict[str, Any] | None, int]:
        """What must equal the uncut run's: text, finish reasons, usage, logprob entries."""
        return "".join(self.text), self.finish, self.usage, self.logprobs

    @property
    def cut(self) -> bool:
        return bool(self.error) or self.done != 1


class Gate:
    """Calls `then` once every stream has read FAULT_AFTER content events (or ended), from the reader
    that completed the count: no scheduling delay between what the client read and the fault."""

    def __init__(self, count: int, then: Callable[[], None]) -> None:
        self.left, self.then = count, then

    def arrive(self, read: Read) -> None:
        self.left, read.gated = self.left - (not read.gated), True
        if self.left == 0:
            self.left = -1
            self.then()


def take(read: Read, frame: dict[str, Any]) -> None:
    """One data frame into `read`: its text, finish reasons, role chunks, logprob entries, usage."""
    for choice in frame.get("choices") or []:
        delta = choice.get("delta") or {}
        read.roles += "role" in delta
        piece = choice.get("text") if "text" in choice else delta.get("content")
        if piece:
            read.text.append(piece)
            read.events += 1
        if choice.get("finish_reason"):
            read.finish.append(choice["finish_reason"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            entries = logprobs.get("content") if "content" in logprobs else logprobs.get("tokens")
            read.logprobs += len(entries or [])
    read.usage = frame.get("usage") or read.usage


async def read_stream(
    client: httpx.AsyncClient, url: str, read: Read, gate: Gate | None = None, tokens: int = TOKENS
) -> None:
    """One stream to its end, its read deadline, or the round's cancellation; never raises else."""
    (path, body), sent, last = SHAPES[read.shape], time.monotonic(), 0.0
    try:
        async with asyncio.timeout(STREAM_DEADLINE_S):
            async with client.stream("POST", url + path, json={**body, "max_tokens": tokens}) as response:
                read.served = response.headers.get(SERVED, "")
                read.request_id = response.headers.get("x-picker-request-id", "")
                if response.status_code != 200:
                    read.error = f"status {response.status_code}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    read.ttft_s = read.ttft_s or now - sent
                    read.silence_s, last = max(read.silence_s, now - (last or now)), now
                    if line == "data: [DONE]":
                        read.done += 1
                        continue
                    frame = json.loads(line[6:])
                    if "error" in frame:
                        read.error = "error event"
                    take(read, frame)
                    if gate is not None and read.events >= FAULT_AFTER:
                        gate.arrive(read)
    except TimeoutError:
        read.error = "stream deadline"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        read.error = read.error or type(exc).__name__
    except asyncio.CancelledError:
        read.error = "round deadline"
        raise
    finally:
        read.ended = True
        if gate is not None:
            gate.arrive(read)


class Engine:
    """One vLLM server on a fixed port and core, restartable; `stop()` SIGKILLs its process group."""

    def __init__(self, index: int, core: str, workdir: Path) -> None:
        self.index, self.core, self.workdir = index, core, workdir
        self.port = launcher.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server: launcher.RealVllm | None = None
        self.starts_s: list[float] = []
        self.cold = False  # started again and nothing ran on it since
        self._exit = ExitStack()

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self) -> None:
        started, self._exit = time.monotonic(), ExitStack()
        workdir = self.workdir / f"vllm-{self.index}-{len(self.starts_s)}"
        with patch.dict(os.environ, {BIND: self.core}):  # read by vLLM at start: its engine's core
            self.server = self._exit.enter_context(launcher.real_vllm(self.port, workdir))
        self.starts_s.append(time.monotonic() - started)
        self.cold = len(self.starts_s) > 1
        print(f"  vLLM {self.index} (core {self.core}) healthy in {self.starts_s[-1]:.0f} s", flush=True)

    def signal(self, sig: int) -> None:
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.server.pid, sig)

    def stop(self) -> None:
        if self.server is not None:
            self.signal(signal.SIGKILL)
            self.server.wait_exit(10.0)
            self._exit.close()  # the launcher's own cleanup: nothing left to wait for
            self.server = None

    def healthy(self) -> bool:
        try:
            return http_client.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    async def running(self, client: httpx.AsyncClient) -> float:
        """The engine's own count of the requests it runs (vllm:num_requests_running, every label set)."""
        text = (await client.get(f"{self.url}/metrics", timeout=2.0)).text
        return sum(v for (name, _), v in parse_metrics(text).items() if name == "vllm:num_requests_running")

    async def warm(self) -> None:
        """Six short streams at once: a fresh engine's first batches pause (measured: 14 s)."""
        started, reads = time.monotonic(), [Read(shape) for shape in SHAPES]
        async with http_client.AsyncClient(timeout=STREAM_DEADLINE_S) as client:
            await asyncio.gather(*(read_stream(client, self.url, r, tokens=32) for r in reads))
        self.cold = False
        print(f"  vLLM {self.index} warmed in {time.monotonic() - started:.1f} s", flush=True)


def by_address(engines: list[Engine], address: str) -> Engine:
    return next(e for e in engines if e.address == address)


REFS: dict[str, Read] = {}  # each shape's uncut run, filled by `references`


async def references(engines: list[Engine]) -> dict[str, Read]:
    """Each shape's uncut stream from every engine at once (their first requests); they must agree."""
    refs: dict[str, Read] = {}
    async with http_client.AsyncClient(timeout=STREAM_DEADLINE_S) as client:
        for shape in SHAPES:
            reads = [Read(shape) for _ in engines]
            await asyncio.gather(
                *(read_stream(client, e.url, r) for e, r in zip(engines, reads, strict=True))
            )
            first = reads[0]
            if first.finish != ["length"] or any(r.cut or r.outcome() != first.outcome() for r in reads):
                raise RuntimeError(f"uncut {shape} streams disagree or failed: {[r.error for r in reads]}")
            refs[shape] = reads[0]
    return refs


def verdict(read: Read) -> str:
    """equal (to its shape's uncut run), cut (broken, error event, no single [DONE]) or wrong."""
    if read.cut:
        return "cut"
    return "equal" if read.outcome() == REFS[read.shape].outcome() else "wrong"


def difference(read: Read) -> str:
    """One line on how a stream differs from its uncut run (the proxy's request id to find it by)."""
    ref, text = REFS[read.shape], "".join(read.text)
    ref_text = "".join(ref.text)
    diff = next((i for i, (a, b) in enumerate(zip(text, ref_text, strict=False)) if a != b), None)
    return (f"{verdict(read)} {read.shape} request_id={read.request_id} served={read.served} via={read.via} "
            f"error={read.error!r} done={read.done} events={read.events} chars={len(text)}/{len(ref_text)} "
            f"first_diff={diff} finish={read.finish} usage={read.usage} ref_usage={ref.usage} "
            f"logprobs={read.logprobs}/{ref.logprobs} roles={read.roles}")  # fmt: skip
