"""The tenants on the admin port: GET /admin/tenants (read as the other reads are), the status
document's `tenants`, and `picker tenants` over them."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from loadtest.browser import Browser, chromium_binary
from picker.admin.api import admin_app
from picker.cli import tenants as tenants_cli
from picker.flow import FlowController, FlowLimits
from picker.flow.budgets import TokenBudget
from picker.flow.tenant_view import table
from picker.flow.tenants import FairShare, Tenants
from picker.observability.metrics import Metrics
from picker.pool import Pool

READER = "reader-token-0123456789"


def _flow() -> FlowController[str]:
    budgets = {"acme": TokenBudget(60.0, 100.0)}
    flow: FlowController[str] = FlowController(
        lambda _: True,
        lambda: True,
        FlowLimits(ttl_s=60, fair_share=FairShare(budgets=budgets), budgets=budgets),
    )
    flow.share_by(Tenants(FairShare(budgets=budgets), lambda: (8, 8)))
    flow.submit("a", flow="acme", cost=80)
    flow.submit("b", flow="acme", cost=80)  # admitted while the bucket holds more than nothing
    flow.submit("c", flow="acme", cost=80)  # the bucket is below zero: refused
    flow.submit("d", flow="other-co", cost=30)
    return flow


async def _serve(view: Callable[[], dict[str, Any] | None] | None) -> TestClient:
    app = admin_app(
        Pool(),
        Metrics(pool="default"),
        metrics_token=READER,
        tenants=view,
        overview=lambda: {"tenants": view() if view else None},
    )

    @web.middleware
    async def from_afar(
        request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        return await handler(request.clone(remote="10.9.9.9"))

    app.middlewares.insert(0, from_afar)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


@pytest.fixture
async def served() -> AsyncIterator[TestClient]:
    flow = _flow()
    client = await _serve(lambda: table(flow.tenants, flow.budgets))
    yield client
    await client.close()


async def test_the_tenants_are_read_with_a_reader_s_token(served: TestClient) -> None:
    refused = await served.get("/admin/tenants")
    assert refused.status == 401  # the same rule as /metrics
    auth = {"Authorization": f"Bearer {READER}"}
    view = (await (await served.get("/admin/tenants", headers=auth)).json())["tenants"]
    rows = {row["tenant"]: row for row in view["rows"]}
    assert view["fair_share"] is True and set(rows) == {"acme", "other-co"}
    acme = rows["acme"]
    assert (acme["requests"], acme["in_flight"], acme["tokens"], acme["over_budget"]) == (3, 2, 160, 1)
    assert acme["budget"]["burst"] == 100.0 and acme["budget"]["level"] < 0
    assert rows["other-co"]["budget"] is None and rows["other-co"]["share"] == 0.5
    status = await (await served.get("/admin/status", headers=auth)).json()
    assert status["tenants"] == view


async def test_the_cli_prints_the_table_and_says_when_nothing_is_counted(
    served: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(served.make_url("/")).rstrip("/")
    assert await _run(argparse.Namespace(url=url, token=None, json=False)) == 1
    assert "401" in capsys.readouterr().err
    assert await _run(argparse.Namespace(url=url, token=READER, json=False)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "tenant", "weight", "share", "queued", "in_flight", "tokens", "token_share", "held_back",
        "budget_left", "over_budget",
    ]  # fmt: skip
    acme = next(line.split() for line in lines if line.startswith("acme"))
    assert acme[5] == "160" and acme[-2].endswith("/100") and acme[-1] == "1"
    empty = await _serve(None)
    try:
        url = str(empty.make_url("/")).rstrip("/")
        assert await _run(argparse.Namespace(url=url, token=READER, json=False)) == 0
        assert "nothing is counted by tenant" in capsys.readouterr().out
    finally:
        await empty.close()
    assert await _run(argparse.Namespace(url="http://127.0.0.1:1", token=None, json=False)) == 2


async def _run(args: argparse.Namespace) -> int:
    return await asyncio.to_thread(tenants_cli.main, args)


@pytest.mark.skipif(chromium_binary() is None, reason="no Chromium installed (make test installs it)")
async def test_the_status_page_draws_the_tenants_in_a_browser(tmp_path: Path) -> None:
    flow = _flow()
    app = admin_app(
        Pool(), Metrics(pool="default"), overview=lambda: {"tenants": table(flow.tenants, flow.budgets)}
    )
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    cells = "[...document.querySelectorAll('#tenants tr[data-tenant=\"acme\"] td')].map((c) => c.textContent)"
    try:
        async with Browser(tmp_path) as page:
            await page.goto(str(client.make_url("/status")))
            drawn = f"(() => {{ const r = {cells}; return r.length ? r : null; }})()"
            row = await page.wait_for(drawn, 20, "acme's row")
            assert row[0] == "acme" and row[5] == "160" and row[-1] == "1"
            assert row[8].startswith("-") and row[8].endswith("of 100 (60/min)")  # the bucket owes
            assert await page.evaluate("document.getElementById('tenants-note').hidden") is True
            assert await page.evaluate("document.querySelectorAll('#tenants tbody tr').length") == 2
    finally:
        await client.close()
