"""The status page's document (GET /admin/status) and its files (GET /status, /status.js), without a
browser: what each lane says, and the headers that keep the page to itself. The page in a real
browser: tests/envoy/test_status_page.py."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from picker.admin.api import admin_app
from picker.observability.metrics import Metrics
from picker.pool import DrainEnd, EndpointState, Pool

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


async def _client(pool: Pool, **options: object) -> TestClient:
    metrics = Metrics(pool="default")
    metrics.register_pool(pool)
    client = TestClient(TestServer(admin_app(pool, metrics, **options), host="127.0.0.1"))  # type: ignore[arg-type]
    await client.start_server()
    return client


async def test_each_lane_says_its_state_streams_drain_and_how_its_requests_ended() -> None:
    pool = Pool()
    pool.reconcile({A: EndpointState.READY, B: EndpointState.READY}, source="kube")
    first, second, third = pool.lease(A), pool.lease(A), pool.lease(A)
    first.release(DrainEnd.CUT)
    pool.reconcile({A: EndpointState.DRAINING, B: EndpointState.READY}, source="kube")
    second.release(DrainEnd.UPSTREAM_ERROR)
    client = await _client(pool, overview=lambda: {"queue": {"queued": 2, "bytes": 10}, "live": 1})
    try:
        answer = await client.get("/admin/status")
        assert answer.status == 200
        state = await answer.json()
    finally:
        await client.close()
    lanes = {lane["address"]: lane for lane in state["lanes"]}
    assert [lane["address"] for lane in state["lanes"]] == [B, A]  # ready first
    a = lanes[A]
    assert (a["state"], a["in_flight"], a["cut"], a["failed"]) == ("draining", 1, 1, 1)
    assert a["drain"]["in_flight_at_start"] == 2 and a["drain"]["picks_after_start"] == 0
    assert lanes[B]["drain"] is None and lanes[B]["group"] is None  # no canary: no group
    assert state["queue"] == {"queued": 2, "bytes": 10} and state["rollout"] is None
    third.release(DrainEnd.COMPLETED)


async def test_the_page_and_its_script_are_served_to_be_run_by_nobody_else() -> None:
    pool = Pool()
    client = await _client(pool)
    try:
        page = await client.get("/status")
        script = await client.get("/status.js")
        html, js = await page.text(), await script.text()
        headers = page.headers
    finally:
        await client.close()
    assert page.status == 200 and page.content_type == "text/html"
    assert '<script src="/status.js">' in html and "/admin/status" in js
    assert script.content_type == "text/javascript"
    policy = headers["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy.split("style-src")[0]  # scripts: its own file only
    assert "innerHTML" not in js  # what the picker says is set as text, never as markup
