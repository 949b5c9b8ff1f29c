"""`picker proxy` against model servers that misbehave in ways aiohttp itself reports (issue 21):
each answer is the contract's, every slot is released, and a cut by the picker is not the replica's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from loadtest import http_client
from picker.config.sources import load_config
from picker.contract import Outcome, reply_for
from picker.proxy.app import ProxyApp
from picker.streams import EndReason

PORTS = {"metrics_port": 0, "grpc_port": 0, "health_port": 0, "secure_serving": False}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}

Start = Callable[[list[str]], Awaitable[tuple[ProxyApp, str]]]


@pytest.fixture
async def proxy() -> AsyncIterator[Start]:
    apps: list[ProxyApp] = []

    async def start(endpoints: list[str]) -> tuple[ProxyApp, str]:
        config = load_config(
            overrides={
                "pool": {"endpoints": endpoints},
                "load": {"scrape": False},
                "server": PORTS,
                "proxy": {"port": 0},
            }
        )
        app = ProxyApp(config)
        apps.append(app)
        ports = await app.start()
        return app, f"http://127.0.0.1:{ports.proxy}"

    yield start
    for app in apps:
        await app.stop()


async def raw_server(answer: bytes) -> tuple[asyncio.Server, str]:
    """A "model server" that reads the request head and writes `answer` verbatim, then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def app_server(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", b"NOT HTTP AT ALL\r\n\r\n"],
    ids=["bad-header", "bad-status-line"],
)
async def test_an_unparseable_upstream_response_gets_the_contracts_answer(
    proxy: Start, answer: bytes
) -> None:
    server, address = await raw_server(answer)
    try:
        app, url = await proxy([address])
        async with http_client.AsyncClient(timeout=10) as client:
            response = await client.post(url + "/v1/completions", json=BODY)
        assert response.status_code == 503
        assert response.headers["x-picker-dropped-reason"] == Outcome.REJECTED_NO_ENDPOINTS.value
        assert response.json()["error"]["code"] == 503
        assert app.path.live == 0 and app.pool.in_flight() == 0
    finally:
        server.close()


async def test_an_unparseable_answer_moves_to_the_next_endpoint(proxy: Start) -> None:
    server, broken = await raw_server(b"NOT HTTP AT ALL\r\n\r\n")

    async def completion(_: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})

    good_app = web.Application()
    good_app.router.add_post("/v1/completions", completion)
    runner, good = await app_server(good_app)
    try:
        app, url = await proxy([broken, good])
        async with http_client.AsyncClient(timeout=10) as client:
            answers = [await client.post(url + "/v1/completions", json=BODY) for _ in range(6)]
        assert all(r.status_code == 200 for r in answers)
        assert app.path.live == 0
    finally:
        server.close()
        await runner.cleanup()


async def test_a_large_5xx_body_passes_through_whole(proxy: Start) -> None:
    text = b"x" * (200 * 1024)

    async def failing(_: web.Request) -> web.Response:
        return web.Response(status=500, body=text, content_type="text/plain")

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", failing)
    runner, address = await app_server(upstream)
    try:
        app, url = await proxy([address])
        async with http_client.AsyncClient(timeout=10) as client:
            response = await client.post(url + "/v1/completions", json=BODY)
        assert response.status_code == 500
        assert response.content == text
        assert app.path.live == 0
    finally:
        await runner.cleanup()


async def test_a_cut_at_the_drain_deadline_is_not_the_replicas_truncation(proxy: Start) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n')
        started.set()
        await release.wait()
        return response

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", stream)
    runner, address = await app_server(upstream)
    try:
        app, url = await proxy([address])
        async with http_client.AsyncClient(timeout=10) as client:
            async with client.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as r:
                chunks = r.aiter_bytes()
                await anext(chunks)
                await started.wait()
                assert app.frontend.cut_all(reply_for(Outcome.REJECTED_SHUTTING_DOWN)) == 1
                tail = b"".join([chunk async for chunk in chunks])
        assert b"rejected-shutting-down" in tail and tail.endswith(b"data: [DONE]\n\n")
        ends = app.metrics.registry.get_sample_value
        assert ends("picker_endpoint_truncations_total", {"endpoint": address}) in (None, 0.0)
        assert ends("picker_request_ends_total", {"reason": EndReason.SHUTDOWN_CUT.value}) == 1
        assert app.path.live == 0
    finally:
        release.set()
        await runner.cleanup()
