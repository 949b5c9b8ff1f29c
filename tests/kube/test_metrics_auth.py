"""Who may read /metrics (issues 40 and 53): open by default; with admin.metrics_token, that bearer
token; with admin.metrics_auth (the reference chart's --metrics-endpoint-auth), a token the API
server authenticates (TokenReview) and allows to get /metrics (SubjectAccessReview), against the
fake API server: authenticated alone is 403. A refused token is not reviewed again for a while (a
bounded negative cache), requests with one token share one review, a failed review refuses (503)
and is not cached. With admin.read_auth `metrics` the admin API's reads follow the same rule."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from loadtest.procs import async_wait_until
from picker.admin.api import admin_app
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.sources.access import Access
from picker.sources.kube_api import load_kubeconfig
from picker.sources.token_review import TokenReviewer
from tests.kube.fake_apiserver import FakeApiServer

STATIC = "a-static-metrics-token-0123456789"
ADMIN = "the-admin-token-0123456789"
READS = (
    "/admin/status",
    "/admin/endpoints",
    "/admin/endpoints/10.0.0.1:8000",
    "/admin/drains",
    "/admin/rollout",
)


async def _get(client: TestClient, token: str | None, path: str = "/metrics", **headers: str) -> int:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return (await client.get(path, headers=headers)).status


@pytest.fixture
async def reviewer(fake: FakeApiServer, tmp_path: Path) -> AsyncIterator[TokenReviewer]:
    made = TokenReviewer(load_kubeconfig(fake.write_kubeconfig(tmp_path / "kc")), timeout_s=5.0)
    yield made
    await made.aclose()


Serve = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """An admin app on 127.0.0.1; `peer`: what it sees as the caller's address."""
    clients: list[TestClient] = []

    async def make(peer: str | None = "10.9.9.9", **options: object) -> TestClient:
        pool = Pool()
        pool.reconcile({"10.0.0.1:8000": EndpointState.READY}, source="kube")
        app = admin_app(pool, Metrics(pool="default"), **options)  # type: ignore[arg-type]
        if peer is not None:

            @web.middleware
            async def from_peer(
                request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
            ) -> web.StreamResponse:
                return await handler(request.clone(remote=peer))

            app.middlewares.insert(0, from_peer)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def test_metrics_are_open_by_default_and_behind_the_static_token_when_set(serve: Serve) -> None:
    for token, expected in ((None, {None: 200}), (STATIC, {None: 401, "wrong-token-000": 401, STATIC: 200})):
        client = await serve(peer=None, metrics_token=token)
        for presented, status in expected.items():
            assert await _get(client, presented) == status, (token, presented)
        assert (
            await _get(client, None, "/admin/endpoints") == 200
        )  # from loopback, no admin token: an operator


async def test_authenticated_is_not_enough_rbac_must_allow_get_on_metrics(
    fake: FakeApiServer, reviewer: TokenReviewer, serve: Serve
) -> None:
    """Issue 53, item 6: any service account in the cluster read /metrics (TokenReview only)."""
    prometheus = fake.add_token("prometheus-service-account-token")
    other = fake.add_token("some-other-workloads-token")
    fake.grant(fake.user_of(prometheus))
    client = await serve(metrics_reviewer=reviewer.review)
    assert await _get(client, None) == 401
    assert await _get(client, "a-token-nobody-issued") == 401
    forbidden = await client.get("/metrics", headers={"Authorization": f"Bearer {other}"})
    assert forbidden.status == 403 and "RBAC" in (await forbidden.json())["error"]["message"]
    for _ in range(3):
        assert await _get(client, prometheus) == 200
        assert await _get(client, other) == 403
    assert (fake.token_reviews, fake.access_reviews) == (3, 2)  # each token once; cached, both ways
    assert {asked["user"] for asked in fake.access_specs} == {fake.user_of(prometheus), fake.user_of(other)}
    for asked in fake.access_specs:  # the user the TokenReview named, its groups, get on /metrics
        assert "system:serviceaccounts" in asked["groups"]
        assert asked["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}
    assert reviewer.reviews == {
        ("tokenreview", "authenticated"): 2,
        ("tokenreview", "unauthenticated"): 1,
        ("subjectaccessreview", "allowed"): 1,
        ("subjectaccessreview", "denied"): 1,
    }


async def test_a_group_grant_and_an_explicit_denial(fake: FakeApiServer, reviewer: TokenReviewer) -> None:
    grouped, denied = fake.add_token("grouped-token-0001"), fake.add_token("denied-token-0001")
    fake.grant("system:serviceaccounts", "/metric*", "*")  # a prefix and any verb, as RBAC reads them
    fake.deny(fake.user_of(denied))
    assert await reviewer.review(grouped) is Access.ALLOWED
    assert await reviewer.review(denied) is Access.FORBIDDEN


async def test_a_random_token_is_reviewed_once_for_a_while_in_a_bounded_cache(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    now = [0.0]
    reviewer = TokenReviewer(
        load_kubeconfig(fake.write_kubeconfig(tmp_path / "kc")),
        deny_cache_s=30.0,
        denied_cached=2,
        clock=lambda: now[0],
    )
    prometheus = fake.add_token("prometheus-service-account-token")
    fake.grant(fake.user_of(prometheus))
    try:
        for _ in range(5):
            assert await reviewer.review("random-token-a") is Access.UNAUTHENTICATED
        assert fake.token_reviews == 1
        now[0] = 29.0
        assert await reviewer.review("random-token-a") is Access.UNAUTHENTICATED
        assert fake.token_reviews == 1
        now[0] = 31.0  # the refusal expired: asked again
        assert await reviewer.review("random-token-a") is Access.UNAUTHENTICATED
        assert fake.token_reviews == 2
        assert await reviewer.review(prometheus) is Access.ALLOWED  # 3 reviews
        for flood in ("random-token-b", "random-token-c"):  # two more refusals evict the first
            assert await reviewer.review(flood) is Access.UNAUTHENTICATED
        assert await reviewer.review("random-token-a") is Access.UNAUTHENTICATED
        assert fake.token_reviews == 6
        assert await reviewer.review(prometheus) is Access.ALLOWED  # the flood evicted no allowed one
        assert fake.token_reviews == 6
    finally:
        await reviewer.aclose()


async def test_concurrent_requests_with_one_token_share_one_review(
    fake: FakeApiServer, reviewer: TokenReviewer, serve: Serve
) -> None:
    prometheus = fake.add_token("prometheus-service-account-token")
    fake.grant(fake.user_of(prometheus))
    release = fake.hold_reviews()
    waiting = [asyncio.create_task(reviewer.review(prometheus)) for _ in range(20)]
    await async_wait_until(lambda: fake.token_reviews == 1 and reviewer.joined == 19, 5.0)
    release.set()
    assert set(await asyncio.gather(*waiting)) == {Access.ALLOWED}
    assert (fake.token_reviews, fake.access_reviews) == (1, 1)
    # and through HTTP: twenty scrapes at once with a token never seen
    other = fake.add_token("second-prometheus-token")
    fake.grant(fake.user_of(other))
    release = fake.hold_reviews()
    client = await serve(metrics_reviewer=reviewer.review)
    scrapes = [asyncio.create_task(_get(client, other)) for _ in range(20)]
    await async_wait_until(lambda: fake.token_reviews == 2 and reviewer.joined == 38, 5.0)
    release.set()
    assert await asyncio.gather(*scrapes) == [200] * 20
    assert (fake.token_reviews, fake.access_reviews) == (2, 2)


async def test_a_review_that_fails_refuses_and_is_not_cached(
    fake: FakeApiServer, reviewer: TokenReviewer, serve: Serve
) -> None:
    prometheus = fake.add_token("prometheus-service-account-token")
    fake.grant(fake.user_of(prometheus))
    client = await serve(metrics_reviewer=reviewer.review)
    fake.fail_next(1, 500, resource="tokenreviews")
    answer = await client.get("/metrics", headers={"Authorization": f"Bearer {prometheus}"})
    assert answer.status == 503 and answer.headers["Retry-After"] == "1"
    fake.fail_next(1, 500, resource="subjectaccessreviews")
    assert await _get(client, prometheus) == 503  # authenticated, but the access review failed
    assert await _get(client, prometheus) == 200  # not cached: the next review decides
    assert reviewer.reviews[("tokenreview", "failed")] == 1
    assert reviewer.reviews[("subjectaccessreview", "failed")] == 1


async def test_the_admin_reads_follow_admin_read_auth(
    fake: FakeApiServer, reviewer: TokenReviewer, serve: Serve
) -> None:
    prometheus, other = fake.add_token("prometheus-service-account-token"), fake.add_token("other-token-01")
    fake.grant(fake.user_of(prometheus))
    guarded = await serve(metrics_reviewer=reviewer.review, token=ADMIN)  # read_auth: metrics, the default
    opened = await serve(metrics_reviewer=reviewer.review, token=ADMIN, read_auth="open")
    for path in READS:
        assert await _get(guarded, None, path) == 401, path
        assert await _get(guarded, other, path) == 403, path
        assert await _get(guarded, prometheus, path) == 200, path
        assert await _get(guarded, ADMIN, path) == 200, path  # who may change state may read
        assert await _get(opened, None, path) == 200, path
    assert await _get(opened, None) == 401  # /metrics itself stays guarded
    assert await _get(guarded, None, "/status") == 200  # the page itself; its data is /admin/status


async def test_a_loopback_read_needs_a_host_dns_cannot_rebind(
    fake: FakeApiServer, reviewer: TokenReviewer, serve: Serve
) -> None:
    """Without an admin token a loopback caller may read (a port-forward: the operator), but not a
    page whose DNS name now resolves to 127.0.0.1 (same-origin for the browser)."""
    local = await serve(peer="127.0.0.1", metrics_reviewer=reviewer.review)
    assert await _get(local, None, "/admin/status", Host="127.0.0.1:9090") == 200
    assert await _get(local, None, "/admin/status", Host="localhost:9090") == 200
    assert await _get(local, None, "/admin/status", Host="evil.example:9090") == 401
    assert await _get(local, None, "/metrics", Host="127.0.0.1:9090") == 401  # /metrics: a token, always
    with_token = await serve(peer="127.0.0.1", metrics_reviewer=reviewer.review, token=ADMIN)
    assert await _get(with_token, None, "/admin/status", Host="127.0.0.1:9090") == 401  # a sidecar's loopback


async def test_the_fake_validates_an_access_review_as_the_api_server(fake: FakeApiServer) -> None:
    import httpx

    async with httpx.AsyncClient(
        base_url=fake.url, headers={"Authorization": f"Bearer {fake.token}"}
    ) as client:
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {}}
        answer = await client.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", json=body)
        assert answer.status_code == 422 and answer.json()["reason"] == "Invalid"
        body["spec"] = {"user": "alice", "nonResourceAttributes": {"path": "/metrics", "verb": "get"}}
        answer = await client.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", json=body)
        assert answer.status_code == 201 and answer.json()["status"] == {"allowed": False}
        anonymous = await client.post(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews", json=body, headers={"Authorization": ""}
        )
        assert anonymous.status_code == 401


async def test_a_picker_with_metrics_auth_reviews_its_readers(fake: FakeApiServer, kubeconfig: Path) -> None:
    """The wiring: admin.metrics_auth (as --metrics-endpoint-auth sets it) and admin.read_auth."""
    from loadtest import http_client
    from picker.app import PickerApp
    from picker.config.sources import load_config

    fake.put_pod("vllm-0", "10.0.0.1")
    fake.put_pool("vllm")
    prometheus, other = fake.add_token("prometheus-service-account-token"), fake.add_token("other-token-01")
    fake.grant(fake.user_of(prometheus))
    config = load_config(
        overrides={
            "server": {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "secure_serving": False},
            "kube": {"pool_name": "vllm", "kubeconfig": str(kubeconfig), "backoff_initial_s": 0.02},
            "load": {"scrape": False},
            "admin": {"metrics_auth": True, "token": ADMIN},
        }
    )
    app = PickerApp(config)
    port = (await app.start()).metrics
    try:
        async with http_client.AsyncClient() as client:

            async def status(path: str, token: str | None) -> int:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                return (
                    await client.get(f"http://127.0.0.1:{port}{path}", headers=headers, timeout=5)
                ).status_code

            for path in ("/metrics", "/admin/status"):
                assert [await status(path, t) for t in (None, other, prometheus)] == [401, 403, 200], path
            assert await status("/admin/endpoints", ADMIN) == 200 and await status("/metrics", ADMIN) == 401
            page = (
                await client.get(
                    f"http://127.0.0.1:{port}/metrics",
                    headers={"Authorization": f"Bearer {prometheus}"},
                    timeout=5,
                )
            ).text
        assert 'picker_metrics_auth_reviews_total{result="allowed",review="subjectaccessreview"} 1.0' in page
        assert "# TYPE picker_drain_record_rejected_total counter" in page
    finally:
        await app.stop()
