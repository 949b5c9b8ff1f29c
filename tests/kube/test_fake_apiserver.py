"""The fake API server itself speaks list/watch as kube-apiserver does (checked with a plain client)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import async_wait_until
from tests.kube.fake_apiserver import GROUP_PATH, FakeApiServer, endpoint, parse_selector

PATH = GROUP_PATH + "/namespaces/default/endpointslices"
SELECTOR = {"labelSelector": "kubernetes.io/service-name=vllm"}


def client(fake: FakeApiServer, token: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token or fake.token}"}
    return http_client.AsyncClient(base_url=fake.url, headers=headers, timeout=5)


async def watch_lines(http: httpx.AsyncClient, params: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The first `count` events of one watch (then the client hangs up)."""
    events: list[dict[str, Any]] = []
    async with http.stream("GET", PATH, params={**SELECTOR, "watch": "1", **params}) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        async for line in response.aiter_lines():
            events.append(json.loads(line))
            if len(events) == count:
                break
    return events


async def test_list_has_a_resource_version_and_items_without_kind(fake: FakeApiServer) -> None:
    fake.put_slice("a", [endpoint("10.0.0.1")])
    fake.put_slice("other", [endpoint("10.0.0.9")], service="other")
    async with client(fake) as http:
        body = (await http.get(PATH, params=SELECTOR)).json()
    assert body["kind"] == "EndpointSliceList" and body["metadata"]["resourceVersion"] == str(
        fake.resource_version
    )
    assert [i["metadata"]["name"] for i in body["items"]] == ["a"]
    assert "kind" not in body["items"][0]


async def test_list_pages_with_continue_and_expired_tokens(fake: FakeApiServer) -> None:
    for name in "abc":
        fake.put_slice(name, [endpoint("10.0.0.1")])
    async with client(fake) as http:
        first = (await http.get(PATH, params={**SELECTOR, "limit": 2})).json()
        token = first["metadata"]["continue"]
        fake.put_slice("d", [endpoint("10.0.0.4")])  # not in the snapshot being paged
        second = (await http.get(PATH, params={**SELECTOR, "limit": 2, "continue": token})).json()
        again = await http.get(PATH, params={**SELECTOR, "limit": 2})
        fake.compact()
        expired = await http.get(PATH, params={**SELECTOR, "continue": again.json()["metadata"]["continue"]})
    assert [i["metadata"]["name"] for i in first["items"] + second["items"]] == ["a", "b", "c"]
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert "continue" not in second["metadata"]
    assert expired.status_code == 410 and expired.json()["reason"] == "Expired"


async def test_watch_replays_after_a_version_then_streams_live(fake: FakeApiServer) -> None:
    fake.put_slice("a", [endpoint("10.0.0.1")])
    since = fake.resource_version
    fake.put_slice("a", [endpoint("10.0.0.1", ready=False)])
    fake.delete_slice("a")
    async with client(fake) as http:
        events = await watch_lines(http, {"resourceVersion": since}, 2)
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert int(events[1]["object"]["metadata"]["resourceVersion"]) == fake.resource_version


async def test_watch_without_a_version_starts_with_synthetic_adds(fake: FakeApiServer) -> None:
    fake.put_slice("a", [endpoint("10.0.0.1")])
    fake.put_slice("b", [endpoint("10.0.0.2")])
    async with client(fake) as http:
        events = await watch_lines(http, {}, 2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a"), ("ADDED", "b")]


async def test_bookmarks_only_when_asked_for(fake: FakeApiServer) -> None:
    async with client(fake) as http:
        asked = asyncio.create_task(
            watch_lines(http, {"resourceVersion": fake.resource_version, "allowWatchBookmarks": "true"}, 1)
        )
        plain = asyncio.create_task(watch_lines(http, {"resourceVersion": fake.resource_version}, 1))
        await async_wait_until(lambda: fake.live_watches == 2, 5, what="two watches")
        assert fake.send_bookmarks() == 1
        fake.put_slice("a", [endpoint("10.0.0.1")])
        bookmark, added = await asyncio.gather(asked, plain)
    assert bookmark[0]["type"] == "BOOKMARK" and bookmark[0]["object"]["metadata"] == {
        "resourceVersion": str(fake.resource_version - 1)
    }
    assert added[0]["type"] == "ADDED"


@pytest.mark.parametrize("gone_as", ["event", "http"])
async def test_too_old_version_is_410(fake: FakeApiServer, gone_as: str) -> None:
    fake.gone_as = gone_as
    fake.put_slice("a", [endpoint("10.0.0.1")])
    old = fake.resource_version - 1
    fake.compact()
    async with client(fake) as http:
        if gone_as == "http":
            response = await http.get(PATH, params={**SELECTOR, "watch": "1", "resourceVersion": old})
            assert response.status_code == 410 and response.json()["code"] == 410
        else:
            (event,) = await watch_lines(http, {"resourceVersion": old}, 1)
            assert event["type"] == "ERROR" and event["object"]["code"] == 410
            assert event["object"]["reason"] == "Expired"


async def test_label_changes_move_objects_in_and_out_of_a_watch(fake: FakeApiServer) -> None:
    fake.put_slice("a", [endpoint("10.0.0.1")], service="other")
    since = fake.resource_version
    fake.put_slice("a", [endpoint("10.0.0.1")], service="vllm")
    fake.put_slice("a", [endpoint("10.0.0.1")], service="other")
    async with client(fake) as http:
        events = await watch_lines(http, {"resourceVersion": since}, 2)
    assert [e["type"] for e in events] == ["ADDED", "DELETED"]


async def test_timeout_seconds_ends_the_stream_cleanly(fake: FakeApiServer) -> None:
    async with client(fake) as http:
        response = await http.get(
            PATH,
            params={
                **SELECTOR,
                "watch": "1",
                "resourceVersion": fake.resource_version,
                "timeoutSeconds": "0",
            },
        )
    assert response.status_code == 200 and response.text == ""


async def test_dropped_watch_breaks_the_chunked_stream(fake: FakeApiServer) -> None:
    async with client(fake) as http:

        async def read_all() -> None:
            async with http.stream(
                "GET", PATH, params={**SELECTOR, "watch": "1", "resourceVersion": fake.resource_version}
            ) as r:
                async for _ in r.aiter_lines():
                    pass

        reader = asyncio.create_task(read_all())
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        assert fake.drop_watches() == 1
        with pytest.raises(httpx.RemoteProtocolError):
            await reader


async def test_auth_failures_and_bad_requests_are_status_objects(fake: FakeApiServer) -> None:
    async with client(fake, token="wrong") as http:
        unauthorized = await http.get(PATH)
    async with client(fake) as http:
        fake.fail_next(1, 403)
        forbidden = await http.get(PATH)
        bad = await http.get(PATH, params={"labelSelector": "a in (b)"})
        bad_version = await http.get(PATH, params={"watch": "1", "resourceVersion": "abc"})
    assert unauthorized.status_code == 401 and unauthorized.json()["kind"] == "Status"
    assert forbidden.status_code == 403 and bad.status_code == 400 and bad_version.status_code == 400


def test_selector_parsing() -> None:
    labels = {"app": "vllm", "tier": "gpu"}
    assert all(r.matches(labels) for r in parse_selector("app=vllm,tier!=cpu,tier,!missing"))
    assert not all(r.matches(labels) for r in parse_selector("app==other"))
    with pytest.raises(ValueError):
        parse_selector("app in (a,b)")


async def test_pods_pools_and_objectives_each_in_their_own_collection(fake: FakeApiServer) -> None:
    fake.put_pod("vllm-0", "10.0.0.1")
    fake.put_pod("web", "10.0.0.2", labels={"app": "web"})
    fake.put_pool("vllm")
    fake.put_pool("other")
    fake.put_objective("critical", priority=5)
    pools = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
    async with client(fake) as http:
        pods = (
            await http.get("/api/v1/namespaces/default/pods", params={"labelSelector": "app=vllm"})
        ).json()
        named = (await http.get(pools, params={"fieldSelector": "metadata.name=vllm"})).json()
        objectives = (
            await http.get(
                "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferenceobjectives"
            )
        ).json()
        unsupported = await http.get(pools, params={"fieldSelector": "status.phase=Running"})
        slices = (await http.get(PATH)).json()
        async with http.stream(
            "GET", pools, params={"watch": "1", "fieldSelector": "metadata.name=vllm"}
        ) as r:
            lines = r.aiter_lines()
            first = json.loads(await anext(lines))
            fake.put_pool("other", ports=(9000,))  # another pool: not for this watch
            fake.put_pod("vllm-0", "10.0.0.1", deleting=True)  # another collection: not for it either
            fake.put_pool("vllm", ports=(8000, 8001))
            second = json.loads(await anext(lines))
    assert pods["kind"] == "PodList" and [p["metadata"]["name"] for p in pods["items"]] == ["vllm-0"]
    assert [p["metadata"]["name"] for p in named["items"]] == ["vllm"] and named[
        "kind"
    ] == "InferencePoolList"
    assert [o["spec"]["priority"] for o in objectives["items"]] == [5]
    assert unsupported.status_code == 400 and slices["items"] == []
    assert (first["type"], first["object"]["metadata"]["name"]) == ("ADDED", "vllm")
    assert second["type"] == "MODIFIED" and second["object"]["spec"]["targetPorts"][1] == {"number": 8001}
