"""Who may read /metrics (issue 40): open by default; with admin.metrics_token, that bearer token;
with admin.metrics_auth (the reference chart's --metrics-endpoint-auth), any token the API server
vouches for in a TokenReview (against the fake API server), each reviewed once and cached."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from picker.admin.api import admin_app
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.sources.kube_api import load_kubeconfig
from picker.sources.token_review import TokenReviewer
from tests.kube.fake_apiserver import FakeApiServer

STATIC = "a-static-metrics-token-0123456789"


async def _get(client: TestClient, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return (await client.get("/metrics", headers=headers)).status


async def test_metrics_are_open_by_default_and_behind_the_static_token_when_set() -> None:
    for token, expected in ((None, {None: 200}), (STATIC, {None: 401, "wrong-token-000": 401, STATIC: 200})):
        client = TestClient(TestServer(admin_app(Pool(), Metrics(), metrics_token=token), host="127.0.0.1"))
        await client.start_server()
        try:
            for presented, status in expected.items():
                assert await _get(client, presented) == status, (token, presented)
            assert (await client.get("/admin/endpoints")).status == 200  # the admin view is not /metrics
        finally:
            await client.close()


async def test_a_token_the_api_server_vouches_for_reads_metrics(fake: FakeApiServer, tmp_path: Path) -> None:
    prometheus = fake.add_token("prometheus-service-account-token")
    reviewer = TokenReviewer(load_kubeconfig(fake.write_kubeconfig(tmp_path / "kc")))
    client = TestClient(
        TestServer(admin_app(Pool(), Metrics(), metrics_reviewer=reviewer.authenticated), host="127.0.0.1")
    )
    await client.start_server()
    try:
        assert await _get(client, None) == 401
        assert await _get(client, "a-token-nobody-issued") == 401
        for _ in range(3):
            assert await _get(client, prometheus) == 200
        assert fake.token_reviews == 2  # one per distinct token: the verdicts are cached
    finally:
        await client.close()
        await reviewer.aclose()


async def test_a_review_that_fails_refuses(fake: FakeApiServer, tmp_path: Path) -> None:
    reviewer = TokenReviewer(load_kubeconfig(fake.write_kubeconfig(tmp_path / "kc")), timeout_s=2.0)
    fake.fail_next(1, 500)
    try:
        assert not await reviewer.authenticated(fake.token)  # the API server failed: nobody in
        assert await reviewer.authenticated(fake.token)  # not cached: the next review decides
    finally:
        await reviewer.aclose()
