"""The `picker` command as an operator meets it: one line naming the field on a start-up failure,
`picker envoy-config`, and a `drain-wait` that imports nothing but the standard library."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.procs import Proc, free_port
from picker.cli.envoyconf import envoy_binary

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def occupied() -> Iterator[int]:
    """A port this test holds with a listening socket of its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


def _run_picker(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """`python -m picker ARGS` to its exit (stopped by PID if it outlives the test's patience)."""
    proc = Proc("picker", [sys.executable, "-m", "picker", *args], tmp_path / "picker.log", env=env, cwd=ROOT)
    try:
        code = proc.wait_exit(60)
    finally:
        proc.stop()
    assert code is not None, "picker kept running:\n" + proc.log_text()[-2000:]
    return code, proc.log_text()


def _serve_args(**ports: int) -> list[str]:
    args = ["serve", "--endpoints", "127.0.0.1:1", "--bind-address", "127.0.0.1", "--no-scrape"]
    for name in ("grpc_port", "health_port", "metrics_port"):
        args += [f"--{name.replace('_', '-')}", str(ports.get(name, free_port()))]
    return args


def _one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert "Traceback" not in output, output[-3000:]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.mark.parametrize("field", ["grpc_port", "health_port", "metrics_port"])
def test_a_port_in_use_is_one_line_naming_the_field(tmp_path: Path, occupied: int, field: str) -> None:
    code, output = _run_picker(tmp_path, _serve_args(**{field: occupied}))
    assert code != 0
    assert _one_line(output) == f"picker: server.{field}: port {occupied} is in use"


def test_two_servers_on_one_port_is_one_line_naming_the_field(tmp_path: Path) -> None:
    port = free_port()
    code, output = _run_picker(tmp_path, _serve_args(grpc_port=port, metrics_port=port))
    assert code != 0
    assert _one_line(output) == f"picker: server.metrics_port: port {port} is also server.grpc_port"


@pytest.mark.parametrize("address", ["999.1.1.1", "192.0.2.1", "not an address"])
def test_a_bad_bind_address_is_one_line_naming_the_field(tmp_path: Path, address: str) -> None:
    args = _serve_args()
    args[args.index("--bind-address") + 1] = address
    code, output = _run_picker(tmp_path, args)
    assert code != 0
    assert _one_line(output).startswith("picker: server.bind_address: ")


def test_an_unreadable_endpoints_file_is_one_line_naming_the_field(tmp_path: Path) -> None:
    args = _serve_args()
    args[args.index("--endpoints") : args.index("--endpoints") + 2] = ["--endpoints-file", str(tmp_path)]
    code, output = _run_picker(tmp_path, args)
    assert code != 0
    assert _one_line(output).startswith("picker: pool.endpoints_file: ")


def test_an_unreadable_config_file_is_one_line(tmp_path: Path) -> None:
    code, output = _run_picker(tmp_path, ["serve", "--config", str(tmp_path)])
    assert code != 0
    assert _one_line(output) == f"picker: config file {tmp_path}: Is a directory"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PICKER_LOGLEVEL", "DEBUG", "environment variable PICKER_LOGLEVEL: no such setting"),
        ("PICKER_FLOW__TTL_S", "x", "flow.ttl_s (from PICKER_FLOW__TTL_S)"),
    ],
)
def test_bad_environment_is_one_line(tmp_path: Path, variable: str, value: str, expected: str) -> None:
    code, output = _run_picker(tmp_path, _serve_args(), env={variable: value})
    assert code != 0
    assert expected in _one_line(output)


def test_env_endpoints_reach_the_serving_config(tmp_path: Path) -> None:
    code, output = _run_picker(
        tmp_path, ["config"], env={"PICKER_POOL__ENDPOINTS": "10.0.0.1:8000,10.0.0.2:8000"}
    )
    assert code == 0, output
    assert "- 10.0.0.1:8000\n  - 10.0.0.2:8000\n" in output


def test_drain_wait_imports_only_what_the_hook_needs() -> None:
    """A preStop hook's deadline includes its start-up: grpc, pydantic and aiohttp cost it seconds."""
    url = f"http://127.0.0.1:{free_port()}/metrics"
    script = (
        "import json, sys\n"
        "from picker.cli.main import main\n"
        "try:\n"
        f"    main(['drain-wait', '--metrics-url', '{url}', '--deadline', '0'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    imported = {name.split(".")[0] for name in json.loads(run.stdout)}
    assert "picker" in imported and '"outcome": "deadline"' in run.stderr  # the hook did run
    heavy = {"grpc", "pydantic", "pydantic_settings", "aiohttp", "httpx", "uvloop", "yaml", "lightkube"}
    assert imported & heavy == set()


@pytest.mark.envoy
@pytest.mark.parametrize(
    ("fail_open", "extra"),
    [("true", []), ("false", []), ("false", ["--lean"])],
    ids=["open", "closed", "lean"],
)
def test_envoy_config_renders_a_config_envoy_accepts(
    tmp_path: Path, fail_open: str, extra: list[str]
) -> None:
    code, output = _run_picker(
        tmp_path,
        [
            "envoy-config",
            "--endpoints",
            "127.0.0.1:8000,[::1]:8001",
            "--listen-port",
            "18080",
            "--admin-port",
            "19901",
            "--picker-address",
            "127.0.0.1",
            "--picker-port",
            "19002",
            "--failure-mode-allow",
            fail_open,
            *extra,
        ],
    )
    assert code == 0, output
    assert "port_value: 18080" in output and "port_value: 19002" in output
    assert f"failure_mode_allow: {fail_open}" in output
    # the lean shape drops the observer filter and flushes the access log every 10 ms
    assert ("envoy.filters.http.ext_proc.observer" in output) is not bool(extra)
    config = tmp_path / "envoy.yaml"
    config.write_text(output)
    run = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_envoy_config_refuses_a_bad_endpoint(tmp_path: Path) -> None:
    code, output = _run_picker(tmp_path, ["envoy-config", "--endpoints", "10.0.0.1"])
    assert code == 2
    assert _one_line(output) == "picker envoy-config: '10.0.0.1' is not host:port"


def test_picker_proxy_lists_and_takes_only_flags_that_mean_something_to_it() -> None:
    """Its gRPC side, Envoy's data-plane settings and leader election are picker serve's: not in
    `picker proxy --help`, and refused with one line when given."""
    run = [sys.executable, "-m", "picker", "proxy"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=30, check=True).stdout
    for flag in (
        "--grpc-port",
        "--secure-serving",
        "--response-end",
        "--fallbacks",
        "--ha-enable-leader-election",
    ):
        assert flag not in shown
    assert "--max-attempts" in shown and "--endpoints" in shown
    refused = subprocess.run(
        [*run, "--response-end", "observer", "--endpoints", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip() == "picker proxy: --response-end: picker serve's, not picker proxy's"
