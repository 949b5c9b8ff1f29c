"""Benchmark: the picker's own Python per request on the ext_proc path, in-process, beside a baseline.

The shipped `picker serve` core (built from the default config over three endpoints with engine
gauges) handles, per request, what Envoy's shipped config sends it: the routing stream (request
headers, then the buffered body; answered) and the observer stream (request headers, response
headers, eight SSE chunks with the end of stream), messages built as Envoy builds them. No gRPC,
no network: what is left is the picker's code (parsing, admitting, picking, tracking, metrics),
which `bench_cost` cannot separate from gRPC's own share (about three quarters of the picker's CPU
under load). CPU time per request, median of interleaved rounds, and the garbage collector's
share of it (its collections timed by `gc.callbacks`), the collector settled as a started picker
settles it (`picker/lifecycle/heap.py`) before the first request.

`--against REV` runs the same script on a checkout of REV (a temporary git worktree) in interleaved
rounds, so each cut of issue 56 prints its saving beside the revision before it, in one run.
Run: `python -m loadtest.bench_hot_path [--against REV]` (about 20 s; bounded in requests).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
PEER = "ipv4:127.0.0.1:40000"  # one Envoy connection: its observer reports responses
TOKENS = 8
_PROMPT = "You are a helpful assistant. Summarise the following text in one sentence: " * 3


class _Context:
    """What the service reads of a grpc.aio ServicerContext."""

    def peer(self) -> str:
        return PEER

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-picker-data-plane", "override-host"),)


def _headers(pairs: dict[str, str], eos: bool = False) -> ep.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=eos)


def _request_headers(number: int, body: bytes) -> dict[str, str]:
    return {
        ":authority": "gateway.example:8080",
        ":path": "/v1/completions",
        ":method": "POST",
        ":scheme": "http",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "user-agent": "python-httpx/0.28.1",
        "accept": "*/*",
        "x-forwarded-proto": "http",
        "x-request-id": f"5c0d1e0f-{number:08d}-4a1b-9c2d-3e4f5a6b7c8d",
    }


def _chunk(i: int, last: bool) -> bytes:
    choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": "length" if last else None}
    event = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    data = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return data + b"data: [DONE]\n\n" if last else data


CHUNKS = [_chunk(i, i == TOKENS - 1) for i in range(TOKENS)]


def routing_messages(number: int) -> list[ep.ProcessingRequest]:
    body = json.dumps({"model": "m", "prompt": f"{number} {_PROMPT}", "max_tokens": TOKENS, "stream": True})
    data = body.encode()
    headers = ep.ProcessingRequest(request_headers=_headers(_request_headers(number, data)))
    headers.protocol_config.request_body_mode = pm.ProcessingMode.BUFFERED
    return [headers, ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=True))]


def observer_messages(request_id: str, served: str, number: int) -> list[ep.ProcessingRequest]:
    pairs = {**_request_headers(number, b"x" * 300), "x-picker-request-id": request_id}
    first = ep.ProcessingRequest(request_headers=_headers(pairs), observability_mode=True)
    first.protocol_config.response_body_mode = pm.ProcessingMode.STREAMED
    response = ep.ProcessingRequest(
        response_headers=_headers({":status": "200", "content-type": "text/event-stream; charset=utf-8"}),
        observability_mode=True,
    )
    meta = struct_pb2.Struct()
    meta.update({"x-gateway-destination-endpoint-served": served})
    response.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
    chunks = [
        ep.ProcessingRequest(
            response_body=ep.HttpBody(body=chunk, end_of_stream=i == TOKENS - 1), observability_mode=True
        )
        for i, chunk in enumerate(CHUNKS)
    ]
    return [first, response, *chunks]


async def _feed(messages: Sequence[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingRequest]:
    for message in messages:
        yield message


def _routed(answer: ep.ProcessingResponse) -> tuple[str, str]:
    mutation = answer.request_body.response.header_mutation
    found = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return found["x-picker-request-id"], found["x-gateway-destination-endpoint"].split(",")[0]


def _core() -> tuple[object, object]:
    """The shipped `picker serve` core and ext_proc service, as PickerApp builds them (nothing started)."""
    from picker.app import PickerApp
    from picker.config.model import PickerConfig

    app = PickerApp(PickerConfig.model_validate({"pool": {"endpoints": list(ENDPOINTS)}}))
    return app.core, app.service


def _fresh_gauges(core: object) -> None:
    """Engine gauges as a scrape leaves them (the scraper itself does not run here)."""
    from picker.pool.scrapes import record_sample

    for address in ENDPOINTS:
        record_sample(core.pool.get(address), 1, 0, 0.1, time.monotonic())  # type: ignore[attr-defined]


async def _requests(service: object, start: int, count: int) -> None:
    context = _Context()
    process = service.Process  # type: ignore[attr-defined]
    for number in range(start, start + count):
        answers = [a async for a in process(_feed(routing_messages(number)), context)]
        request_id, served = _routed(answers[-1])
        async for _ in process(_feed(observer_messages(request_id, served, number)), context):
            pass


def _settle_as_started() -> None:
    """The garbage collector as a started picker sets it (a revision without the setting: as it is)."""
    try:
        from picker.config.model import PickerConfig
        from picker.lifecycle.heap import settle
    except ImportError:
        return
    settle(getattr(PickerConfig().server, "gc_gen0_threshold", 0))


async def child(rounds: int, count: int) -> dict[str, list[float]]:
    """Per round: CPU us per request (the messages are built outside the timed part), and the
    garbage collector's own collections and time per request within it (gc.callbacks)."""
    core, service = _core()
    _settle_as_started()  # as `picker serve` does once started, before any request
    _fresh_gauges(core)
    await _requests(service, 0, 200)  # warm: the observer peer learned, caches filled
    collector = _CollectorClock()
    gc.callbacks.append(collector)
    figures: dict[str, list[float]] = {"us": [], "gc_us": [], "gc_n": []}
    for round_ in range(rounds):
        _fresh_gauges(core)
        collector.reset()
        started = time.process_time()
        await _requests(service, (round_ + 1) * count, count)
        figures["us"].append((time.process_time() - started) * 1e6 / count)
        figures["gc_us"].append(collector.seconds * 1e6 / count)
        figures["gc_n"].append(collector.collections * 1000 / count)
    gc.callbacks.remove(collector)
    # the message building is not the picker's: timed alone and taken off
    started = time.process_time()
    for number in range(count):
        routing_messages(number), observer_messages("id", ENDPOINTS[0], number)
    build = (time.process_time() - started) * 1e6 / count
    figures["us"] = [f - build for f in figures["us"]]
    return figures


class _CollectorClock:
    """The collector's collections and wall time, from its start/stop callbacks."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds, self.collections, self._since = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._since
            self.collections += 1


def _run_child(where: Path, rounds: int, count: int) -> dict[str, list[float]]:
    argv = [sys.executable, "-m", "loadtest.bench_hot_path", "--child", "--rounds", str(rounds)]
    out = subprocess.run(
        [*argv, "--count", str(count)],
        cwd=where,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--against", help="a git revision to measure beside this checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=2000, help="requests a round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        uvloop = __import__("uvloop")
        print(json.dumps(uvloop.run(child(args.rounds, args.count))))
        return
    here = Path(__file__).resolve().parents[1]
    rows: dict[str, dict[str, list[float]]] = {"this checkout": {}}
    with tempfile.TemporaryDirectory(prefix="bench-hot-path-") as tmp:
        base = Path(tmp) / "base"
        if args.against:
            add = ["git", "worktree", "add", "-q", "--detach", str(base), args.against]
            subprocess.run(add, cwd=here, check=True)
            shutil.copy(__file__, base / "loadtest" / "bench_hot_path.py")
            rows[args.against] = {}
        try:
            for _ in range(args.rounds):  # interleaved, one round each at a time: drift falls on both
                for name, where in (("this checkout", here), (args.against, base)):
                    if name is None:
                        continue
                    for key, values in _run_child(where, 1, args.count).items():
                        rows[name].setdefault(key, []).extend(values)
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=here, check=False)
    print(f"picker Python per request ({TOKENS}-token stream; routing + observer; median of {args.rounds}):")
    for name, figures in rows.items():
        us, gc_us, gc_n = figures["us"], figures["gc_us"], figures["gc_n"]
        print(
            f"  {name:<16} {statistics.median(us):6.1f} us   (rounds {min(us):.0f}-{max(us):.0f}); the "
            f"garbage collector {statistics.median(gc_us):.1f} us of it ({min(gc_us):.1f}-{max(gc_us):.1f}), "
            f"{statistics.median(gc_n):.1f} collections per 1,000 requests"
        )


if __name__ == "__main__":
    main()
