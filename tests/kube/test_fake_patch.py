"""The fake API server's PATCH and SelfSubjectAccessReview answer as kube-apiserver's do (checked with a
plain client): merge-patch semantics, watches see the change, preconditions, validation, RBAC."""

from __future__ import annotations

import json
from typing import Any

import httpx

from loadtest import http_client
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.fake_patch import DELETION_COST, MERGE_PATCH, SELF_REVIEW, merge_patch

POD = "/api/v1/namespaces/default/pods/vllm-0"


def client(fake: FakeApiServer, token: str | None = None) -> httpx.AsyncClient:
    return http_client.AsyncClient(
        base_url=fake.url, headers={"Authorization": f"Bearer {token or fake.token}"}, timeout=5
    )


async def patch(http: httpx.AsyncClient, body: Any, content_type: str = MERGE_PATCH) -> httpx.Response:
    return await http.patch(POD, content=json.dumps(body), headers={"Content-Type": content_type})


def cost_patch(value: str, **meta: str) -> dict[str, Any]:
    return {"metadata": {**meta, "annotations": {DELETION_COST: value}}}


def test_merge_patch_is_rfc_7386() -> None:
    target = {"a": {"b": 1, "c": [1, 2]}, "d": "x"}
    assert merge_patch(target, {"a": {"b": None, "c": [3]}, "e": {"f": 1}}) == {
        "a": {"c": [3]},
        "d": "x",
        "e": {"f": 1},
    }
    assert merge_patch(target, {"d": None}) == {"a": {"b": 1, "c": [1, 2]}}


async def test_a_patch_changes_only_what_it_names_and_watches_see_it(fake: FakeApiServer) -> None:
    before = fake.put_pod("vllm-0", "10.0.0.1", labels={"app": "vllm", "tier": "a"})
    async with client(fake) as http:
        answer = await patch(http, cost_patch("-5"))
        history = await http.get(
            "/api/v1/namespaces/default/pods",
            params={
                "watch": "1",
                "resourceVersion": before["metadata"]["resourceVersion"],
                "timeoutSeconds": 1,
            },
        )
        removed = await patch(http, {"metadata": {"annotations": {DELETION_COST: None}}})
    assert answer.status_code == 200
    after = answer.json()
    assert after["metadata"]["annotations"] == {DELETION_COST: "-5"}
    assert after["metadata"]["labels"] == {"app": "vllm", "tier": "a"}  # untouched
    assert after["spec"] == before["spec"] and after["status"] == before["status"]
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]  # metadata only
    assert int(after["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])
    (event, *_) = [json.loads(line) for line in history.text.splitlines()]
    assert event["type"] == "MODIFIED" and event["object"]["metadata"]["annotations"] == {DELETION_COST: "-5"}
    assert removed.json()["metadata"]["annotations"] == {}


async def test_preconditions_validation_and_unsupported_patches_are_refused(fake: FakeApiServer) -> None:
    pod = fake.put_pod("vllm-0", "10.0.0.1")
    version = pod["metadata"]["resourceVersion"]
    async with client(fake) as http:
        other_uid = await patch(http, cost_patch("1", uid="uid-of-another-pod"))
        own_uid = await patch(http, cost_patch("1", uid=pod["metadata"]["uid"]))
        stale = await patch(http, cost_patch("2", resourceVersion=version))
        renamed = await patch(http, {"metadata": {"name": "vllm-1"}})
        not_int32 = await patch(http, cost_patch("2147483648"))
        not_a_number = await patch(http, cost_patch("cheap"))
        strategic = await patch(http, cost_patch("3"), "application/strategic-merge-patch+json")
        not_an_object = await patch(http, [1, 2])
        missing = await http.patch(
            "/api/v1/namespaces/default/pods/nobody",
            content=json.dumps(cost_patch("1")),
            headers={"Content-Type": MERGE_PATCH},
        )
    assert other_uid.status_code == 409 and "Precondition failed: UID" in other_uid.json()["message"]
    assert own_uid.status_code == 200
    assert stale.status_code == 409 and "ResourceVersion" in stale.json()["message"]
    assert renamed.status_code == 400
    assert not_int32.status_code == 422 and "must be a 32bit integer" in not_int32.json()["message"]
    assert not_a_number.status_code == 422
    assert strategic.status_code == 415
    assert not_an_object.status_code == 400
    assert missing.status_code == 404
    assert fake.objects(selector="", resource="pods")[0]["metadata"]["annotations"] == {DELETION_COST: "1"}


async def test_rbac_once_on_forbids_an_ungranted_patch_and_self_reviews_say_so(fake: FakeApiServer) -> None:
    fake.put_pod("vllm-0", "10.0.0.1")
    token = fake.add_token("picker-token")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"verb": "patch", "resource": "pods", "namespace": "default"}},
    }
    async with client(fake, token) as http:
        open_before = (await http.post(SELF_REVIEW, json=review)).json()["status"]
        fake.rbac()
        denied = (await http.post(SELF_REVIEW, json=review)).json()["status"]
        forbidden = await patch(http, cost_patch("1"))
        fake.grant_resource(fake.user_of(token), "patch", "pods")
        allowed = (await http.post(SELF_REVIEW, json=review)).json()["status"]
        patched = await patch(http, cost_patch("1"))
        attributes = {**review["spec"]["resourceAttributes"], "namespace": "x"}
        other_namespace = {**review, "spec": {"resourceAttributes": attributes}}
        elsewhere = (await http.post(SELF_REVIEW, json=other_namespace)).json()["status"]
        invalid = await http.post(SELF_REVIEW, json={"spec": {}})
    assert open_before == {"allowed": True}
    assert denied == {"allowed": False}
    assert forbidden.status_code == 403 and 'cannot patch resource "pods"' in forbidden.json()["message"]
    assert allowed["allowed"] is True and allowed["reason"].startswith("RBAC: allowed")
    assert patched.status_code == 200
    assert elsewhere == {"allowed": False}
    assert invalid.status_code == 422
    assert [p["status"] for p in fake.patches] == [403, 200]
