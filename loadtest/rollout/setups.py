"""The two pools a rollout is run against, each with its own way of taking a replica out.

`RoundRobinSetup` is the setup operators have today: Envoy round robin over an EDS file, active
/health checks, the replica removed from the file when Kubernetes removes its endpoint (which happens
together with SIGTERM, and reaches Envoy `propagation_s` later). `PickerSetup` is Envoy + the picker
with the Kubernetes sequence a preStop hook makes possible: the endpoint turns terminating in the
picker's source -> `picker drain-wait` (preStop) against the replica's /metrics -> SIGTERM (the
simulator's --shutdown-timeout drain mode) -> removed once the process is gone. `ProxyResumeSetup` is
the same sequence through `picker proxy` with `streams.resume` on, where a stream whose replica dies
continues on another one (the rollout run that also SIGKILLs a replica).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import string
import sys
from pathlib import Path
from typing import Any, Protocol

import httpx

from loadtest import http_client
from loadtest.procs import Proc, free_port, port_open, wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.rollout.attribution import upstreams_from_file
from loadtest.rollout.fleet import Fleet
from loadtest.stack import Stack, StackOptions, health_ok
from picker.cli.envoyconf import envoy_binary
from picker.config.model import parse_address
from picker.drain import scorecard

TEMPLATE = Path(__file__).resolve().parent / "envoy-round-robin.yaml"
LOAD_ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def cpu_seconds(proc: Proc | None) -> float:
    """User + system CPU time a live child has used so far (Linux /proc), 0 when unknown."""
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split() if proc else []
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


class PoolSetup(Protocol):
    title: str
    url: str

    def cpu(self) -> dict[str, float]: ...

    async def start(self) -> None: ...
    async def add(self, address: str) -> None: ...
    async def terminate(self, address: str) -> None: ...
    def drain_rows(self) -> list[dict[str, Any]] | None: ...
    def upstreams(self, expected: int) -> dict[str, str]: ...
    def stop(self) -> None: ...


def _replace(path: Path, text: str, temp_dir: Path) -> None:
    """Atomic replace (a rename into place): readers never see half a file."""
    temp = temp_dir / (path.name + ".tmp")
    temp.write_text(text)
    os.replace(temp, path)


def _envoy_argv(config: Path) -> list[str]:
    return [
        envoy_binary(),
        "-c",
        str(config),
        "--use-dynamic-base-id",
        "--log-level",
        "warn",
        "--concurrency",
        "1",
        "--file-flush-interval-msec",  # the access log is read at the end of the run
        "100",
    ]


class RoundRobinSetup:
    title = "Envoy round robin + /health checks + endpoint removal at SIGTERM (no picker)"

    def __init__(self, workdir: Path, fleet: Fleet, *, propagation_s: float, grace_s: float) -> None:
        self.workdir, self.fleet = workdir, fleet
        self.propagation_s, self.grace_s = propagation_s, grace_s
        self.listen_port, self.admin_port = free_port(), free_port()
        self.eds_dir = workdir / "eds"
        self.eds_path = self.eds_dir / "pool.json"
        self.access_log = workdir / "envoy-rr-access.log"
        self.members: list[str] = list(fleet.first)
        self.version = 0
        self.envoy: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def _write_eds(self) -> None:
        self.version += 1
        lb_endpoints = []
        for address in self.members:
            host, port = parse_address(address)
            lb_endpoints.append(
                {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            )
        body = {
            "version_info": str(self.version),
            "resources": [
                {
                    "@type": LOAD_ASSIGNMENT,
                    "cluster_name": "pool",
                    "endpoints": [{"lb_endpoints": lb_endpoints}],
                }
            ],
        }
        _replace(self.eds_path, json.dumps(body), self.workdir)

    def _healthy(self) -> set[str]:
        try:
            text = http_client.get(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=2).text
        except httpx.HTTPError:
            return set()
        return {
            line.split("::")[1]
            for line in text.splitlines()
            if line.startswith("pool::") and line.endswith("::health_flags::healthy")
        }

    async def start(self) -> None:
        self.eds_dir.mkdir(parents=True, exist_ok=True)
        self._write_eds()
        config = self.workdir / "envoy-round-robin.yaml"
        values = {
            "ADMIN_PORT": self.admin_port,
            "LISTEN_PORT": self.listen_port,
            "EDS_PATH": self.eds_path,
            "EDS_DIR": self.eds_dir,
            "ACCESS_LOG": self.access_log,
        }
        config.write_text(string.Template(TEMPLATE.read_text()).substitute(values))
        self.envoy = Proc("envoy-rr", _envoy_argv(config), self.workdir / "envoy-rr.log")
        await asyncio.to_thread(
            self.envoy.wait_ready,
            lambda: health_ok(self.admin_port, "/ready") and port_open(self.listen_port),
            30,
        )
        await asyncio.to_thread(
            wait_until, lambda: set(self.members) <= self._healthy(), 20, 0.05, "healthy pool"
        )

    async def add(self, address: str) -> None:
        self.members.append(address)
        self._write_eds()
        await asyncio.to_thread(
            wait_until, lambda: address in self._healthy(), 20, 0.05, f"{address} healthy"
        )
        self.fleet.mark(address, "ready")

    async def terminate(self, address: str) -> None:
        """SIGTERM and endpoint removal start together; the removal reaches Envoy `propagation_s` later."""
        self.fleet.mark(address, "draining")
        self.fleet.moment(address, "SIGTERM")
        self.fleet.procs[address].signal(signal.SIGTERM)
        exited = asyncio.create_task(self.fleet.wait_exit(address, self.grace_s))
        await asyncio.sleep(self.propagation_s)  # models the endpoint controller -> control plane -> Envoy
        self.members.remove(address)
        self._write_eds()
        self.fleet.moment(address, "router told")
        await exited

    def drain_rows(self) -> list[dict[str, Any]] | None:
        return None

    def upstreams(self, expected: int) -> dict[str, str]:
        """request id -> replica, from Envoy's access log, once it holds `expected` entries (or 5 s)."""
        return upstreams_from_file(self.access_log, expected)

    def cpu(self) -> dict[str, float]:
        return {"Envoy": cpu_seconds(self.envoy)}

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()


class PickerSetup:
    title = "Envoy + picker: terminating -> picker drain-wait (preStop) -> SIGTERM -> removed"

    def __init__(
        self, workdir: Path, fleet: Fleet, *, propagation_s: float, grace_s: float, source: str = "file"
    ) -> None:
        if source not in ("file", "admin"):
            raise ValueError(f"source must be file or admin, not {source!r}")
        self.workdir, self.fleet = workdir, fleet
        self.propagation_s, self.grace_s, self.source = propagation_s, grace_s, source
        self.endpoints_path = workdir / "endpoints.yaml"
        self.entries: dict[str, bool] = dict.fromkeys(fleet.first, False)  # address -> draining
        if source == "file":
            config = workdir / "picker.yaml"
            config.write_text(
                json.dumps(
                    {"pool": {"endpoints_file": str(self.endpoints_path), "endpoints_file_poll_s": 0.1}}
                )
            )
            options = StackOptions(replicas=0, static_endpoints=False, picker_args=("--config", str(config)))
        else:
            options = StackOptions(replicas=0, picker_endpoints=fleet.every_address)
        # Envoy's pool lists every address the rollout will use: override_host reaches only members.
        options.extra_envoy_endpoints = fleet.every_address
        self.stack = Stack(workdir, options)
        self.hooks: list[Proc] = []
        self.title += f" (source: {source})"

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.stack.metrics_port}"

    def _write_file(self) -> None:
        entries = [{"address": a, "draining": d} for a, d in self.entries.items()]
        _replace(self.endpoints_path, json.dumps(entries), self.workdir)

    def _states(self) -> dict[str, str]:
        view = http_client.get(self.admin_url + "/admin/endpoints", timeout=5).json()
        return {e["address"]: e["state"] for e in view["endpoints"]}

    async def _post(self, address: str, verb: str) -> None:
        async with http_client.AsyncClient(timeout=5) as client:
            (await client.post(f"{self.admin_url}/admin/endpoints/{address}/{verb}")).raise_for_status()

    async def _until_state(self, address: str, state: str) -> None:
        await asyncio.to_thread(
            wait_until, lambda: self._states().get(address) == state, 20, 0.05, f"{address} {state}"
        )

    async def start(self) -> None:
        if self.source == "file":
            self._write_file()
        await asyncio.to_thread(self.stack.start)
        if self.source == "admin":  # replacements are listed but not running: keep them out for now
            for address in self.fleet.replacements:
                await self._post(address, "drain")
        for address in self.fleet.first:
            await self._until_state(address, "ready")

    async def add(self, address: str) -> None:
        if self.source == "file":
            self.entries[address] = False
            self._write_file()
        else:
            await self._post(address, "undrain")
        await self._until_state(address, "ready")
        self.fleet.mark(address, "ready")

    async def terminate(self, address: str) -> None:
        self.fleet.mark(address, "draining")
        hook = Proc(
            f"drain-wait-{address}",
            [
                sys.executable,
                "-m",
                "picker",
                "drain-wait",
                "--metrics-url",
                f"http://{address}/metrics",
                "--quiet-interval",
                "0.5",
                "--poll-interval",
                "0.1",
                "--deadline",
                str(self.grace_s),
            ],
            self.workdir / f"drain-wait-{address.replace(':', '-')}.log",
        )
        self.hooks.append(hook)
        await asyncio.sleep(self.propagation_s)  # the same propagation delay as the round-robin setup
        if self.source == "file":
            self.entries[address] = True
            self._write_file()
        else:
            await self._post(address, "drain")
        self.fleet.moment(address, "router told")
        await asyncio.to_thread(hook.wait_exit, self.grace_s + 5)
        hook.stop()
        self.fleet.moment(address, "SIGTERM")
        self.fleet.procs[address].signal(signal.SIGTERM)
        await self.fleet.wait_exit(address, self.grace_s)
        if self.source == "file":
            del self.entries[address]
            self._write_file()

    def drain_rows(self) -> list[dict[str, Any]] | None:
        """The picker's scorecard rows for the replicas the rollout replaced (GET /admin/drains)."""
        if self.source == "file":
            wait_until(
                lambda: all(not r.get("open") for r in self._rows()), 10, 0.05, "drain records to close"
            )
        return self._rows()

    def upstreams(self, expected: int) -> dict[str, str]:
        """request id -> replica, from the shipped Envoy config's file access log (it logs `x-request-id`)."""
        return upstreams_from_file(self.stack.access_log, expected)

    def cpu(self) -> dict[str, float]:
        return {"picker": cpu_seconds(self.stack.picker), "Envoy": cpu_seconds(self.stack.envoy)}

    def _rows(self) -> list[dict[str, Any]]:
        rows = scorecard.score(scorecard.fetch(self.admin_url), self.grace_s)
        return [r for r in rows if r["endpoint"] in self.fleet.first]

    def stop(self) -> None:
        for hook in self.hooks:
            hook.stop()
        self.stack.stop()


class ProxyResumeSetup(PickerSetup):
    """`picker proxy` with streams.resume=always (the load's requests sample: the simulator's tokens
    are greedy-like, so the continuation is exact anyway) and the same drain sequence."""

    title = "picker proxy + resume: terminating -> drain-wait -> SIGTERM; one replica SIGKILLed"

    def __init__(self, workdir: Path, fleet: Fleet, *, propagation_s: float, grace_s: float) -> None:
        super().__init__(workdir, fleet, propagation_s=propagation_s, grace_s=grace_s, source="file")
        options = self.stack.options
        options.picker_env = {"PICKER_STREAMS__RESUME": "always"}
        self.stack = ProxyStack(workdir, options)

    def upstreams(self, expected: int) -> dict[str, str]:
        return {}  # no Envoy access log in this shape

    def resumes(self) -> dict[str, float]:
        """picker_stream_resumes_total by reason: the streams continued on another replica."""
        page = self.stack.picker_metrics()
        return {dict(k)["reason"]: v for (n, k), v in page.items() if n == "picker_stream_resumes_total"}

    def cpu(self) -> dict[str, float]:
        return {"picker proxy": cpu_seconds(self.stack.picker)}
