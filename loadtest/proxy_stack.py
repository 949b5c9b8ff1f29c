"""`picker proxy` on loopback in front of simulated vLLM replicas: the Envoy-free stack.

The same interface as `loadtest.stack.Stack` (url, replicas, metrics, faults, leak checks), so a test
or benchmark can run against either frontend.
"""

from __future__ import annotations

import sys

from loadtest.procs import Proc, port_open
from loadtest.stack import Stack


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
