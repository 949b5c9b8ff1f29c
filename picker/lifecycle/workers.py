"""`picker serve --workers N`: N picker processes in one pod, one ext_proc port, one set of books.

Why: one Python process tops out near one core, three quarters of a pick's CPU being grpc.aio's own
machinery (docs/benchmarks.md). Rather than a second kind of picker, the workers are the pickers the
project already runs side by side (picker/peers/): each binds the ext_proc port with SO_REUSEPORT, so
the kernel hands each new connection to one of them, and all are peers of one another on loopback,
proving a credential the parent draws for this pod alone. So a request's end reaches the worker that
routed it and every worker counts the others' requests and drain records, as between pods. Admin
drains reach the other workers as they reach other pods, through a shared store: the endpoints
file (static `pool.endpoints` are written to one for the workers to share) or, with a Kubernetes
source, the drains ConfigMap, which is then required.

Worker i (0-based) keeps the pod's ports where it must differ: the metrics and admin port is
`server.metrics_port + i`, the peer port `peers.port + i` on 127.0.0.1; worker 0 alone answers
the gRPC health port (the others' is any free port): the pod's readiness and liveness are worker
0's (a worker whose own source fails goes on serving its share; its metrics say so). The workers
stop and die as one: the parent forwards SIGTERM and SIGINT to every worker (each drains by the
shutdown contract), and a worker that exits unasked is logged and the others are stopped the same
way, the parent then exiting non-zero so that Kubernetes restarts the container. Nothing is
restarted here, silently or not.

The parent imports no gRPC and serves nothing; it waits on its children (os.wait), so it also reaps
them as a container's PID 1 must. A worker's config, credential included, goes down its stdin as a
pickle (never argv, the environment or a log); that pipe stays open while the parent lives, and a
worker that reads its end (the parent gone, even SIGKILLed) shuts down as on SIGTERM.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import yaml
from pydantic import SecretStr

from picker.config.model import ConfigError, PickerConfig, format_address
from picker.lifecycle.startup import bind_problem, cannot_listen

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
WORKER_MODULE = "picker.cli.worker"  # `python -m picker.cli.worker`: one worker's entry point


def worker_configs(config: PickerConfig, secret: str, endpoints_file: Path | None) -> list[PickerConfig]:
    """Each worker's config: the pod's, with its own metrics and peer ports and the pod's peers.

    `endpoints_file`: where the parent wrote static `pool.endpoints` (required then), which every
    worker watches instead, so that an admin drain through one is applied by all (below).
    ConfigError naming the field when the pod's config cannot be split this way.
    """
    count, peers, kube = config.server.workers, config.peers, config.kube
    if peers.members or peers.service is not None:
        raise ConfigError(
            "server.workers > 1 makes a pod's workers peers of one another on loopback; "
            "peers.members and peers.service (pickers in other pods) are not supported with it"
        )
    if config.server.grpc_port == 0:
        raise ConfigError("server.grpc_port: with server.workers > 1 the workers share it: it must be fixed")
    if peers.port == 0:
        raise ConfigError("peers.port: with server.workers > 1, worker i serves its peers on peers.port + i")
    if peers.port + count - 1 > 65535 or config.server.metrics_port + count - 1 > 65535:
        raise ConfigError("server.workers: peers.port or server.metrics_port + workers passes 65535")
    # The peer channel shares in-flight counts and drain records, not the admin API's drains: those
    # reach other pickers through a shared store (picker/sources/drain_store.py), as between pods.
    kube_source = any(
        v is not None for v in (kube.service, kube.label_selector, kube.pool_name, kube.endpoint_selector)
    )
    if kube_source and kube.drains_configmap is None:
        raise ConfigError(
            "kube.drains_configmap: with server.workers > 1 an admin drain through one worker must "
            "reach the others (--drains-configmap)"
        )
    pool = config.pool
    if pool.endpoints:
        if endpoints_file is None:
            raise ConfigError("pool.endpoints: with server.workers > 1 they are served from a file")
        pool = pool.model_copy(update={"endpoints": (), "endpoints_file": endpoints_file})
    members = tuple(format_address(LOOPBACK, peers.port + i) for i in range(count))
    out = []
    for i in range(count):
        server = config.server.model_copy(
            update={
                "metrics_port": config.server.metrics_port + i if config.server.metrics_port else 0,
                "health_port": config.server.health_port if i == 0 else 0,
            }
        )
        own = peers.model_copy(
            update={
                "members": members,
                "port": peers.port + i,
                "advertise": members[i],
                "bind_address": LOOPBACK,
                "secret": SecretStr(secret),
                "allow_unauthenticated": False,
            }
        )
        out.append(config.model_copy(update={"server": server, "peers": own, "pool": pool}))
    return out


def write_endpoints_file(directory: Path, endpoints: tuple[str, ...]) -> Path:
    """Static endpoints as an endpoints file (picker/sources/static_file.py) the workers share: the
    admin API records a drain there, and each worker reads it within pool.endpoints_file_poll_s."""
    path = directory / "endpoints.yaml"
    path.write_text(yaml.safe_dump(list(endpoints), default_flow_style=False))
    return path


def ports_problem(config: PickerConfig, workers: list[PickerConfig]) -> str | None:
    """Why the workers could not all listen, naming the field, or None: the pod's own ports probed as
    one picker's (no SO_REUSEPORT: a port another process holds is refused, even a `--workers`
    picker's), then each worker's metrics and peer ports, none of which may repeat another."""
    problem = cannot_listen(config)
    if problem is not None:
        return problem
    server = config.server
    taken = {p for p in (server.grpc_port, server.health_port, server.metrics_port) if p}
    for i, worker in enumerate(workers):
        own = [(worker.peers.port, "peers.port", LOOPBACK)]
        if i > 0 and worker.server.metrics_port:
            own.append((worker.server.metrics_port, "server.metrics_port", server.bind_address))
        for port, field, bind in own:
            name = f"{field} + {i} (worker {i})"
            if port in taken:
                return f"{name}: port {port} is another of the pod's ports"
            taken.add(port)
            problem = bind_problem(bind, port, name, "server.bind_address")
            if problem is not None:
                return problem
    return None


def claim_port(config: PickerConfig) -> socket.socket | str:
    """Hold the pod's ext_proc port for this group of workers, or say why not: an abstract Unix
    socket named after the port, held while the parent lives. Its workers bind
    the port with SO_REUSEPORT only after their sources start (seconds with a Kubernetes sync), so
    a second `--workers` group started meanwhile would pass `ports_problem`'s probe and share the
    port silently: this name is taken at once, and the second group is refused."""
    port = config.server.grpc_port  # by port alone: 0.0.0.0, :: and an address overlap under SO_REUSEPORT
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0inference-picker/ext-proc/{port}")
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return f"server.grpc_port: port {port} is being taken by another picker --workers group"
        return f"server.grpc_port: cannot claim port {port} for the workers: {exc.strerror}"
    return sock


@dataclass
class _Worker:
    index: int
    popen: subprocess.Popen[bytes]


class Workers:
    """The parent: starts the workers, forwards signals to them, waits until every one has exited."""

    def __init__(self, configs: list[PickerConfig]) -> None:
        self._configs = configs
        self._live: dict[int, _Worker] = {}
        self._stopping = False
        self._failed = False
        self._asked = signal.SIGTERM  # the signal forwarded to the workers (an exit by it is asked)

    def run(self) -> int:
        """Start every worker, then wait for all: 0 when each stopped cleanly because it was asked."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        for index, config in enumerate(self._configs):
            if self._stopping:  # signalled while starting: start no more
                break
            try:
                worker = self._start(index, config)
            except OSError as exc:  # no process, or it died before reading its config
                log.error("worker could not start index=%d: %s; stopping the others", index, exc)
                self._failed = self._stopping = True
                break
            self._live[worker.popen.pid] = worker
        log.info("workers started count=%d pids=%s", len(self._live), ",".join(map(str, self._live)))
        if self._stopping:  # the last one started after the signal was forwarded
            self._signal(signal.SIGTERM)
        while self._live:
            try:
                pid, status = os.wait()  # a signal's handler runs, then the wait resumes (PEP 475)
            except ChildProcessError:  # cannot happen while workers are live: said, not looped on
                log.error("workers lost pids=%s", ",".join(map(str, self._live)))
                return 1
            worker = self._live.pop(pid, None)
            if worker is not None:
                self._exited(worker, os.waitstatus_to_exitcode(status))
        return 1 if self._failed else 0

    def _signal(self, sig: int) -> None:
        """By PID (not Popen.send_signal, which polls and could reap a worker before os.wait sees it);
        a live worker is not reaped yet, so its PID is still its own (one reaped between os.wait's
        return and its removal from `_live`, as this runs in a signal handler, is skipped)."""
        for pid in list(self._live):
            with suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _start(self, index: int, config: PickerConfig) -> _Worker:
        popen = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the parent, which forwards it once
        )
        assert popen.stdin is not None
        popen.stdin.write(pickle.dumps((index, config)))
        popen.stdin.flush()  # left open: its end tells the worker that the parent is gone
        return _Worker(index, popen)

    def _forward(self, sig: int, _frame: FrameType | None) -> None:
        """SIGTERM or SIGINT to every worker (a second one skips each worker's drain to its end)."""
        self._stopping, self._asked = True, sig
        self._signal(sig)

    def _exited(self, worker: _Worker, code: int) -> None:
        worker.popen.returncode = code  # reaped here, not by Popen
        # asked to stop: a clean exit, or SIGTERM's default action before the worker could handle it
        # (still importing: it had nothing to drain)
        if self._stopping and code in (0, -signal.SIGTERM, -self._asked):
            log.info("worker stopped index=%d pid=%d", worker.index, worker.popen.pid)
            return
        self._failed = True
        log.error(
            "worker exited index=%d pid=%d code=%d%s",
            worker.index,
            worker.popen.pid,
            code,
            "" if self._stopping else ": stopping the others; the pod exits non-zero to be restarted",
        )
        if not self._stopping:
            self._stopping = True
            self._signal(signal.SIGTERM)
