"""NGINX Gateway Fabric's way of asking: a new gRPC connection (and TLS handshake) per request.

Rows, side by side in one run (rounds interleaved): the shim's shape over plaintext, over TLS (the
picker's default; NGF skips verification), over TLS with a client session cache (what resumption
would save), and one long-lived connection carrying a stream per request (Envoy's shape, for
reference). Figures: the shim's time from opening the connection to the end of the stream, p50 and
p99, and the picker's CPU per request. The picker runs `--no-scrape` over endpoints that need not
exist (the decision is what is timed), and each request is released at once as unobserved.

    python -m loadtest.bench_ngf [--requests 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from loadtest.ngf_client import ShimClient, request_messages
from loadtest.procs import Proc, free_port
from loadtest.stack import serve_argv
from loadtest.traffic import percentile

BODY = b'{"model":"m","prompt":"Say something.","max_tokens":8}'
ENDPOINTS = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"


def start_picker(workdir: Path, tls: bool) -> tuple[Proc, int]:
    ports = free_port(), free_port(), free_port()
    extra = () if tls else ("--secure-serving=false",)
    argv = serve_argv(*ports, "--endpoints", ENDPOINTS, "--no-scrape", "--log-level", "WARNING", *extra)
    proc = Proc(f"picker-{'tls' if tls else 'plain'}", argv, workdir / f"picker-{tls}.log")
    proc.wait_ready(lambda: "picker ready" in proc.log_text())
    return proc, ports[0]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def persistent(address: str) -> Callable[[], float]:
    """One channel for every request, a stream each: as Envoy asks (TLS is set up once)."""
    client = ShimClient(address, tls=True)
    channel = client._channel()
    stub = ep_grpc.ExternalProcessorStub(channel)

    def ask() -> float:
        started = time.perf_counter()
        for _ in stub.Process(request_messages(BODY), timeout=10):
            pass
        return time.perf_counter() - started

    return ask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per row and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        tls_picker, tls_port = start_picker(workdir, tls=True)
        plain_picker, plain_port = start_picker(workdir, tls=False)
        try:
            tls_address, plain_address = f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain_port}"
            rows: dict[str, tuple[Callable[[], float], Proc]] = {
                "shim, plaintext": (
                    lambda: ShimClient(plain_address, tls=False).ask(BODY).seconds,
                    plain_picker,
                ),
                "shim, TLS (NGF default)": (
                    lambda: ShimClient(tls_address, tls=True).ask(BODY).seconds,
                    tls_picker,
                ),
            }
            resuming = ShimClient(tls_address, tls=True, session_cache=True)
            rows["shim, TLS + session resumption"] = (lambda: resuming.ask(BODY).seconds, tls_picker)
            rows["one connection, a stream per request (Envoy)"] = (persistent(tls_address), tls_picker)
            times: dict[str, list[float]] = {name: [] for name in rows}
            cpu: dict[str, float] = dict.fromkeys(rows, 0.0)
            for ask, _ in rows.values():  # warm-up: imports, first handshakes
                for _ in range(20):
                    ask()
            for _ in range(args.rounds):
                for name, (ask, proc) in rows.items():
                    before = cpu_seconds(proc.pid)
                    times[name].extend(ask() for _ in range(args.requests))
                    cpu[name] += cpu_seconds(proc.pid) - before
        finally:
            tls_picker.stop()
            plain_picker.stop()
    total = args.requests * args.rounds
    print(f"bench_ngf: {total} sequential requests per row, {args.rounds} interleaved rounds")
    print(f"{'row':<48} {'p50 ms':>8} {'p99 ms':>8} {'picker CPU us/req':>18}")
    for name, values in times.items():
        values.sort()
        print(
            f"{name:<48} {percentile(values, 50) * 1e3:>8.2f} {percentile(values, 99) * 1e3:>8.2f} "
            f"{cpu[name] / total * 1e6:>18.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
