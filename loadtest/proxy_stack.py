"""`picker proxy` on loopback in front of simulated vLLM replicas: the Envoy-free stack.

The same interface as `loadtest.stack.Stack` (url, replicas, metrics, faults, leak checks), so a test
or benchmark can run against either frontend.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from loadtest import http_client
from loadtest.procs import Proc, free_port, port_open, wait_until
from loadtest.stack import Stack, StackOptions, parse_metrics


class ProxyStack(Stack):
    """Replicas + `picker proxy`; `start()` returns once both answer. No Envoy."""

    frontend = "proxy"

    def start(self) -> ProxyStack:
        try:
            self.start_sims()
            self.start_picker()
        except BaseException:
            self.stop()
            raise
        return self

    def picker_argv(self) -> list[str]:
        endpoints = self.options.picker_endpoints
        endpoints = self.replicas if endpoints is None else list(endpoints)
        return [
            sys.executable,
            "-m",
            "picker",
            "proxy",
            "--bind-address",
            "127.0.0.1",
            "--port",
            str(self.listen_port),
            "--metrics-port",
            str(self.metrics_port),
            *(("--endpoints", ",".join(endpoints)) if self.options.static_endpoints else ()),
            "--quiet-interval",
            "0.2",
            *self.options.picker_args,
        ]

    def start_picker(self) -> None:
        self.picker = Proc(
            "picker-proxy", self.picker_argv(), self.workdir / "picker-proxy.log", env=self.options.picker_env
        )
        self.picker.wait_ready(
            lambda: "picker proxy ready" in self.picker.log_text() and port_open(self.listen_port)  # type: ignore[union-attr]
        )

    def start_envoy(self) -> None:
        """No Envoy in this stack."""


class PeeredProxies(ProxyStack):
    """Two `picker proxy` processes, peers of each other (one set of books, the channel's credential),
    both reading one endpoints file (so a drain through either reaches both pools): the replicas'
    (`options.replicas`), or `endpoints` (real engines started elsewhere)."""

    def __init__(self, workdir: Path, options: StackOptions, endpoints: Sequence[str] | None = None) -> None:
        super().__init__(workdir, replace(options, static_endpoints=False, pickers=2, peers=True))
        workdir.mkdir(parents=True, exist_ok=True)
        self.proxy_ports = [self.listen_port, free_port()]
        listed = workdir / "endpoints.yaml"
        addresses = self.replicas if endpoints is None else list(endpoints)
        listed.write_text(json.dumps([{"address": a} for a in addresses]))  # JSON is YAML
        config = workdir / "picker.yaml"
        config.write_text(json.dumps({"pool": {"endpoints_file": str(listed), "endpoints_file_poll_s": 0.1}}))
        self.options.picker_args = ("--config", str(config))

    def proxy_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.proxy_ports[index]}"

    def admin_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.picker_ports[index][2]}"

    def peer_name(self, index: int) -> str:
        return f"127.0.0.1:{self.peer_ports[index]}"

    def picker_argv(self, index: int = 0) -> list[str]:
        return [
            sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1",
            "--port", str(self.proxy_ports[index]), "--metrics-port", str(self.picker_ports[index][2]),
            "--quiet-interval", "0.2", *self.peer_args(index), *self.options.picker_args,
        ]  # fmt: skip

    def start_picker(self) -> None:
        for index, port in enumerate(self.proxy_ports):
            log = self.workdir / f"picker-proxy-{index}.log"
            proc = Proc(f"picker-proxy-{index}", self.picker_argv(index), log, env=self.options.picker_env)
            self.pickers[index] = proc  # stopped by Stack.stop, started or not
            self.picker = self.picker or proc
            proc.wait_ready(
                lambda p=proc, port=port: "picker proxy ready" in p.log_text() and port_open(port)
            )
        for index in range(2):  # each one's link to the other is open: they share the books
            wait_until(lambda i=index: self.metric(i, "picker_peers_connected") == 1, 15, what="peer links")

    def metric(self, index: int, name: str, **labels: str) -> float:
        text = http_client.get(f"{self.admin_url(index)}/metrics", timeout=5).text
        return parse_metrics(text).get((name, tuple(sorted(labels.items()))), 0.0)
