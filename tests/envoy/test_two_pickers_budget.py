"""A tenant's token budget through the real Envoy and two pickers sharing the books: the tenant's
requests are spread over both pickers, and together they admit at most its budget plus one
request's reservation per picker (picker/flow/budgets.py, the bound); the rest are refused with 429,
the reason header and Retry-After; another tenant is not held back. Each picker's view of the
tenants (GET /admin/tenants) says which of them admitted and refused what."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import http_client
from loadtest.stack import Stack, StackOptions
from picker.contract import headers

pytestmark = pytest.mark.envoy

MAX_TOKENS = 100
COST = 1 + MAX_TOKENS  # a prompt of one token (estimated at 4 characters a token) and max_tokens
ADMITS = 4  # the budget's burst admits this many requests from one picker alone
# the burst, less half a request: the fourth takes the bucket below zero, the fifth finds it there;
# refilled so slowly that a test's seconds add no request
BUDGET = {"tokens_per_minute": 0.6, "burst": ADMITS * COST - COST // 2}
SENT = 16


def _tenants(metrics_port: int) -> dict[str, dict[str, Any]]:
    view = http_client.get(f"http://127.0.0.1:{metrics_port}/admin/tenants", timeout=5).json()["tenants"]
    return {row["tenant"]: row for row in view["rows"]}


async def _send(client: http_client.AsyncClient, url: str, tenant: str) -> tuple[int, dict[str, str]]:
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    answer = await client.post(f"{url}/v1/completions", json=body, headers={headers.FAIRNESS_ID: tenant})
    return answer.status_code, dict(answer.headers)


def _acme_requests(stack: Stack) -> list[int]:
    return [_tenants(port).get("acme", {}).get("requests") or 0 for _, _, port in stack.picker_ports]


async def _turn(client: http_client.AsyncClient, url: str) -> None:
    """Moves Envoy's turn between the pickers by one: a request the picker refuses as it reads it
    (not JSON) opens one stream to a picker, where a served one opens two (routing and observer)."""
    answer = await client.post(
        f"{url}/v1/completions", content=b"not json", headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400


async def test_a_tenant_spread_over_two_pickers_gets_its_budget_and_one_reservation_per_picker(
    tmp_path: Path,
) -> None:
    config = tmp_path / "picker.json"
    config.write_text(json.dumps({"tenants": {"budgets": {"acme": BUDGET}}}))
    options = StackOptions(
        replicas=2,
        sim_args=("--ttft-ms", "5", "--itl-ms", "1"),
        picker_args=("--config", str(config)),
        pickers=2,
        peers=True,
        envoy_picker_tls=False,
    )
    stack = Stack(tmp_path, options)
    try:
        await asyncio.to_thread(stack.start)
        answers: list[tuple[int, dict[str, str]]] = []
        others: list[int] = []
        async with http_client.AsyncClient(timeout=10) as client:
            # one at a time (each picker hears the other's spending in between), each to the other
            # picker than the last: Envoy takes the pickers in turn by stream, so where the last went
            # to the same one, the turn is moved on
            last: int | None = None
            for i in range(SENT):
                before = await asyncio.to_thread(_acme_requests, stack)
                answers.append(await _send(client, stack.url, "acme"))
                after = await asyncio.to_thread(_acme_requests, stack)
                (took,) = [p for p, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
                if took == last:
                    await _turn(client, stack.url)
                last = took
                if i % 2:
                    others.append((await _send(client, stack.url, "other-co"))[0])
        views = [await asyncio.to_thread(_tenants, port) for _, _, port in stack.picker_ports]
    finally:
        await asyncio.to_thread(stack.stop)
    admitted = [h for status, h in answers if status == 200]
    refused = [h for status, h in answers if status != 200]
    print(
        "two pickers, one budget: admitted",
        len(admitted),
        "of",
        SENT,
        "per picker (requests, over budget):",
        [(v["acme"]["requests"], v["acme"]["over_budget"]) for v in views],
    )
    assert ADMITS <= len(admitted) <= ADMITS + 2  # its budget, and at most one reservation per picker
    assert {status for status, _ in answers} <= {200, 429}
    for h in refused:
        assert h[headers.DROPPED_REASON] == "rejected-over-budget" and int(h[headers.RETRY_AFTER]) >= 1
    assert others == [200] * (SENT // 2)  # another tenant is not held back
    # Envoy spread the tenant over both pickers, both admitted some, each refused what its view of
    # the budget refused
    assert all(v["acme"]["requests"] > v["acme"]["over_budget"] for v in views), views
    assert sum(v["acme"]["over_budget"] for v in views) == len(refused)
    for view in views:
        assert view["acme"]["budget"]["level"] < 0  # each counts every picker's spending
        other = view.get("other-co", {"budget": None, "over_budget": 0})  # it may have met one only
        assert other["budget"] is None and other["over_budget"] == 0
