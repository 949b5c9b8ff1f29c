"""`python -m vllm_sim` as a process (uvloop): CLI, SIGTERM shutdown in both modes, several replicas.

The parity checks here are the same functions tests/realvllm runs against a real vLLM.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import parity_checks as pc
import pytest
from vllm_sim.cli import build_parser

from loadtest import http_client
from loadtest.sse_client import stream_request

FAST = ("--ttft-ms", "5", "--itl-ms", "10")
EXIT_WITHIN_S = 10.0


def test_help_documents_every_option() -> None:
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        for option in action.option_strings:
            assert option in text, option
        assert action.help, action.option_strings
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_sim", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert completed.returncode == 0 and "--shutdown-timeout" in completed.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tokens-per-chunk", "0"], "tokens_per_chunk"),
        (["--fault", "explode=1"], "explode"),
        (["--itl-ms", "x"], "itl-ms"),
    ],
)
def test_bad_options_exit_2_naming_the_field(args: list[str], named: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "vllm_sim", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert completed.returncode == 2 and named in completed.stderr, completed.stderr


async def wait_exit(proc: Any) -> int:
    assert await pc.wait_until(proc.exited, EXIT_WITHIN_S), f"still running: {proc.stderr_tail()}"
    return int(proc.proc.returncode)


async def test_parity_checks_pass_against_the_process(sim_process: Any) -> None:
    proc = sim_process("--port", "0", *FAST)
    target = pc.Target(proc.urls[0])
    await pc.check_health_and_models(target)
    await pc.check_sse_format(target)
    await pc.check_non_streaming(target)
    await pc.check_unknown_model_404(target)
    await pc.check_malformed_json_400(target)
    await pc.check_metric_names(target)
    # 2,000 tokens take 20 s here: freed within 10 s is missed only by an abort that never happens
    await pc.check_stream_disconnect_aborts(target, long_tokens=2000, deadline_s=10)
    await pc.check_non_streaming_disconnect_aborts(target, long_tokens=2000, deadline_s=10)


async def test_sigterm_drain(sim_process: Any) -> None:
    proc = sim_process("--port", "0", *FAST, "--shutdown-timeout", "30", "--post-drain-close-s", "0.2")
    await pc.check_drain_on_sigterm(pc.Target(proc.urls[0], sigterm=proc.sigterm), stream_tokens=150)
    assert await wait_exit(proc) == 0
    assert "sim stopped" in proc.stdout_rest()


@pytest.mark.parametrize("style", ["abort", "error"])
async def test_sigterm_abort_mode(sim_process: Any, style: str) -> None:
    proc = sim_process("--port", "0", *FAST, "--abort-style", style)
    endings = await pc.check_abort_on_sigterm(
        pc.Target(proc.urls[0], sigterm=proc.sigterm), stream_tokens=2000
    )
    assert endings == [style, style]
    assert await wait_exit(proc) == 0


async def test_sigterm_abort_mode_hang_lasts_until_clients_leave(sim_process: Any) -> None:
    proc = sim_process("--port", "0", *FAST, "--abort-style", "hang")
    target = pc.Target(proc.urls[0], sigterm=proc.sigterm)
    endings = await pc.check_abort_on_sigterm(target, stream_tokens=2000, hang_timeout_s=0.5)
    assert endings == ["hang", "hang"]  # the clients gave up; only then can the process end
    assert await wait_exit(proc) == 0


async def test_drain_timeout_leaves_streams_hanging_with_the_listener_closed(sim_process: Any) -> None:
    proc = sim_process("--port", "0", *FAST, "--shutdown-timeout", "0.3")
    url = proc.urls[0]
    async with http_client.AsyncClient(base_url=url) as http:
        body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        stream = asyncio.create_task(stream_request(http, "/v1/completions", body, read_timeout=1.0))
        assert await pc.wait_until(lambda: pc.running_is(http, pc.Target(url), 1), 5)
        proc.sigterm()
        assert await pc.wait_until(lambda: pc.port_refuses(url), 3)
        assert not proc.exited(), "exited while a stream still hangs"
        result = await stream
    assert result.end == "timeout" and not result.done and result.finish_reason is None
    assert await wait_exit(proc) == 0


async def test_one_replica_of_two_shuts_down_by_admin_call(sim_process: Any) -> None:
    proc = sim_process("--port", "0", "--port", "0", *FAST)
    first, second = proc.urls
    async with http_client.AsyncClient() as http:
        assert (await http.post(f"{first}/sim/shutdown", json={"timeout": 5})).status_code == 202
        assert await pc.wait_until(lambda: pc.port_refuses(first), 5)
        response = await http.post(f"{second}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 200 and response.headers["x-sim-replica"] == second.removeprefix(
            "http://"
        )
        assert not proc.exited()
        assert (await http.post(f"{second}/sim/shutdown", json={})).status_code == 202
    assert await wait_exit(proc) == 0


async def test_sigterm_stops_every_replica(sim_process: Any) -> None:
    proc = sim_process("--port", "0", "--port", "0", *FAST)
    proc.sigterm()
    assert await wait_exit(proc) == 0
    for url in proc.urls:
        assert await pc.port_refuses(url)


async def test_second_sigterm_exits_at_once(sim_process: Any) -> None:
    proc = sim_process("--port", "0", *FAST, "--shutdown-timeout", "60")
    url = proc.urls[0]
    async with http_client.AsyncClient(base_url=url) as http:
        body = {"prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        stream = asyncio.create_task(stream_request(http, "/v1/completions", body, read_timeout=5))
        assert await pc.wait_until(lambda: pc.running_is(http, pc.Target(url), 1), 5)
        proc.sigterm()
        assert await pc.wait_until(lambda: pc.running_is(http, pc.Target(url), 1), 1)  # draining
        proc.sigterm()
        assert await wait_exit(proc) == 1
        result = await stream
    assert result.end in {"error", "eof"} and not result.done
