"""The whole routing stack on loopback: simulated vLLM replicas, the picker, and the real Envoy.

Used by the tests, `picker demo` and the benchmarks; every process is a child stopped by its PID.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from loadtest import http_client
from loadtest.procs import Proc, free_port, port_open, wait_until
from loadtest.relay import Relay
from picker.cli.envoyconf import SHIPPED, EnvoyParams, envoy_binary, render, shape_template


@dataclass
class StackOptions:
    replicas: int = 3
    # Streams long enough to overlap (tokens 25 ms apart), short enough for a quick test suite.
    sim_args: Sequence[str] = ("--ttft-ms", "20", "--itl-ms", "25")
    picker_args: Sequence[str] = ()
    failure_mode_allow: bool = False
    extra_envoy_endpoints: Sequence[str] = ()  # members of Envoy's pool the picker does not know
    picker_endpoints: Sequence[str] | None = None  # default: the replicas
    static_endpoints: bool = True  # False: no --endpoints; picker_args names the source (file, kube)
    envoy_concurrency: int = 1
    shape: str = SHIPPED  # the Envoy config template: picker.cli.envoyconf.SHAPES (gateway-shaped ones)
    # TLS on the Envoy -> picker hop, both ends (the shipped default); False: --secure-serving=false
    envoy_picker_tls: bool = True
    # Envoy's pool cluster over EDS from the picker (the shipped default); None: EDS unless
    # extra_envoy_endpoints names members the picker does not know (those need a STATIC cluster).
    eds: bool | None = None
    # >1: that many pickers (one source each, same endpoints) behind Envoy's one picker cluster, with
    # gRPC health checks on `readiness` (issue 13 HA). Plaintext only: the health port has no TLS.
    pickers: int = 1
    # False: the lean shape (no observer filter; the access log ends requests), flushed this often
    observer: bool = True
    access_log_flush_interval: str = "0.1s"
    # gateway shapes: add Envoy's gRPC access log to the picker (kgateway's HTTPListenerPolicy can)
    picker_access_log: bool = False
    routing_response_body: str = "NONE"  # STREAMED / FULL_DUPLEX_STREAMED: the routing stream tracks bodies
    picker_env: dict[str, str] | None = None  # extra environment for the picker(s) (OTEL_*, ...)
    peers: bool = False  # with pickers > 1: one set of books over the channel between them (issue 23)
    # with peers: each picker is reached by its peers through a TCP relay the test can cut
    # (loadtest/relay.py; `Stack.relays[i]` stands for picker i's peer port)
    peer_relays: bool = False
    args_at: tuple[tuple[str, ...], ...] = ()  # more arguments for picker i (its own kubeconfig, ...)
    paired_port: int = 0  # each replica also binds its port + this (vLLM's KV events): kept free too
    # a mixed pool: replica i runs in a process of its own with sim_args + replica_args[i] (speed,
    # slots); empty: every replica in one process with sim_args alone
    replica_args: Sequence[Sequence[str]] = ()


def sim_argv(ports: Sequence[int], extra: Sequence[str] = ()) -> list[str]:
    argv = [sys.executable, "-m", "vllm_sim"]
    for port in ports:
        argv += ["--port", str(port)]
    return argv + list(extra)


def serve_argv(grpc_port: int, health_port: int, metrics_port: int, *extra: str) -> list[str]:
    """`picker serve` on loopback with these ports (test stacks, benchmarks, second pickers)."""
    return [
        sys.executable,
        "-m",
        "picker",
        "serve",
        "--bind-address",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
        *extra,
    ]


def health_ok(port: int, path: str = "/health") -> bool:
    try:
        return http_client.get(f"http://127.0.0.1:{port}{path}", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples keyed by (name, sorted labels): easy to look up in tests and reports."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def picker_ready(health_port: int) -> bool:
    """The picker's gRPC `readiness` answers SERVING (what Envoy's health check of it reads)."""
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def with_picker_hosts(envoy_config: str, hosts: Sequence[tuple[int, int]]) -> str:
    """A rendered Envoy config whose picker cluster lists several pickers (grpc port, health port)
    and health-checks each on its gRPC `readiness` service: a picker that is shutting down or dead
    gets no new ext_proc stream (nor the EDS stream) once a check fails."""
    config = yaml.safe_load(envoy_config)
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "picker")
    cluster["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {
                    "endpoint": {
                        "address": {"socket_address": {"address": "127.0.0.1", "port_value": grpc}},
                        "health_check_config": {"port_value": health},
                    }
                }
                for grpc, health in hosts
            ]
        }
    ]
    cluster["health_checks"] = [
        {
            "timeout": "0.25s",
            "interval": "0.2s",
            "no_traffic_interval": "0.2s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": "readiness"},
        }
    ]
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}  # never route to a dead one
    return yaml.safe_dump(config, sort_keys=False)


class Stack:
    """Replicas + picker + Envoy; `start()` returns once all three answer."""

    def __init__(self, workdir: Path, options: StackOptions | None = None) -> None:
        self.workdir = workdir
        self.options = options or StackOptions()
        self.replica_ports = [free_port(self.options.paired_port) for _ in range(self.options.replicas)]
        self.listen_port, self.admin_port = free_port(), free_port()
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        # every picker's (grpc, health, metrics) ports, the first one's being the three above
        self.picker_ports = [(self.grpc_port, self.health_port, self.metrics_port)] + [
            (free_port(), free_port(), free_port()) for _ in range(self.options.pickers - 1)
        ]
        self.pickers: list[Proc | None] = [None] * self.options.pickers  # pickers[0] is `picker`
        self.peer_ports = [free_port() for _ in range(self.options.pickers)] if self.options.peers else []
        self.relays = [Relay(port) for port in self.peer_ports] if self.options.peer_relays else []
        self.sims: Proc | None = None
        self.more_sims: list[Proc] = []  # a mixed pool's processes after the first (replica_args)
        self.picker: Proc | None = None
        self.envoy: Proc | None = None
        self.access_log = workdir / "envoy-access.log"

    @property
    def replicas(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.replica_ports]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def start(self) -> Stack:
        try:
            for relay in self.relays:
                relay.start()
            self.start_sims()
            self.start_picker()
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def start_sims(self) -> None:
        if not self.replica_ports:
            return
        mixed = self.options.replica_args
        if not mixed:
            argv = sim_argv(self.replica_ports, self.options.sim_args)
            self.sims = Proc("sim", argv, self.workdir / "sim.log")
            for port in self.replica_ports:
                self.sims.wait_ready(lambda p=port: health_ok(p))
            return
        for index, (port, own) in enumerate(zip(self.replica_ports, mixed, strict=True)):
            argv = sim_argv([port], [*self.options.sim_args, *own])
            proc = Proc(f"sim-{index}", argv, self.workdir / f"sim-{index}.log")
            if self.sims is None:
                self.sims = proc
            else:
                self.more_sims.append(proc)
            proc.wait_ready(lambda p=port: health_ok(p))

    def picker_argv(self, index: int = 0) -> list[str]:
        grpc_port, health_port, metrics_port = self.picker_ports[index]
        endpoints = self.options.picker_endpoints
        endpoints = self.replicas if endpoints is None else list(endpoints)
        return serve_argv(
            grpc_port,
            health_port,
            metrics_port,
            *(("--endpoints", ",".join(endpoints)) if self.options.static_endpoints else ()),
            *(() if self.options.envoy_picker_tls else ("--secure-serving=false",)),
            # a quick end to the shutdown's propagation phase: tests and the demo stop stacks often
            "--quiet-interval",
            "0.2",
            # the lean shape: Envoy's access log ends every request, from the first one on
            *(() if self.options.observer else ("--response-end", "access-log")),
            *self.peer_args(index),
            *self.options.picker_args,
            *(self.options.args_at[index] if index < len(self.options.args_at) else ()),
        )

    def peer_args(self, index: int) -> tuple[str, ...]:
        if not self.peer_ports:
            return ()
        # with relays, each picker is known (and advertises itself) by its relay's address
        reached = [relay.port for relay in self.relays] or self.peer_ports
        members = ",".join(f"127.0.0.1:{port}" for port in reached)
        port = self.peer_ports[index]
        secret = self.workdir / "peer-secret"  # the pickers' credential, as a mounted Secret's key
        if not secret.exists():
            secret.write_text(secrets.token_hex(24) + "\n")
        return (
            "--peers",
            members,
            "--peer-port",
            str(port),
            "--peer-advertise",
            f"127.0.0.1:{reached[index]}",
            "--peer-secret-file",
            str(secret),
        )

    def start_picker(self) -> None:
        self.picker = Proc(
            "picker", self.picker_argv(), self.workdir / "picker.log", env=self.options.picker_env
        )
        self.picker.wait_ready(lambda: "picker ready" in self.picker.log_text())  # type: ignore[union-attr]
        self.pickers[0] = self.picker
        for index in range(1, self.options.pickers):
            self.start_picker_at(index)
        if self.options.peers:  # each holds readiness until linked to every peer: load starts then
            for index, (_, health, _) in enumerate(self.picker_ports):
                wait_until(lambda h=health: picker_ready(h), 15, what=f"picker {index} linked to its peers")

    def start_picker_at(self, index: int) -> Proc:
        """(Re)start picker `index` of a multi-picker stack (its log: picker-<index>.log, appended)."""
        name = "picker" if index == 0 else f"picker-{index}"
        proc = Proc(name, self.picker_argv(index), self.workdir / f"{name}.log", env=self.options.picker_env)
        proc.wait_ready(lambda: "picker ready" in proc.log_text())
        self.pickers[index] = proc
        if index == 0:
            self.picker = proc
        return proc

    def envoy_params(self) -> EnvoyParams:
        params = EnvoyParams(
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            picker_port=self.grpc_port,
            endpoints=[*self.replicas, *self.options.extra_envoy_endpoints],
            failure_mode_allow=self.options.failure_mode_allow,
            access_log=str(self.access_log),
            picker_tls=self.options.envoy_picker_tls,
            eds=not self.options.extra_envoy_endpoints if self.options.eds is None else self.options.eds,
            observer=self.options.observer,
            access_log_flush_interval=self.options.access_log_flush_interval,
            routing_response_body=self.options.routing_response_body,
            picker_access_log=self.options.picker_access_log,
        )
        return params

    def start_envoy(self) -> None:
        config = self.workdir / "envoy.yaml"
        text = render(self.envoy_params(), shape_template(self.options.shape))
        if self.options.pickers > 1:
            text = with_picker_hosts(text, [(grpc, health) for grpc, health, _ in self.picker_ports])
        config.write_text(text)
        argv = [
            envoy_binary(),
            "-c",
            str(config),
            "--use-dynamic-base-id",
            "--log-level",
            "warn",
            "--concurrency",
            str(self.options.envoy_concurrency),
            "--file-flush-interval-msec",  # the access-log file is read by tests: don't sit on it 10 s
            "100",
        ]
        self.envoy = Proc("envoy", argv, self.workdir / "envoy.log")
        self.envoy.wait_ready(
            lambda: health_ok(self.admin_port, "/ready") and port_open(self.listen_port), timeout=30
        )

    def picker_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = http_client.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return parse_metrics(text)

    def picker_value(self, name: str, **labels: str) -> float:
        return self.picker_metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def picker_queued(self) -> float:
        """Requests in the picker's admission queue (picker_flow_queue_size, whatever its pool label)."""
        return sum(v for (name, _), v in self.picker_metrics().items() if name == "picker_flow_queue_size")

    def sim_requests(self, replica: str) -> list[dict[str, object]]:
        """The replica's request log (GET /sim/requests), oldest first."""
        return http_client.get(f"http://{replica}/sim/requests", timeout=5).json()  # type: ignore[no-any-return]

    def sim_value(self, name: str) -> float:
        """A simulator metric summed over every replica and label set."""
        total = 0.0
        for replica in self.replicas:
            samples = parse_metrics(http_client.get(f"http://{replica}/metrics", timeout=5).text)
            total += sum(v for (n, _), v in samples.items() if n == name)
        return total

    def set_fault(self, replica: str, **spec: object) -> None:
        """A server-wide fault on one replica (POST /sim/faults), e.g. status=503 or reset_after=3."""
        http_client.post(f"http://{replica}/sim/faults", json=spec, timeout=5).raise_for_status()

    def wait_no_leaks(self, timeout: float = 10.0) -> None:
        """Every request the picker admitted has ended: its in-flight count is back to exactly 0."""
        wait_until(
            lambda: self.picker_value("picker_in_flight") == 0, timeout, what="picker in-flight to reach 0"
        )

    def stop(self) -> None:
        for proc in (self.envoy, self.picker, *self.pickers[1:], self.sims, *self.more_sims):
            if proc is not None:
                proc.stop()
        for relay in self.relays:
            relay.stop()
