# ruff: noqa: E501  (one header set a row)
"""A web page cannot change a picker's state (issue 53, item 1): picker/admin/browser.py.

A page open in the operator's browser while `kubectl port-forward` exposes the admin port on
localhost can send a simple cross-site POST (no preflight). Through each state-changing endpoint,
with and without an admin token, such a request changes nothing; the status page's own request
(same origin, `X-Picker-Admin`) and a client without a browser's marks still do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from picker.admin.api import admin_app
from picker.admin.browser import refusal
from picker.config.model import RolloutConfig
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.rollout import Canary, CanaryPlan
from picker.rollout.runner import RolloutRunner
from picker.sources.drain_store import LocalDrains

TOKEN = "s3cret-admin-token-0123"
ADDRESS = "10.0.0.1:8000"
CANDIDATE = "10.0.0.3:8000"
LABEL = "app.kubernetes.io/version"
EVIL = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
# what fetch(..., {mode: "no-cors"}) sends from a page whose name was rebound to 127.0.0.1
REBOUND = {"Origin": "http://evil.example:{port}", "Host": "evil.example:{port}", "Sec-Fetch-Site": "same-origin",
           "X-Picker-Admin": "1"}  # fmt: skip


@pytest.mark.parametrize(
    ("headers", "token_set", "why"),
    [
        ({}, False, None),  # curl, drain-wait, picker rollout: the token rules decide
        ({"Host": "localhost:9090", "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, False, "cross-site"),
        ({"Host": "localhost:9090", "Origin": "http://evil.example"}, True, "cross-origin"),
        ({"Host": "localhost:9090", "Origin": "null"}, False, "cross-origin"),
        ({"Host": "localhost:9090", "Sec-Fetch-Site": "same-site"}, False, "cross-site"),
        ({"Host": "localhost:9090", "Origin": "http://localhost:9090", "Sec-Fetch-Site": "same-origin"}, False, "no-admin-header"),
        ({"Host": "localhost:9090", "Origin": "http://localhost:9090", "X-Picker-Admin": "1"}, False, None),
        ({"Host": "127.0.0.1:9090", "Origin": "http://127.0.0.1:9090", "X-Picker-Admin": "1"}, False, None),
        ({"Host": "[::1]:9090", "Origin": "http://[::1]:9090", "X-Picker-Admin": "1"}, False, None),
        ({"Host": "evil.example:9090", "Origin": "http://evil.example:9090", "X-Picker-Admin": "1"}, False, "host-not-literal"),
        ({"Host": "picker.example:9090", "Origin": "http://picker.example:9090", "X-Picker-Admin": "1"}, True, None),
    ],
)  # fmt: skip
def test_browser_marks_decide(headers: dict[str, str], token_set: bool, why: str | None) -> None:
    from multidict import CIMultiDict

    assert refusal(CIMultiDict(headers), token_set) == why


@pytest.fixture
async def client_for(request: pytest.FixtureRequest) -> AsyncIterator[tuple[TestClient, Pool, str | None]]:
    token = request.param
    pool = Pool()
    addresses = {a: EndpointState.READY for a in (ADDRESS, "10.0.0.2:8000", CANDIDATE)}
    pool.reconcile(
        addresses, "file", labels={a: {LABEL: "v2" if a == CANDIDATE else "v1"} for a in addresses}
    )
    runner = RolloutRunner(Canary(CanaryPlan.of(RolloutConfig(candidate="v2")), pool.now()), pool, 1.0)
    runner.store = LocalDrains(pool)
    app = admin_app(pool, Metrics(pool="default"), token=token, drains=runner.store, rollout=runner)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        yield client, pool, token
    finally:
        await client.close()


CHANGES = [
    f"/admin/endpoints/{ADDRESS}/drain",
    f"/admin/endpoints/{ADDRESS}/drain?move_streams=false",
    f"/admin/endpoints/{ADDRESS}/undrain",
    "/admin/rollout/abort",
    "/admin/rollout/pause",
    "/admin/rollout/promote",
    "/admin/rollout/resume",
]


@pytest.mark.parametrize("client_for", [None, TOKEN], indirect=True, ids=["no-token", "token"])
@pytest.mark.parametrize("path", CHANGES)
async def test_a_cross_site_post_changes_nothing(
    client_for: tuple[TestClient, Pool, str | None], path: str
) -> None:
    client, pool, _ = client_for

    async def state() -> tuple[object, ...]:
        rollout = (await (await client.get("/admin/rollout")).json())["rollout"]
        return pool.get(ADDRESS).state, rollout["phase"], rollout["weight"]  # type: ignore[union-attr]

    before = await state()
    auth = {"Authorization": f"Bearer {TOKEN}"}  # a page cannot send it without a preflight; even so
    for headers in (EVIL, {**EVIL, **auth}):
        answer = await client.post(path, headers=headers)
        assert answer.status == 403, await answer.text()
        assert "web page" in (await answer.json())["error"]["message"]
    assert await state() == before


@pytest.mark.parametrize("client_for", [None], indirect=True)
async def test_a_dns_rebound_page_is_refused_without_a_token(
    client_for: tuple[TestClient, Pool, str | None],
) -> None:
    client, pool, _ = client_for
    port = client.port
    headers = {k: v.format(port=port) for k, v in REBOUND.items()}
    answer = await client.post(f"/admin/endpoints/{ADDRESS}/drain", headers=headers)
    assert answer.status == 403 and pool.get(ADDRESS).state is EndpointState.READY  # type: ignore[union-attr]


async def test_a_dns_rebound_page_is_refused_with_a_token_and_trusted_loopback() -> None:
    """With admin.trust_loopback, loopback stands in for the token only from a Host nothing can
    rebind, as for the reads (picker/admin/read_auth.py): the page's drain changes nothing, its read
    is refused too, and the status page's own request from 127.0.0.1 still drains."""
    pool = Pool()
    pool.reconcile({a: EndpointState.READY for a in (ADDRESS, "10.0.0.2:8000")}, "file")
    app = admin_app(pool, Metrics(pool="default"), token=TOKEN, trust_loopback=True, metrics_token="m" * 16)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        rebound = {k: v.format(port=client.port) for k, v in REBOUND.items()}
        for path in (f"/admin/endpoints/{ADDRESS}/drain", "/admin/rollout/abort"):
            answer = await client.post(path, headers=rebound)
            assert answer.status == 401, await answer.text()
        assert (await client.get("/admin/endpoints", headers={"Host": rebound["Host"]})).status == 401
        assert pool.get(ADDRESS).state is EndpointState.READY  # type: ignore[union-attr]
        page = {
            "Origin": f"http://127.0.0.1:{client.port}",
            "Sec-Fetch-Site": "same-origin",
            "X-Picker-Admin": "1",
        }
        answer = await client.post(f"/admin/endpoints/{ADDRESS}/drain", headers=page)
        assert answer.status == 200 and pool.get(ADDRESS).state is EndpointState.DRAINING  # type: ignore[union-attr]
    finally:
        await client.close()


@pytest.mark.parametrize("client_for", [None], indirect=True)
async def test_writes_and_reads_agree_on_a_rebindable_host_without_browser_marks(
    client_for: tuple[TestClient, Pool, str | None],
) -> None:
    """No token set, no browser marks, a Host that names a DNS name: a read would be refused
    (read_auth.py), so a write is too."""
    client, pool, _ = client_for
    answer = await client.post(f"/admin/endpoints/{ADDRESS}/drain", headers={"Host": "evil.example"})
    assert answer.status == 403 and pool.get(ADDRESS).state is EndpointState.READY  # type: ignore[union-attr]


@pytest.mark.parametrize("client_for", [None, TOKEN], indirect=True, ids=["no-token", "token"])
async def test_the_status_page_s_own_request_and_a_plain_client_still_drain(
    client_for: tuple[TestClient, Pool, str | None],
) -> None:
    client, pool, token = client_for
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    page = {
        "Origin": f"http://127.0.0.1:{client.port}",
        "Sec-Fetch-Site": "same-origin",
        "X-Picker-Admin": "status-page",
    }
    answer = await client.post(f"/admin/endpoints/{ADDRESS}/drain", headers={**page, **auth})
    assert answer.status == 200, await answer.text()
    assert pool.get(ADDRESS).state is EndpointState.DRAINING  # type: ignore[union-attr]
    answer = await client.post(f"/admin/endpoints/{ADDRESS}/undrain", headers=auth)  # curl: no marks
    assert answer.status == 200 and pool.get(ADDRESS).state is EndpointState.READY  # type: ignore[union-attr]


def test_no_get_route_changes_state() -> None:
    app = admin_app(Pool(), Metrics(pool="default"))
    gets = {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource is not None}
    assert all(not path.endswith(("/drain", "/undrain")) and "{verb}" not in path for path in gets)
