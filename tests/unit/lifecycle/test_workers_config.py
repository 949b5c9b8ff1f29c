"""How `picker serve --workers N` splits the pod's config (picker/lifecycle/workers.py), and the one
port the workers share: only they bind it with SO_REUSEPORT, and a single picker still refuses it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from loadtest.procs import free_port
from picker.config.model import ConfigError, PickerConfig
from picker.config.sources import load_config
from picker.extproc.server import ext_proc_server
from picker.lifecycle.workers import claim_port, ports_problem, worker_configs, write_endpoints_file
from picker.sources.static_file import parse_endpoints

SECRET = "s" * 64


def pod(workers: int = 3, **groups: dict[str, Any]) -> PickerConfig:
    server = {"bind_address": "127.0.0.1", "workers": workers, **groups.pop("server", {})}
    peers = {"port": 9104, **groups.pop("peers", {})}
    return load_config(overrides={"server": server, "peers": peers, **groups})


def test_each_worker_has_its_own_metrics_and_peer_port_and_all_are_peers_on_loopback() -> None:
    configs = worker_configs(pod(server={"metrics_port": 9190, "health_port": 9103}), SECRET, None)
    assert [c.server.metrics_port for c in configs] == [9190, 9191, 9192]
    assert [c.server.health_port for c in configs] == [9103, 0, 0]  # worker 0 answers the pod's probes
    assert {c.server.grpc_port for c in configs} == {9002} and {c.server.workers for c in configs} == {3}
    members = ("127.0.0.1:9104", "127.0.0.1:9105", "127.0.0.1:9106")
    for i, config in enumerate(configs):
        peers = config.peers
        assert peers.members == members and peers.advertise == members[i] and peers.port == 9104 + i
        assert peers.bind_address == "127.0.0.1" and peers.credential() == SECRET
        assert not peers.allow_unauthenticated


def test_any_metrics_port_stays_any() -> None:
    configs = worker_configs(pod(server={"metrics_port": 0}), SECRET, None)
    assert {c.server.metrics_port for c in configs} == {0}


def test_static_endpoints_become_one_file_the_workers_share(tmp_path: Path) -> None:
    config = pod(pool={"endpoints": "10.0.0.1:8000,10.0.0.2:8000"})
    with pytest.raises(ConfigError, match=r"pool\.endpoints"):
        worker_configs(config, SECRET, None)
    path = write_endpoints_file(tmp_path, config.pool.endpoints)
    assert set(parse_endpoints(path.read_text())) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    for worker in worker_configs(config, SECRET, path):
        assert worker.pool.endpoints == () and worker.pool.endpoints_file == path


@pytest.mark.parametrize(
    ("groups", "field"),
    [
        ({"peers": {"members": "10.0.0.1:9004", "allow_unauthenticated": True}}, "peers.members"),
        ({"peers": {"port": 0}}, r"peers\.port"),
        ({"kube": {"service": "vllm"}}, r"kube\.drains_configmap"),
        ({"peers": {"port": 65535}}, r"server\.workers"),
    ],
)
def test_a_pod_that_cannot_be_split_is_one_error_naming_the_field(groups: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        worker_configs(pod(**groups), SECRET, None)


def test_a_kube_source_with_the_drains_configmap_splits() -> None:
    config = pod(kube={"service": "vllm", "drains_configmap": "drains"})
    assert len(worker_configs(config, SECRET, None)) == 3


def test_workers_and_leader_election_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"leader\.enabled"):
        pod(leader={"enabled": True})


@pytest.fixture
def listening() -> Iterator[int]:
    """A port held by a listener of this test's, with SO_REUSEPORT set (as a worker's would be)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


def test_the_parent_refuses_a_grpc_port_even_another_pods_workers_share(listening: int) -> None:
    config = pod(server={"grpc_port": listening, "health_port": free_port(), "metrics_port": free_port()})
    assert ports_problem(config, worker_configs(config, SECRET, None)) == (
        f"server.grpc_port: port {listening} is in use"
    )


def test_a_workers_derived_port_in_use_names_the_worker() -> None:
    metrics = free_port(paired=2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", metrics + 2))
        sock.listen()
        config = pod(
            server={"grpc_port": free_port(), "health_port": free_port(), "metrics_port": metrics},
            peers={"port": free_port(paired=2)},
        )
        problem = ports_problem(config, worker_configs(config, SECRET, None))
    assert problem == f"server.metrics_port + 2 (worker 2): port {metrics + 2} is in use"


def test_derived_ports_may_not_land_on_the_pods_others() -> None:
    peer = free_port(paired=1)
    config = pod(
        server={"grpc_port": peer + 1, "health_port": free_port(), "metrics_port": 0}, peers={"port": peer}
    )
    problem = ports_problem(config, worker_configs(config, SECRET, None))
    assert problem == f"peers.port + 1 (worker 1): port {peer + 1} is another of the pod's ports"


class _Service(ep_grpc.ExternalProcessorServicer):
    grpc_message_limit = 1 << 20


def _log() -> als_pb2_grpc.AccessLogServiceServicer:
    return als_pb2_grpc.AccessLogServiceServicer()


async def test_the_ext_proc_port_is_shared_only_when_asked() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    servers: list[grpc.aio.Server] = []
    try:
        for _ in range(2):  # a pod's workers
            server, bound = ext_proc_server(_Service(), _log(), address, reuse_port=True)  # type: ignore[arg-type]
            servers.append(server)
            assert bound == port
        with pytest.raises(RuntimeError, match="bind"):  # one picker alone: refused, not given half
            ext_proc_server(_Service(), _log(), address)  # type: ignore[arg-type]
    finally:
        for server in servers:
            await server.stop(0)


def test_a_grpc_port_left_to_the_kernel_is_refused_the_workers_would_each_get_their_own() -> None:
    with pytest.raises(ConfigError, match=r"server\.grpc_port"):
        worker_configs(pod(server={"grpc_port": 0}), SECRET, None)


def test_a_second_group_of_workers_on_the_same_port_is_refused_while_the_first_holds_it() -> None:
    """Its workers bind the port only after their sources start: the parent's claim is at once."""
    config = pod(server={"grpc_port": free_port()})
    first = claim_port(config)
    assert isinstance(first, socket.socket)
    with first:
        taken = f"port {config.server.grpc_port} is being taken by another picker --workers group"
        assert claim_port(config) == f"server.grpc_port: {taken}"
    again = claim_port(config)  # released with its parent
    assert isinstance(again, socket.socket)
    again.close()


def test_static_endpoints_that_cannot_be_written_to_a_file_say_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only root filesystem: a clear reason and exit 2, not a traceback."""
    import tempfile

    from picker.cli.main import _run_workers

    def read_only(*args: object, **kwargs: object) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    config = pod(pool={"endpoints": ["10.0.0.1:8000"]})
    assert _run_workers(config) == 2
    assert "pool.endpoints: with server.workers > 1" in capsys.readouterr().err
