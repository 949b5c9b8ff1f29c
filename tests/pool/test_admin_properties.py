"""The admin API under arbitrary paths, query strings, bodies and credentials (issue 40, item 3 of what
to build): every answer is a clear one (never a 5xx, an error as JSON), and a request that is not
allowed changes nothing. Hypothesis, bounded in examples; one in-process server per example."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picker.admin.api import CapacityGuard, admin_app
from picker.config.model import PickerConfig, RolloutConfig
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.rollout import Canary, CanaryPlan
from picker.rollout.runner import RolloutRunner
from picker.sources.drain_store import LocalDrains

WINDOW_S = PickerConfig().autoscaling.rate_window_s  # the shipped default

TOKEN = "s3cret-admin-token-0123"
READY = ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000"]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEMPLATES = [
    "/admin/endpoints/{}",
    "/admin/endpoints/{}/drain",
    "/admin/endpoints/{}/undrain",
    "/admin/rollout/{}",
    "/admin/{}",
    "/{}",
]
ADDRESSES = st.sampled_from([*READY, "10.0.0.9:8000", "[fd00::1", "a:b:c", "", "..", "%00"]) | st.text(
    max_size=20
)
QUERY_KEYS = st.sampled_from(["force", "wait", "x", ""]) | st.text(max_size=6)
QUERY_VALUES = st.sampled_from(["true", "1", "nan", "inf", "-1", "1e999", "0.01", ""]) | st.text(max_size=8)


def state(pool: Pool) -> dict[str, tuple[str, bool]]:
    return {e.address: (e.state.value, pool.admin_drained(e.address)) for e in pool.endpoints()}


async def ask(
    method: str, path: str, query: list[tuple[str, str]], body: bytes, auth: str | None, remote: str
) -> tuple[int, str, str, bool]:
    """One request to a fresh admin app; (status, content type, body, state changed)."""
    pool = Pool()
    pool.reconcile(dict.fromkeys(READY, EndpointState.READY), "file", labels={READY[2]: {"v": "v2"}})
    metrics = Metrics(pool="default")
    metrics.register_pool(pool)
    drains = LocalDrains(pool)
    runner = RolloutRunner(
        Canary(CanaryPlan.of(RolloutConfig(candidate="v2", group_label="v")), 0.0), pool, 1.0
    )
    runner.store = drains
    guard = CapacityGuard(
        pool, lambda: 0, engine_slots=4, headroom=0.1, wait_max_s=0.05, rate_window_s=WINDOW_S
    )
    app = admin_app(pool, metrics, token=TOKEN, drains=drains, guard=guard, rollout=runner)

    @web.middleware
    async def from_peer(request: web.Request, handler):  # type: ignore[no-untyped-def]
        return await handler(request.clone(remote=remote))

    app.middlewares.insert(0, from_peer)
    before = state(pool)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        headers = {"Authorization": auth} if auth is not None else {}
        response = await client.request(method, path, params=query, data=body, headers=headers)
        text = await response.text()
        return response.status, response.content_type, text, state(pool) != before
    finally:
        await client.close()


@SETTINGS
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    template=st.sampled_from(TEMPLATES),
    part=ADDRESSES,
    query=st.lists(st.tuples(QUERY_KEYS, QUERY_VALUES), max_size=3),
    body=st.binary(max_size=64),
    auth=st.none() | st.sampled_from([f"Bearer {TOKEN}", "Bearer wrong", "Basic x", "", "Bearer "]),
    remote=st.sampled_from(["127.0.0.1", "10.9.9.9", "127.0.0.6"]),
)
def test_any_admin_request_gets_a_clear_answer_and_a_refused_one_changes_nothing(
    method: str,
    template: str,
    part: str,
    query: list[tuple[str, str]],
    body: bytes,
    auth: str | None,
    remote: str,
) -> None:
    path = template.format(quote(part, safe=":[]"))
    status, content_type, text, changed = asyncio.run(ask(method, path, query, body, auth, remote))
    assert status < 500, (status, path, query, text)
    if status >= 400 and path.startswith("/admin/") and status != 405:
        assert content_type == "application/json", (status, path, text)
    if auth != f"Bearer {TOKEN}":  # a token is set: nobody without it changes anything, loopback too
        assert not changed, (method, path, query, status)
    if changed:
        assert method == "POST" and status == 200
