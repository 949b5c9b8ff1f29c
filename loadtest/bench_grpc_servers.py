"""Benchmark: which Python gRPC stack answers Envoy's ext_proc soonest, and where the picker's added
TTFT goes (issue 15).

Behind the same Envoy config (a routing ext_proc filter: request headers, then the buffered body;
nothing on the response) over one simulated replica (TTFT 5 ms), one run compares:
  envoy alone        no ext_proc filter (the baseline)
  <stack>            a do-nothing ext_proc server (loadtest/ext_proc_bare.py) on each Python gRPC stack
  picker             `picker serve`: the same grpc.aio stack deciding for real
  <row> x2           two such servers behind the one cluster, Envoy spreading the streams over both
                     (issue 23: what splitting the load costs a server that decides nothing, beside
                     two pickers that share nothing; their CPU is summed)
Rounds are interleaved so drift on a shared box falls on every row alike. For each row: TTFT from a
raw client, and from Envoy's own timings (access log) the time from the request's first byte to
the upstream request, and each ext_proc round trip as Envoy measured it; the server's CPU per
request from /proc. Bounded in requests and time (about a minute).
Run: `python -m loadtest.bench_grpc_servers`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import string
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.bench_cost import closed_loop, load, stream_request, ttfts
from loadtest.ext_proc_bare import STACKS
from loadtest.procs import Proc, free_port, port_open, wait_until
from loadtest.rawclient import cpu_seconds
from loadtest.stack import health_ok, serve_argv, sim_argv
from loadtest.traffic import percentile
from picker.cli.envoyconf import envoy_binary

BASELINE = "envoy alone"
PICKER = "picker"
ROUTING = "envoy.filters.http.ext_proc"

# Envoy's own timings of each request, in the access log (microseconds)
_LEVEL_HEADER = "x-bench-level"
_LOG_FORMAT = {
    "level": f"%REQ({_LEVEL_HEADER})%",
    "before_upstream_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "headers_rt_us": f"%FILTER_STATE({ROUTING}:FIELD:request_header_latency_us)%",
    "body_rt_us": f"%FILTER_STATE({ROUTING}:FIELD:request_body_total_latency_us)%",
}
SPLIT = " x2"  # a row's suffix: two servers of that row behind one cluster


_ENVOY = """\
admin: {address: {socket_address: {address: 127.0.0.1, port_value: $admin}}}
static_resources:
  listeners:
  - address: {socket_address: {address: 127.0.0.1, port_value: $listen}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": $hcm_type
          stat_prefix: bench
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: $access_log
              log_format: {json_format: $log_format}
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes: [{match: {prefix: /}, route: {cluster: pool, timeout: 0s}}]
          http_filters:
$ext_proc_filter
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: pool
    type: STATIC
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $upstream}}}
$ext_proc_cluster
"""

# The shipped config's routing filter, as far as the request side goes (nothing on the response).
_EXT_PROC_FILTER = """\
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: ext_proc}}
              message_timeout: 5s
              processing_mode:
                {request_header_mode: SEND, request_body_mode: BUFFERED, response_header_mode: SKIP}
              metadata_options: {receiving_namespaces: {untyped: [envoy.lb]}}"""

_EXT_PROC_CLUSTER = """\
  - name: ext_proc
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - lb_endpoints:
$endpoints"""
_ENDPOINT = "        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %d}}}"


def envoy_config(listen: int, admin: int, upstream: int, ext_proc: list[int], access_log: Path) -> str:
    """A listener routing to one replica, with the routing ext_proc filter on the servers at
    `ext_proc` (none: without the filter)."""
    cluster = _EXT_PROC_CLUSTER.replace("$endpoints", "\n".join(_ENDPOINT % port for port in ext_proc))
    return string.Template(_ENVOY).substitute(
        hcm_type="type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        admin=admin,
        listen=listen,
        upstream=upstream,
        access_log=access_log,
        log_format=json.dumps(_LOG_FORMAT),
        ext_proc_filter=_EXT_PROC_FILTER if ext_proc else "",
        ext_proc_cluster=cluster if ext_proc else "",
    )


@dataclass
class Row:
    name: str
    listen: int
    access_log: Path
    servers: list[Proc] = field(default_factory=list)
    envoy: Proc | None = None
    # per concurrency level: TTFTs (seconds), the server's CPU seconds, requests
    ttft: dict[int, list[float]] = field(default_factory=dict)
    cpu: dict[int, float] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)


def start_server(kind: str, port: int, upstream: int, log: Path) -> Proc:
    """One ext_proc server: the picker (without peers), or a do-nothing one on stack `kind`."""
    if kind == PICKER:
        argv = serve_argv(
            port, free_port(), free_port(), "--secure-serving=false", "--endpoints", f"127.0.0.1:{upstream}"
        )
        ready = "picker ready"
    else:
        argv = [sys.executable, "-m", "loadtest.ext_proc_bare", "--stack", kind, "--port", str(port)]
        argv += ["--upstream", f"127.0.0.1:{upstream}"]
        ready = "listening"
    server = Proc(kind, argv, log)
    server.wait_ready(lambda: ready in server.log_text())
    return server


def start_row(name: str, workdir: Path, upstream: int) -> Row:
    listen, admin = free_port(), free_port()
    slug = name.replace(" ", "-")
    row = Row(name, listen, workdir / f"{slug}.access.log")
    ext_proc: list[int] = []
    if name != BASELINE:
        kind = name.removesuffix(SPLIT)
        ext_proc = [free_port() for _ in range(2 if name.endswith(SPLIT) else 1)]
        for index, port in enumerate(ext_proc):
            row.servers.append(start_server(kind, port, upstream, workdir / f"{slug}-{index}.log"))
    config = workdir / f"envoy-{listen}.yaml"
    config.write_text(envoy_config(listen, admin, upstream, ext_proc, row.access_log))
    argv = [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--log-level", "warn"]
    argv += ["--concurrency", "1", "--file-flush-interval-msec", "100"]
    envoy = row.envoy = Proc(f"envoy-{name}", argv, workdir / f"envoy-{listen}.log")
    envoy.wait_ready(lambda: health_ok(admin, "/ready") and port_open(listen), timeout=30)
    return row


def log_entries(row: Row) -> list[dict[str, str | None]]:
    """The row's measured requests in Envoy's access log, once every one of them is there (Envoy
    flushes the file every 100 ms); what is there after the deadline otherwise."""
    expected = sum(row.requests.values())

    def entries() -> list[dict[str, str | None]]:
        lines = row.access_log.read_text().splitlines() if row.access_log.exists() else []
        return [e for e in map(json.loads, filter(None, lines)) if e.get("level") not in (None, "-")]

    with contextlib.suppress(TimeoutError):
        wait_until(lambda: len(entries()) >= expected, 5, what=f"{row.name}'s access-log entries")
    return entries()


def envoy_timings(entries: list[dict[str, str | None]], level: int) -> dict[str, float | None]:
    """Median of each of Envoy's timings over the requests at `level` (None: not measured)."""
    entries = [e for e in entries if e.get("level") == str(level)]
    out: dict[str, float | None] = {}
    for key in _LOG_FORMAT:
        values = [float(e[key] or 0) for e in entries if e.get(key) not in (None, "-", "")]
        out[key] = statistics.median(values) if values else None
    return out


async def measure(rows: list[Row], levels: list[int], count: int, rounds: int, tokens: int) -> None:
    for row in rows:  # warm every path: connections, caches, Envoy's pools
        await closed_loop(row.listen, stream_request(tokens), 1, 20, 10)
    for _ in range(rounds):
        for level in levels:
            request = stream_request(tokens, extra_headers=f"{_LEVEL_HEADER}: {level}\r\n".encode())
            for row in rows:
                before = sum(cpu_seconds(server.pid) for server in row.servers)
                results, _ = await closed_loop(row.listen, request, level, count // rounds, 60)
                if row.servers:
                    spent = sum(cpu_seconds(server.pid) for server in row.servers) - before
                    row.cpu[level] = row.cpu.get(level, 0.0) + spent
                row.requests[level] = row.requests.get(level, 0) + len(results)
                row.ttft.setdefault(level, []).extend(ttfts(results))


def _per_request(row: Row, level: int) -> float:
    return row.cpu[level] / row.requests[level]


def report(rows: list[Row], levels: list[int]) -> None:
    base = {level: percentile(rows[0].ttft[level], 50) for level in levels}
    print(
        f"{'server':18} | {'conc':>4} | {'TTFT p50/p99 ms':>15} | {'added p50':>9} | "
        f"{'before upstream':>15} | {'headers rt':>10} | {'body rt':>8} | {'CPU/req':>8}"
    )
    for row in rows:
        logged = log_entries(row)
        for level in levels:
            timings = envoy_timings(logged, level)

            def us(key: str, t: dict[str, float | None] = timings) -> str:
                value = t[key]
                return "-" if value is None else f"{value:.0f} us"

            done = row.requests.get(level, 0)
            cpu = f"{row.cpu[level] / done * 1e6:.0f} us" if row.servers and done else "-"
            p50, p99 = percentile(row.ttft[level], 50), percentile(row.ttft[level], 99)
            added = "-" if row.name == BASELINE else f"+{(p50 - base[level]) * 1e3:.2f}"
            print(
                f"{row.name:18} | {level:4d} | {p50 * 1e3:6.2f} / {p99 * 1e3:6.2f} | {added:>9} | "
                f"{us('before_upstream_us'):>15} | {us('headers_rt_us'):>10} | {us('body_rt_us'):>8} | "
                f"{cpu:>8}"
            )
    print("  (Envoy's timings are medians; rt: an ext_proc round trip as Envoy saw it; CPU: the server's)")
    split = [row for row in rows if row.name.endswith(SPLIT)]
    by_name = {row.name: row for row in rows}
    for row in split:
        one = by_name.get(row.name.removesuffix(SPLIT))
        if one is None:
            continue
        ratios = [
            f"{level}: x {_per_request(row, level) / _per_request(one, level):.2f}"
            for level in levels
            if row.requests.get(level) and one.requests.get(level) and one.cpu.get(level)
        ]
        print(f"  {row.name} against one, CPU per request at each level: {', '.join(ratios)}")


async def run(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.levels.split(",")]
    stacks = [s for s in STACKS if s != "grpclib" or importlib.util.find_spec("grpclib") is not None]
    if "grpclib" not in stacks:
        print("grpclib is not installed: its row is left out (pip install grpclib)")
    print(f"bench_grpc_servers on {len(levels)} levels, {args.count} streams per level per row ({load()})")
    with tempfile.TemporaryDirectory(prefix="bench-grpc-") as tmp:
        workdir = Path(tmp)
        upstream = free_port()
        sim = Proc("sim", sim_argv([upstream], ("--ttft-ms", "5", "--itl-ms", "5")), workdir / "sim.log")
        rows: list[Row] = []
        try:
            sim.wait_ready(lambda: health_ok(upstream))
            names = [BASELINE, *stacks, PICKER, *(f"{s}{SPLIT}" for s in args.split.split(",") if s)]
            if args.rows:
                names = [n for n in names if n in args.rows.split(",") or n == BASELINE]
            for name in names:
                rows.append(start_row(name, workdir, upstream))
            await measure(rows, levels, args.count, args.rounds, args.tokens)
            report(rows, levels)
        finally:
            for row in rows:
                for proc in (row.envoy, *row.servers):
                    if proc is not None:
                        proc.stop()
            sim.stop()
    print(f"({load()} at end)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,16", help="client concurrency levels")
    parser.add_argument("--count", type=int, default=300, help="streams per level per row")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds the count is split into")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument(
        "--split",
        default=f"grpc-aio-uvloop,{PICKER}",
        help="rows also run as two servers behind one cluster (issue 23), comma-separated",
    )
    parser.add_argument("--rows", default="", help="only these rows (and Envoy alone), comma-separated")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
