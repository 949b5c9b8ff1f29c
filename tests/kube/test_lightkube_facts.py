"""What the installed lightkube (1.0.x) does on its own, pinned: the reasons the picker owns its loop.

If an upgrade changes one of these, this file says so, and kube_api.py's docstring needs a look.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import httpx2
import msgspec
import pytest
from lightkube import AsyncClient
from lightkube.config.client_adapter import ConnectionParams
from lightkube.core import decoders
from lightkube.core.generic_client import GenericAsyncClient
from lightkube.resources.discovery_v1 import EndpointSlice
from lightkube.types import OnErrorAction, OnErrorResult

from picker.sources.kube_api import load_kubeconfig
from tests.kube.fake_apiserver import FakeApiServer, endpoint


def test_the_installed_version_is_the_one_read() -> None:
    assert version("lightkube").startswith("1.0.")


def test_its_watch_reads_without_a_timeout(kubeconfig: Path) -> None:
    client = GenericAsyncClient(
        ConnectionParams(timeout=httpx2.Timeout(10)), config=load_kubeconfig(kubeconfig)
    )
    assert client._watch_timeout.read is None  # a silently dead connection would hang forever


def test_its_models_cannot_decode_a_bookmark() -> None:
    bookmark = {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"resourceVersion": "7"},
    }
    with pytest.raises(msgspec.ValidationError, match="addressType"):
        decoders.decode_object(json.dumps(bookmark).encode(), EndpointSlice)


async def test_its_watch_asks_for_no_bookmarks_and_a_retried_410_never_reports_the_missed_delete(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    fake.put_slice("a", [endpoint("10.0.0.1")])
    fake.put_slice("b", [endpoint("10.0.0.2")])
    old = str(fake.resource_version)
    fake.delete_slice("b")
    fake.compact()  # the delete is gone from the history

    def retry(_: Exception, __: int) -> OnErrorResult:
        return OnErrorResult(OnErrorAction.RETRY)

    client = AsyncClient(load_kubeconfig(kubeconfig))
    seen: list[tuple[str, str]] = []
    try:
        async for kind, obj in client.watch(
            EndpointSlice, namespace="default", resource_version=old, on_error=retry
        ):
            seen.append((kind, obj.metadata.name))
            break
    finally:
        await client.close()
    # After the 410 it watched again from "now": "a" arrives as a synthetic ADDED, and nothing ever
    # says that "b" is gone. A consumer that only follows events keeps "b" forever.
    assert seen == [("ADDED", "a")]
    first, second = fake.watch_requests()
    assert first["resourceVersion"] == old and "resourceVersion" not in second
    assert "allowWatchBookmarks" not in first
