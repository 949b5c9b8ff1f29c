"""`picker proxy` gets what `picker serve` has from the shared core: the admin drain store, readiness
that follows the endpoint source, and the conformance test hooks (in process, small upstreams)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from picker.config.model import PickerConfig
from picker.config.sources import load_config
from picker.contract import headers
from picker.proxy.app import ProxyApp, ProxyPorts
from picker.sources import static_file
from tests.sources.test_source_readiness import wait_for

PORTS = {"metrics_port": 0, "grpc_port": 0, "health_port": 0, "secure_serving": False}


def proxy_config(endpoints_file: Path, **requests: Any) -> PickerConfig:
    return load_config(
        overrides={
            "pool": {"endpoints_file": str(endpoints_file)},
            "load": {"scrape": False},
            "server": PORTS,
            "proxy": {"port": 0},
            "requests": requests,
        }
    )


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Tiny model servers answering every completion with who they are."""
    runners: list[web.AppRunner] = []

    async def start() -> str:
        address: list[str] = []

        async def completion(_: web.Request) -> web.Response:
            body = {"id": "x", "object": "text_completion", "choices": [{"text": address[0]}]}
            return web.json_response(body)

        app = web.Application()
        app.router.add_post("/v1/completions", completion)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        address.append(f"127.0.0.1:{runner.addresses[0][1]}")
        return address[0]

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def running() -> AsyncIterator[Callable[[PickerConfig], Awaitable[tuple[ProxyApp, ProxyPorts]]]]:
    apps: list[ProxyApp] = []

    async def start(config: PickerConfig) -> tuple[ProxyApp, ProxyPorts]:
        app = ProxyApp(config)
        apps.append(app)
        return app, await app.start()

    yield start
    for app in apps:
        await app.stop()


async def ready_status(session: aiohttp.ClientSession, ports: ProxyPorts) -> int:
    async with session.get(f"http://127.0.0.1:{ports.metrics}/ready") as response:
        return response.status


async def test_drain_through_the_proxy_admin_api_rewrites_the_endpoints_file(
    tmp_path: Path, running: Callable[[PickerConfig], Awaitable[tuple[ProxyApp, ProxyPorts]]]
) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("- 127.0.0.1:9\n- 127.0.0.1:10\n")
    app, ports = await running(proxy_config(endpoints))
    async with aiohttp.ClientSession() as session:
        assert await ready_status(session, ports) == 200
        url = f"http://127.0.0.1:{ports.metrics}/admin/endpoints/127.0.0.1:10/drain"
        async with session.post(url) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["endpoint"]["state"] == "draining"
    # recorded in the shared file, so every picker replica reading it applies the drain
    assert yaml.safe_load(endpoints.read_text()) == [
        "127.0.0.1:9",
        {"address": "127.0.0.1:10", "draining": True},
    ]
    assert [e.address for e in app.pool.ready()] == ["127.0.0.1:9"]


async def test_an_endpoint_source_that_dies_makes_ready_503(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    running: Callable[[PickerConfig], Awaitable[tuple[ProxyApp, ProxyPorts]]],
) -> None:
    stop_watch = asyncio.Event()

    async def dies_on_cue(self: static_file.EndpointsFile) -> None:
        await stop_watch.wait()
        raise RuntimeError("the watch broke")

    monkeypatch.setattr(static_file.EndpointsFile, "run", dies_on_cue)
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("- 127.0.0.1:9\n")
    _, ports = await running(proxy_config(endpoints))
    async with aiohttp.ClientSession() as session:
        assert await ready_status(session, ports) == 200
        stop_watch.set()

        async def not_ready() -> bool:
            return await ready_status(session, ports) == 503

        await wait_for(not_ready, "/ready 503")


@pytest.mark.parametrize("hooks", [True, False])
async def test_test_hooks_restrict_the_pick_and_echo_who_served(
    tmp_path: Path,
    hooks: bool,
    upstreams: Callable[[], Awaitable[str]],
    running: Callable[[PickerConfig], Awaitable[tuple[ProxyApp, ProxyPorts]]],
) -> None:
    first, second = await upstreams(), await upstreams()
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(f"- {first}\n- {second}\n")
    _, ports = await running(proxy_config(endpoints, enable_test_hooks=hooks))
    served: list[str] = []
    echoed: list[str | None] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            async with session.post(
                f"http://127.0.0.1:{ports.proxy}/v1/completions",
                data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}),
                headers={"content-type": "application/json", headers.TEST_ENDPOINT_SELECTION: second},
            ) as response:
                assert response.status == 200, await response.text()
                served.append((await response.json())["choices"][0]["text"])
                echoed.append(response.headers.get(headers.TEST_SERVED_ENDPOINT))
    if hooks:
        assert served == [second] * 20 and echoed == [second] * 20
    else:  # the header means nothing without the hooks: both endpoints get work
        assert set(served) == {first, second} and echoed == [None] * 20
